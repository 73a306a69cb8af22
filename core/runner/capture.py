"""The capture session: every CUDA graph of a runner captured at once, after its KV cache.

Decode graphs for every batch size (:class:`~pitstop.runner.graphs.DecodeGraphs`),
piecewise graphs for prefill and mixed steps
(:class:`~pitstop.runner.piecewise.PiecewiseGraphs`) when the model has the
split forward, and what the caller adds (verification graphs with
speculation: :func:`pitstop.runner.verify_graphs.capture_verify_graphs`).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

from pitstop.runner.graphs import DecodeGraphs
from pitstop.runner.piecewise import PiecewiseGraphs, mixed_step_tokens, supports_piecewise
from pitstop.runner.view import RunnerView

log = logging.getLogger(__name__)


def capture_graphs(runner: RunnerView, extra: Callable[[RunnerView], None] | None) -> None:
    """Capture ``runner``'s decode graphs, its piecewise graphs and ``extra``'s in one session.

    Python's garbage collection is held off during capture: a collection
    could free another engine's graphs, events or pinned buffers, which a
    capturing stream forbids.
    """
    cfg = runner.config
    start = time.perf_counter()
    gc.collect()
    gc.disable()
    try:
        runner.graphs = DecodeGraphs(runner, max_batch=min(cfg.max_batch_size, 512))
        if supports_piecewise(runner.model):
            try:
                runner.mixed_graphs = PiecewiseGraphs(
                    runner, max_tokens=mixed_step_tokens(runner.step_token_budget)
                )
            except Exception as exc:  # noqa: BLE001 - eager prefill still works
                torch.cuda.synchronize(runner.device)
                log.warning(
                    "piecewise CUDA graphs off (capture failed: %s); prefill and mixed "
                    "steps run eagerly",
                    exc,
                )
        if extra is not None:
            extra(runner)
    finally:
        gc.enable()
    if runner.poison:  # what a replay reads, each replay must have written
        for graphs in (runner.graphs, runner.mixed_graphs, runner.verify_graphs):
            if graphs is not None:
                graphs.poison()
    log.info(
        "captured CUDA graphs for decode batch sizes %s and %s in %.1f s",
        runner.graphs.describe(),
        f"prefill/mixed steps up to {runner.mixed_graphs.max_tokens} tokens (piecewise)"
        if runner.mixed_graphs is not None
        else "no prefill steps (the model has no before/after_attention)",
        time.perf_counter() - start,
    )
