"""What the kernels of this package decide by timing on the device, and where it is kept.

:func:`time_replays` times a call the way the engine runs it (replays of a CUDA graph);
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


def time_replays(fn: Callable[[], object], calls: int = 1) -> float:
    """Milliseconds per ``fn()`` on the GPU: ``do_bench``'s median over replays of a CUDA
    graph of ``calls`` calls of it (as the engine's steps run it: eager timing of a
    decode-sized call measures the host's launches; several calls a graph let programmatic
    dependent launch overlap one call with the next, as in a layer), or eagerly where the
    capture fails. ``fn`` runs once eagerly first (it compiles; one that cannot run raises)."""
    from triton.testing import do_bench

    fn()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as err:  # a capture-unsafe call: time it eagerly
        logger.info("timing eagerly, the capture failed: %s", err)
        return do_bench(fn, warmup=5, rep=25)
    try:
        return do_bench(graph.replay, warmup=5, rep=25) / calls
    finally:
        del graph
