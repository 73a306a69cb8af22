"""Python's garbage collector and a serving engine: the start-up heap is frozen.

A full (generation-2) collection walks every tracked object. After start-up
that is the whole heap of torch, the model's modules, the tokenizer and the
engine (about 177,000 objects for a dummy `qwen3-0.6b` on the CPU, 110 ms a
collection there; one such collection stalled a `nano` step by 93–124 ms on
the H200). Objects alive at the end of start-up live as long as the engine,
so :func:`freeze_startup_heap` moves them into the permanent generation
(``gc.freeze()``, as vLLM's engine core does): later collections walk only
what serving made since.

The freeze is process-wide. Frozen objects are never collected, so a cycle
of an engine dropped without ``close()`` would stay; each start-up therefore
begins with :func:`reclaim_frozen` (thaw, and collect what earlier engines
left before the new one sizes its cache from the free memory), and
:func:`thaw_heap` (called by ``LLMEngine.close``, and at exit, so that
extension objects are finalized as before) gives everything back to the
collector.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

log = logging.getLogger(__name__)


def reclaim_frozen() -> None:
    """Thaw every frozen object and collect: what engines dropped without ``close()`` left.

    An engine calls this first, before it sizes its KV cache from the free
    memory, so that a dropped engine's device memory is back by then.
    """
    gc.unfreeze()
    gc.collect()


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug(
        "froze %d objects of the start-up heap (%.0f ms)",
        frozen,
        (time.perf_counter() - start) * 1e3,
    )
    return frozen


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (they join the oldest generation)."""
    gc.unfreeze()


# the interpreter's last collections must see everything (a no-op when nothing is frozen)
atexit.register(thaw_heap)
