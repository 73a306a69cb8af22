"""The fused layer's choice per op and shape: a Triton launch shape or cuBLAS, by timing on the device.

Each of the fused layer's projections (``norm_linear``, ``norm_gate_up``,
``linear_residual``: :mod:`.fused_linear`) can run as one Triton GEMM with the norm,
activation or residual inside, or as cuBLAS with the row scale left to the op after it
and the residual added by cuBLAS itself (:mod:`pitstop.plugins.kernels.fused_layer`).
Which is faster depends on the rows, the shape, the tile and the GPU: on the H200
(2026-12-04) the Triton GEMMs of a ``qwen3-0.6b`` step, in their 64-row tiles, beat cuBLAS
at 16 rows and lost at 64. So :meth:`LayerChoice.launch_shape` times, the first time a
shape is seen on a GPU (outside a CUDA-graph capture: the runner runs each batch size once
before capturing it), the cuBLAS way and every Triton launch shape of
:func:`.fused_linear.tile_candidates` on the call's own inputs, each as replays of a CUDA
graph of a few calls (programmatic dependent launch overlaps them as in a layer), each call
on its own copy of a weight small enough to stay in L2 (:data:`ROTATE_MAX_BYTES`: in a
step every layer's weight comes from HBM, and a graph of four calls on one 16 MB weight
timed three of them on L2 hits), after checking each Triton shape's output against the
reference (one that disagrees is dropped and logged). The fastest Triton shape is kept,
or cuBLAS where it is ahead by more than
:data:`CUBLAS_MARGIN_US` (the overlap a cuBLAS launch costs its neighbours in a layer; above
:data:`CUBLAS_MARGIN_MAX_ROWS` rows, where it is ahead at all), in
memory and in ``fused_layer.json`` under :func:`.tuning.cache_dir` (keyed by op, row
bucket, shape, dtype, device name, Triton version and :data:`CHOICE_REVISION`), as the
fused MoE op's tiles are. Rows above ``tune_rows`` take cuBLAS, untimed.

Where nothing can be timed (Triton's interpreter, no CUDA, timing off, or a capture that
meets an untimed shape) the rule is ``static_rows``: the table's launch shape
(:func:`.fused_linear.choose_config`) up to that many rows, cuBLAS above.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch
import triton

from pitstop.plugins.kernels.triton_ops import tuning
from pitstop.plugins.kernels.triton_ops.fused_linear import LinearConfig
from pitstop.plugins.kernels.triton_ops.launch_math import next_power_of_2

logger = logging.getLogger(__name__)

CALLS_PER_GRAPH = 4  # calls of an op in one timed graph (PDL chains them, as in a layer)
CUBLAS = "cublas"  # the stored choice of cuBLAS
# cuBLAS is kept only where it beats the best Triton shape by more than this (microseconds
# a call): in a layer its launch cannot be chained by programmatic dependent launch, so the
# Triton kernels before and after it lose their overlap, which the timed graph of one op
# does not see. On one H100 (2026-12-06, moe-ab, dummy:qwen3-30b-a3b at batch 1) the fused
# layer with every projection in Triton ran 256.5 tok/s against 253.7 with the timed choice,
# which had kept cuBLAS for the QKV projection (8.46 us a call timed alone): 0.85 us a layer
# in the step, so cuBLAS's timed lead there was worth less than nothing. With this margin at
# 1 us and each timed call on its own copy of the weight, one H200 (2026-12-06, 7cfa8dc) still
# kept cuBLAS for that projection at every row count, and the rule's Triton run 296.3 tok/s
# against 291.2: 1.2 us a layer faster in the step on top of a timed lead of over 1 us, so a
# cuBLAS launch there costs its neighbours at least 2.2 us that the timing does not see
CUBLAS_MARGIN_US = 2.5
# the margin holds up to this many rows; above them the faster way is kept as timed. The
# overlap the margin stands for is a few microseconds of weight prefetch, which a
# latency-bound step of few rows feels and a step of hundreds of rows does not: on one H100
# (2026-12-07, fdc2797, nano on dummy:qwen3-0.6b, medians of 3) the layer with the margin at
# every row count ran 1% below the unfused one (19,351 against 19,536 tok/s), having kept
# Triton for both residual projections at 256 rows 2.1 and 2.2 us behind cuBLAS (28 layers:
# about 120 us of a step of about 8 ms)
CUBLAS_MARGIN_MAX_ROWS = 32
# part of every key: a choice made under another rule is timed again (3: the timed calls on
# copies of the weight, ROTATE_MAX_BYTES; 4: the 2.5 us margin; 5: only up to 32 rows; 6: an
# op with an adapter timed with its rows in an adapter's slot, FusedLayer._config; 7: up to 16
# rows the table's tile unsplit among the candidates, fused_linear.unsplit_tiles; 8: a LoRA's
# shared shrink among them, LinearConfig.shared_shrink; 9: stream-K among them up to 16 rows,
# LinearConfig.stream_k, a choice of eight numbers)
CHOICE_REVISION = 9
# a weight of up to this many bytes is copied for the timing, one copy a call of the timed
# graph, so that no call reads it from L2 (the H100's and H200's L2 hold 50 MB; a larger
# weight streamed again from its start finds its first lines evicted by its last); at most
# CALLS_PER_GRAPH - 1 copies exist at once, only while a shape is timed
ROTATE_MAX_BYTES = 128 * 2**20
# the largest relative error (max |out - reference| / max |reference|) a timed Triton launch
# shape may show on the call's inputs before it is dropped
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}

TritonRun = Callable[[LinearConfig, torch.Tensor], torch.Tensor]  # (launch shape, weight)
CublasRun = Callable[[torch.Tensor], object]  # (weight)


def bucket_rows(rows: int) -> int:
    """The row bucket a choice is kept for: ``rows`` rounded up to a power of two."""
    return next_power_of_2(max(rows, 1))


class LayerChoice:
    """A Triton launch shape, or cuBLAS, for each fused-layer op and shape (module docstring)."""

    FILE = "fused_layer.json"

    def __init__(
        self,
        static_rows: int,
        tune_rows: int,
        timed: bool,
        directory: Path | None = None,
        timer: Callable[[Callable[[], object], int], float] = tuning.time_replays,
    ) -> None:
        """``static_rows``: Triton up to this many rows where nothing is timed
        (``fused.layer_rows``); ``tune_rows``: the most rows timed (``fused.layer_tune_rows``);
        ``timed``: time on a GPU (``fused.layer_tune``); ``timer``: ms per call of a function
        run that many times a graph (:func:`.tuning.time_replays`)."""
        self.static_rows, self.tune_rows, self.timed = static_rows, tune_rows, timed
        self.timer = timer
        self.directory = Path(directory) if directory is not None else tuning.cache_dir("fused")
        self._store = tuning.JsonStore(self.directory, self.FILE)
        self._memory: dict[str, LinearConfig | None] = {}
        self._logged = False

    @property
    def max_rows(self) -> int:
        """The most rows any Triton launch may take (a cheap test before anything else)."""
        return max(self.static_rows, self.tune_rows) if self.timed else self.static_rows

    @staticmethod
    def key(op: str, x: torch.Tensor, weight: torch.Tensor, device_name: str) -> str:
        """``op|M<bucket>-N-K|dtype|device name|triton version|rule <CHOICE_REVISION>``."""
        shape = f"M{bucket_rows(x.shape[0])}-N{weight.shape[0]}-K{weight.shape[1]}"
        dtype = str(x.dtype).removeprefix("torch.")
        return (
            f"{op}|{shape}|{dtype}|{device_name}|triton {triton.__version__}|rule {CHOICE_REVISION}"
        )

    def launch_shape(
        self,
        op: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        candidates: list[LinearConfig],
        run_triton: TritonRun,
        run_cublas: CublasRun,
        expected: Callable[[], torch.Tensor],
        timing: Callable[[], AbstractContextManager[object]] | None = None,
    ) -> LinearConfig | None:
        """The Triton launch shape ``op`` runs for ``x [M, K]`` and ``weight [N, K]``, or None for
        cuBLAS. ``candidates``: the Triton shapes to time (the table's first, the untimed
        answer); ``run_triton(config, w)`` / ``run_cublas(w)``: a call of the op each way on
        these inputs with ``w`` for ``weight`` (``weight`` itself or a copy of it);
        ``expected()``: the op's reference result, which a Triton shape must match;
        ``timing()``: a context the timing runs in, where it runs (None: none)."""
        rows = x.shape[0]
        if not self.timed or not self.can_time(x):
            return candidates[0] if rows <= self.static_rows else None
        if rows > self.tune_rows:
            return None
        key = self.key(op, x, weight, self.device_name(x))
        if key in self._memory:
            return self._memory[key]
        found, choice = self._stored(key)
        if not found and self.capturing():
            if not self._logged:
                self._logged = True
                logger.warning(
                    "fused layer: %s first seen inside a CUDA graph capture: Triton up to %d "
                    "rows, untimed (run each batch size once before capturing)",
                    key,
                    self.static_rows,
                )
            return candidates[0] if rows <= self.static_rows else None
        if not found:
            with timing() if timing is not None else contextlib.nullcontext():
                choice = self._time(
                    key,
                    x.dtype,
                    weight,
                    candidates,
                    run_triton,
                    run_cublas,
                    expected,
                    bucket_rows(rows),
                )
        self._memory[key] = choice
        return choice

    def _stored(self, key: str) -> tuple[bool, LinearConfig | None]:
        """(whether the file has ``key``, its choice)."""
        entry = self._store.read().get(key)
        if entry == CUBLAS:
            return True, None
        if isinstance(entry, list) and len(entry) == len(LinearConfig._fields):
            return True, LinearConfig(*(int(v) for v in entry))
        return False, None

    def weight_copies(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """``weight`` and, where it has at most :data:`ROTATE_MAX_BYTES`, ``CALLS_PER_GRAPH -
        1`` copies of it, so that each call of a timed graph reads a weight no earlier call
        left in L2 (only ``weight`` where the device has no room for the copies)."""
        if weight.numel() * weight.element_size() > ROTATE_MAX_BYTES:
            return [weight]
        try:
            return [weight] + [weight.clone() for _ in range(CALLS_PER_GRAPH - 1)]
        except torch.OutOfMemoryError:
            logger.info("fused layer: no room to copy a %s weight: timed on one", weight.shape)
            return [weight]

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
        self,
        key: str,
        dtype: torch.dtype,
        weight: torch.Tensor,
        candidates: list[LinearConfig],
        run_triton: TritonRun,
        run_cublas: CublasRun,
        expected: Callable[[], torch.Tensor],
        rows: int,
    ) -> LinearConfig | None:
        """Time cuBLAS and every candidate that runs and matches ``expected``, each timed call
        on the next of :meth:`weight_copies`; keep the fastest Triton shape unless cuBLAS
        beats it by more than :data:`CUBLAS_MARGIN_US` (up to :data:`CUBLAS_MARGIN_MAX_ROWS`
        rows) or at all (above them)."""
        turn = itertools.cycle(self.weight_copies(weight))
        cublas_ms = self.timer(lambda: run_cublas(next(turn)), CALLS_PER_GRAPH)
        timings: list[tuple[float, str, LinearConfig]] = []  # the Triton shapes that ran
        want = expected().float()
        scale = max(float(want.abs().max()), 1e-30)
        for config in candidates:
            try:
                err = float((run_triton(config, weight).float() - want).abs().max()) / scale
                if not err <= CHECK_TOLERANCE.get(dtype, 4e-2):  # NaN fails too
                    logger.warning("fused layer: %s: %s off by %.3g: dropped", key, config, err)
                    continue
                ms = self.timer(
                    lambda config=config: run_triton(config, next(turn)), CALLS_PER_GRAPH
                )
            except Exception as exc:  # noqa: BLE001 - a launch that cannot run is dropped
                logger.info("fused layer: %s: %s failed to run (%s): dropped", key, config, exc)
                continue
            timings.append((ms, str(tuple(config)), config))
        best: LinearConfig | None
        triton_ms, name, best = min(
            timings, key=lambda t: t[0], default=(float("inf"), "no Triton shape", None)
        )
        margin_us = CUBLAS_MARGIN_US if rows <= CUBLAS_MARGIN_MAX_ROWS else 0.0
        if cublas_ms + margin_us * 1e-3 < triton_ms:  # cuBLAS clearly ahead
            best = None
        logger.info(
            "fused layer: %s: %s (cuBLAS %.2f us, the best Triton shape %s %.2f us; cuBLAS "
            "is kept only when over %.1f us ahead)",
            key,
            CUBLAS if best is None else name,
            cublas_ms * 1e3,
            name,
            triton_ms * 1e3,
            margin_us,
        )
        self._store.write(key, CUBLAS if best is None else list(best))
        return best
