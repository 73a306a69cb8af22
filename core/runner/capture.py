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

from pitstop.runner.graphs import DecodeGraphs, ForwardParts
from pitstop.runner.piecewise import PiecewiseGraphs, mixed_step_tokens, supports_piecewise

log = logging.getLogger(__name__)


def capture_graphs(
    parts: ForwardParts,
    max_batch_size: int,
    step_token_budget: int,
    extra: Callable[[], DecodeGraphs | None] | None = None,
    piecewise_max_tokens: int = 2048,
) -> tuple[DecodeGraphs, PiecewiseGraphs | None]:
    """Capture the decode graphs and the piecewise graphs of ``parts``' forward, and
    ``extra``'s, in one session; returns (decode, piecewise or None).

    ``extra()`` captures more graphs (verification) and returns them, or None;
    with ``parts.poison`` every set captured is poisoned afterwards. Python's
    garbage collection is held off during capture: a collection could free
    another engine's graphs, events or pinned buffers, which a capturing
    stream forbids.
    """
    start = time.perf_counter()
    mixed: PiecewiseGraphs | None = None
    extra_graphs: DecodeGraphs | None = None
    gc.collect()
    gc.disable()
    try:
        decode = DecodeGraphs(parts, max_batch=min(max_batch_size, 512))
        if supports_piecewise(parts.model):
            try:
                tokens = mixed_step_tokens(step_token_budget, piecewise_max_tokens)
                mixed = PiecewiseGraphs(parts, max_tokens=tokens)
            except Exception as exc:  # noqa: BLE001 - eager prefill still works
                torch.cuda.synchronize(parts.device)
                log.warning(
                    "piecewise CUDA graphs off (capture failed: %s); prefill and mixed "
                    "steps run eagerly",
                    exc,
                )
        if extra is not None:
            extra_graphs = extra()
    finally:
        gc.enable()
    if parts.poison:  # what a replay reads, each replay must have written
        for graphs in (decode, mixed, extra_graphs):
            if graphs is not None:
                graphs.poison()
    log.info(
        "captured CUDA graphs for decode batch sizes %s and %s in %.1f s",
        decode.describe(),
        f"prefill/mixed steps up to {mixed.max_tokens} tokens (piecewise)"
        if mixed is not None
        else "no prefill steps (the model has no before/after_attention)",
        time.perf_counter() - start,
    )
    return decode, mixed
