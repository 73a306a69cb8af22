"""The fused layer's choice per op and shape: its Triton GEMM or cuBLAS, by timing on the device.

Each of the fused layer's projections (``norm_linear``, ``norm_gate_up``,
``linear_residual``: :mod:`.fused_linear`) can run as one Triton GEMM with the norm,
activation or residual inside, or as cuBLAS with the row scale left to the op after it
and the residual added by cuBLAS itself (:class:`pitstop.plugins.kernels.fused.FusedKernels`).
Which is faster depends on the rows, the shape and the GPU: on the H200 (2026-12-04) the
Triton GEMMs of a ``qwen3-0.6b`` step beat cuBLAS at 16 rows and lost at 64. So instead of
one row limit for every shape, :meth:`LayerChoice.use_triton` times both on the call's own
inputs the first time a shape is seen (outside a CUDA-graph capture: the runner runs each
batch size once before capturing it), as replays of a CUDA graph of a few calls (so
programmatic dependent launch overlaps them as in a layer), and keeps the faster in memory
and in ``fused_layer.json`` under :func:`.tuning.cache_dir` (keyed by op, row bucket,
shape, dtype, device name and Triton version), as the fused MoE op's tiles are.

Where nothing can be timed (Triton's interpreter, no CUDA, a capture that meets an untimed
shape, or timing turned off) the rule is the setting's row limit alone: Triton up to
``max_rows`` rows. Above ``max_rows`` it is always cuBLAS, untimed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from pitstop.plugins.kernels.triton_ops import tuning

logger = logging.getLogger(__name__)

CALLS_PER_GRAPH = 4  # calls of an op in one timed graph (PDL chains them, as in a layer)


def bucket_rows(rows: int) -> int:
    """The row bucket a choice is kept for: ``rows`` rounded up to a power of two."""
    return triton.next_power_of_2(max(rows, 1))


class LayerChoice:
    """Triton or cuBLAS for each fused-layer op and shape (see the module docstring)."""

    FILE = "fused_layer.json"

    def __init__(
        self,
        max_rows: int,
        timed: bool,
        directory: Path | None = None,
        timer: Callable[[Callable[[], object], int], float] = tuning.time_replays,
    ) -> None:
        """``max_rows``: the most rows the Triton GEMMs run (and the rule where nothing is
        timed); ``timed``: time each shape on a GPU (``fused.layer_tune``); ``timer``: ms per
        call of a function run that many times a graph (:func:`.tuning.time_replays`)."""
        self.max_rows, self.timed, self.timer = max_rows, timed, timer
        self.directory = Path(directory) if directory is not None else tuning.cache_dir("fused")
        self._store = tuning.JsonStore(self.directory, self.FILE)
        self._memory: dict[str, bool] = {}
        self._logged = False

    @staticmethod
    def key(op: str, x: torch.Tensor, weight: torch.Tensor, device_name: str) -> str:
        """``op|M<bucket>-N-K|dtype|device name|triton version``."""
        shape = f"M{bucket_rows(x.shape[0])}-N{weight.shape[0]}-K{weight.shape[1]}"
        dtype = str(x.dtype).removeprefix("torch.")
        return f"{op}|{shape}|{dtype}|{device_name}|triton {triton.__version__}"

    def use_triton(
        self,
        op: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        run_triton: Callable[[], object],
        run_cublas: Callable[[], object],
    ) -> bool:
        """Whether ``op`` on ``x [M, K]`` and ``weight [N, K]`` runs the Triton GEMM: never
        above ``max_rows``; else the cached choice of its shape, or (first sight, on a GPU,
        outside a capture) the faster of ``run_triton`` and ``run_cublas`` (each a call of
        the op one way, on these inputs), or, where nothing can be timed, yes."""
        if x.shape[0] > self.max_rows:
            return False
        if not self.timed or not self.can_time(x):
            return True
        key = self.key(op, x, weight, self.device_name(x))
        hit = self._memory.get(key)
        if hit is None:
            stored = self._store.read().get(key)
            hit = stored if isinstance(stored, bool) else None
        if hit is None and self.capturing():
            if not self._logged:
                self._logged = True
                logger.warning(
                    "fused layer: %s first seen inside a CUDA graph capture: Triton up to %d "
                    "rows, untimed (run each batch size once before capturing)",
                    key,
                    self.max_rows,
                )
            return True
        if hit is None:
            hit = self._time(key, run_triton, run_cublas)
        self._memory[key] = hit
        return hit

    def can_time(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s device can time a kernel (a CUDA device)."""
        return x.device.type == "cuda"

    def device_name(self, x: torch.Tensor) -> str:
        """The name of ``x``'s GPU, part of the key."""
        return torch.cuda.get_device_name(x.device)

    def capturing(self) -> bool:
        """Whether a CUDA graph is being captured on the current stream (nothing can be timed)."""
        return torch.cuda.is_current_stream_capturing()

    def _time(
        self, key: str, run_triton: Callable[[], object], run_cublas: Callable[[], object]
    ) -> bool:
        """Time both ways; keep and return whether Triton was faster (a Triton launch that
        fails, e.g. for want of shared memory, counts as slower)."""
        cublas = self.timer(run_cublas, CALLS_PER_GRAPH)
        try:
            fused = self.timer(run_triton, CALLS_PER_GRAPH)
        except Exception as err:  # noqa: BLE001 - a launch that cannot run loses
            logger.info("fused layer: %s: the Triton GEMM failed to run (%s): cuBLAS", key, err)
            fused = float("inf")
        faster = fused < cublas
        logger.info(
            "fused layer: %s: Triton %.2f us, cuBLAS %.2f us: %s",
            key,
            fused * 1e3,
            cublas * 1e3,
            "Triton" if faster else "cuBLAS",
        )
        self._store.write(key, faster)
        return faster
