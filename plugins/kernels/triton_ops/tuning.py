"""What the kernels of this package decide by timing on the device, and where it is kept.

:func:`time_replays` times a call the way the engine runs it (replays of a CUDA graph, the
weights out of L2 with nothing dirty in it: :func:`cold_median_ms`);
:class:`JsonStore` keeps the decisions in one JSON file per kind under :func:`cache_dir`, so
that a process tunes a shape once per device, Triton version and dtype. Used by the fused
MoE op's tiles (:mod:`.moe_tiles`) and the fused layer's Triton-or-cuBLAS choice
(:mod:`.layer_choice`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def cache_dir(kind: str) -> Path:
    """``$PITSTOP_CACHE_DIR`` (used as is) or ``~/.cache/pitstop/<kind>``."""
    env = os.environ.get("PITSTOP_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pitstop" / kind


class JsonStore:
    """A JSON object in ``<directory>/<file>``: read at each lookup that misses memory, and
    rewritten whole at each write (re-read first, replaced atomically), so processes tuning at
    once (tensor-parallel ranks) lose nothing but a duplicate timing. An unreadable file
    counts as empty (it is rewritten at the next write); a failed write is logged."""

    def __init__(self, directory: Path, file: str) -> None:
        self.directory, self.file = Path(directory), file

    def read(self) -> dict[str, Any]:
        """The file's entries (empty when it is missing or unreadable)."""
        try:
            data = json.loads((self.directory / self.file).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def write(self, key: str, value: Any) -> None:
        """Add ``key: value`` to the file (JSON-serialisable ``value``)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            data = self.read()
            data[key] = value
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{self.file}.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.directory / self.file)
        except OSError as err:
            logger.warning("could not write %s in %s: %s", self.file, self.directory, err)


# A buffer read before each timed run, larger than any GPU's L2 (the H100's and H200's: 50 MB)
FLUSH_BYTES = 256 * 2**20
_flush_buffers: dict[torch.device, torch.Tensor] = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    """The device's :data:`FLUSH_BYTES` float32 buffer (ones), made at the first call."""
    buffer = _flush_buffers.get(device)
    if buffer is None:
        buffer = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device=device)
        _flush_buffers[device] = buffer
    return buffer


def flush_l2(device: torch.device) -> None:
    """Read :data:`FLUSH_BYTES` on ``device`` (queued on its current stream): afterwards a
    kernel finds its inputs out of L2, and L2 holds no dirty line (:func:`cold_median_ms`)."""
    _flush_buffer(device).sum()


def cold_median_ms(fn: Callable[[], object], warmup: int = 5, rep: int = 25) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device, each timed run after a
    *read* of :data:`FLUSH_BYTES`, so that ``fn`` finds its inputs out of L2 and L2 clean.

    ``triton.testing.do_bench`` clears L2 by writing 256 MB (``zero_``), which leaves L2
    full of dirty lines: a memory-bound kernel timed next writes them back to HBM as its
    reads evict them, up to L2's size (50 MB) of extra traffic. On an H100 that put every
    tile of the fused MoE op's batch-1 GEMMs at about 1.8 TB/s (2026-12-06: 42 us for 75 MB
    of experts in ``moe_bench``, against 34 us a layer in a profiled decode step), and
    hid the differences between tiles that the autotune is there to find. A read leaves
    L2 holding clean lines of the buffer, as a decode step's earlier kernels leave it.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for start, end in zip(starts, ends, strict=True):
        flush_l2(device)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in zip(starts, ends, strict=True))
    return times[len(times) // 2]


def time_replays(fn: Callable[[], object], calls: int = 1) -> float:
    """Milliseconds per ``fn()`` on the GPU: :func:`cold_median_ms` of replays of a CUDA
    graph of ``calls`` calls of it (as the engine's steps run it: eager timing of a
    decode-sized call measures the host's launches; several calls a graph let programmatic
    dependent launch overlap one call with the next, as in a layer), or eagerly where the
    capture fails. ``fn`` runs once eagerly first (it compiles; one that cannot run raises)."""
    fn()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as err:  # a capture-unsafe call: time it eagerly
        logger.info("timing eagerly, the capture failed: %s", err)
        return cold_median_ms(fn)
    try:
        return cold_median_ms(graph.replay) / calls
    finally:
        del graph
