"""Speculative verification steps on the device: CUDA graphs of ``(batch, k + 1)`` buckets.

A step in which every scheduled sequence decodes (one token) or verifies
drafts (its last token and up to ``k`` drafts) has the shape of a decode step
with ``k + 1`` query tokens per sequence: :class:`VerifyGraphs` is the
runner's decode graphs (:class:`pitstop.runner.graphs.DecodeGraphs`) at
``num_query = k + 1``, with the logits computed inside the graph. The
padding and layout rules are there.

The engine hands :func:`capture_verify_graphs` to the runner's graph capture
when speculation is on; the runner replays them and verifies on the device
(:class:`pitstop.runner.launched.LaunchedVerification` brings the results
back in one copy).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pitstop.runner.graphs import DecodeGraphs, ForwardParts
from pitstop.speculation.spec_adaptation import speculation_max_batch

if TYPE_CHECKING:
    from pitstop.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


class VerifyGraphs(DecodeGraphs):
    """CUDA graphs of verification steps: ``batch`` sequences of ``num_query`` tokens each, logits
    included.

    With ``capture=False`` the same static-buffer forward runs eagerly (CPU
    tests of the padding and layout logic).
    """

    def __init__(
        self, parts: ForwardParts, max_batch: int, num_query: int, *, capture: bool = True
    ) -> None:
        super().__init__(parts, max_batch, num_query, logits=True, capture=capture)


def capture_verify_graphs(runner: ModelRunner) -> None:
    """Capture verification steps of (batch, k + 1) tokens for ``runner`` (inside its graph capture)."""
    cfg = runner.config
    try:
        runner.verify_graphs = VerifyGraphs(
            runner.forward_parts(), speculation_max_batch(cfg), cfg.num_speculative_tokens + 1
        )
    except Exception as exc:  # noqa: BLE001 - eager verification still works
        torch.cuda.synchronize(runner.device)
        log.warning("verification CUDA graphs off (capture failed: %s); it runs eagerly", exc)
        return
    log.info("captured CUDA graphs for verification steps: %s", runner.verify_graphs.describe())
