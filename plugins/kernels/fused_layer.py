"""The ``fused`` kernel set's decoder-layer ops (``fused.layer``): Triton GEMMs or cuBLAS per shape.

:class:`FusedLayer` owns the three projections of a fused layer
(:class:`~pitstop.plugin_system.protocols.FusedLayerOps`; the model folds each RMSNorm's
gain into the projection after it at load) and runs each either way:

- **Triton** (:mod:`.triton_ops.fused_linear`): one GEMM with the row's ``1/rms``, the
  SiLU·mul or the residual add inside; six launches a layer in all.
- **cuBLAS**: the QKV GEMM on the un-normalized rows with the row scale handed on to
  ``rope_and_store`` (:meth:`FusedLayer.norm_linear_deferred`), the gate-up GEMM followed
  by the Triton SiLU·mul that applies the row scale itself, the O and down GEMMs adding into
  the residual stream in place (``addmm_``, cuBLAS's beta = 1); seven launches a layer.
  With a bias the row scale runs first instead (one Triton pass), as the bias comes after it.

With an adapter (``lora=``, :class:`~pitstop.plugins.kernels.lora_reference.ProjectionLoRA`)
the Triton GEMMs add each row's LoRA delta inside (no launch of its own); the cuBLAS way
adds it with the adapter's own kernels after the GEMM, on the rows the GEMM took (raw, or
row-scaled where the scale runs first), before SiLU·mul. A call that may mix adapters in
a tile (more than one row and more than one slot) always takes the cuBLAS way
(:func:`_mixes_adapters`).

Which one runs, and in which Triton launch shape, is
:class:`.triton_ops.layer_choice.LayerChoice`'s answer for the op and shape: timed once per
shape on a GPU (``fused.layer_tune``, up to ``fused.layer_tune_rows`` rows), else Triton
up to ``fused.layer_rows`` rows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pitstop.plugins.kernels import reference
from pitstop.plugins.kernels.lora_reference import ProjectionLoRA

# Triton is imported only when the kernel set is built (pitstop.plugins.kernels.fused)
if TYPE_CHECKING:
    from pitstop.plugins.kernels.triton_ops.fused_linear import LinearConfig
    from pitstop.plugins.kernels.triton_ops.layer_choice import LayerChoice

RowScale = tuple[torch.Tensor, float]


def _defers(eps: float | None, bias: torch.Tensor | None) -> bool:
    """Whether the cuBLAS way leaves the row scale to the op after the GEMM: there is a norm
    and no bias (a bias comes after the scale, so with one the scale runs first)."""
    return eps is not None and bias is None


def _mixes_adapters(x: torch.Tensor, lora: ProjectionLoRA | None) -> bool:
    """Whether a Triton tile of this call's rows may hold rows of several adapters: more than
    one row and more than one slot. Such a tile takes one more pass over its K range for
    each adapter past the first (:mod:`.triton_ops.fused_linear`), and the choice of a shape
    is made once, on the rows it times (the warm-up's, all in one slot while timed), so it
    cannot see the mix of a later step: `nano` over 8 adapters ran 0.64x of `nano` with the
    LoRA inside at 256 rows (H100, 2026-12-06, ``bcd4ee9``). Those calls take the cuBLAS way, whose
    delta (the adapter plugin's) groups the rows by adapter."""
    return lora is not None and x.shape[0] > 1 and lora.A[0].shape[0] > 1


@contextlib.contextmanager
def _rows_in_an_adapter(lora: ProjectionLoRA, rows: int) -> Iterator[None]:
    """While an op with an adapter is timed: its ``rows`` rows in slot 0, and slot 0 at the
    largest rank the slots hold (``A``'s), so that the timed Triton shapes read and multiply
    the adapter's A and B as in a step whose rows have one. The timing runs in the runner's
    warm-up, whose rows have no adapter (slot -1: every LoRA load masked off), and so saw the
    GEMM alone, while at one row each column program of a Triton GEMM reads the A of every
    slice (wider tiles read it fewer times). The reference the shapes are checked against
    takes the same slots (an empty slot's A and B are zeros). The cuBLAS way's delta keeps
    the step's grouping of rows by slot (made once a step, before the warm-up's rows had
    any): timed without the adapter's work, which its stacked pack does densely at about the
    same cost whatever the rows' slots. The rows' slots and slot 0's rank are restored after."""
    slots = lora.slot_of_row[:rows]
    saved_slots, saved_rank = slots.clone(), lora.ranks[:1].clone()
    slots.fill_(0)
    lora.ranks[:1].fill_(lora.A[0].shape[1])
    try:
        yield
    finally:
        slots.copy_(saved_slots)
        lora.ranks[:1].copy_(saved_rank)


class FusedLayer:
    """The three fused-layer projections, each Triton or cuBLAS (see the module docstring)."""

    def __init__(
        self,
        gemm: ModuleType,
        choice: LayerChoice,
        row_scaled: Callable[[torch.Tensor, float | None], torch.Tensor],
        silu: ModuleType | None,
        plain_silu: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """``gemm``: :mod:`.triton_ops.fused_linear`; ``row_scaled``: ``x`` times each row's
        ``1/rms`` (one pass); ``silu``: :mod:`.triton_ops.silu` where the Triton SiLU·mul runs
        (it takes the row scale), else None; ``plain_silu``: the kernel set's SiLU·mul."""
        self.gemm, self.choice = gemm, choice
        self.row_scaled, self.silu, self.plain_silu = row_scaled, silu, plain_silu
        # the ProjectionLoRA.h_in (by id) a Triton GEMM of this forward summed the next
        # projection's shrink into (next_lora=): that projection reads it if it runs in Triton
        # too (h_in=True), and forgets it either way
        self._summed: set[int] = set()

    def _reads_summed(self, lora: ProjectionLoRA | None) -> bool:
        """Whether the projection before summed ``lora``'s shrink into its ``h_in`` (forgotten
        here: one read a forward)."""
        if lora is None or lora.h_in is None or id(lora.h_in) not in self._summed:
            return False
        self._summed.discard(id(lora.h_in))
        return True

    def _sums_next(
        self, rows: int, lora: ProjectionLoRA | None, next_lora: ProjectionLoRA | None
    ) -> dict[str, ProjectionLoRA]:
        """``{"next_lora": next_lora}`` for a Triton GEMM of ``rows`` rows that sums the next
        projection's shrink of its output (noted for that projection), where both have an
        adapter's slots and the next has an ``h_in`` of that many rows; else empty."""
        if lora is None or next_lora is None or next_lora.h_in is None:
            return {}
        if rows > next_lora.h_in.shape[0]:  # past the rows the plugin zeroes a step
            return {}
        self._summed.add(id(next_lora.h_in))
        return {"next_lora": next_lora}

    # ------------------------------------------------------------------ QKV
    def norm_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None,
        lora: ProjectionLoRA | None = None,
    ) -> torch.Tensor:
        """``rstd(x) * x @ weight.T (+ bias)`` as one tensor (the scale applied here)."""
        config = self._config("norm_linear", x, weight, eps, bias, lora=lora)
        summed = self._reads_summed(lora)
        if config is not None:
            return self.gemm.norm_linear(
                x, weight, eps, bias, config=config, lora=lora, h_in=summed
            )
        return self._linear(self.row_scaled(x, eps), weight, bias, lora)

    def norm_linear_deferred(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None,
        lora: ProjectionLoRA | None = None,
    ) -> tuple[torch.Tensor, RowScale | None]:
        """The QKV projection: the Triton GEMM with the norm inside, or cuBLAS on the raw rows
        and ``(x, eps)`` for ``rope_and_store`` to scale with (no bias), or the scale first."""
        config = self._config("norm_linear", x, weight, eps, bias, lora=lora)
        summed = self._reads_summed(lora)
        if config is not None:
            out = self.gemm.norm_linear(x, weight, eps, bias, config=config, lora=lora, h_in=summed)
            return out, None
        deferred = (x, eps) if _defers(eps, bias) else None
        return self._cublas_qkv(x, weight, eps, bias, lora), deferred

    # ------------------------------------------------------------------ MLP
    def norm_gate_up(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None,
        lora: ProjectionLoRA | None = None,
        next_lora: ProjectionLoRA | None = None,
    ) -> torch.Tensor:
        """``silu(gate) * up`` of the normed merged gate-up projection; ``next_lora``: the down
        projection's, whose shrink a Triton GEMM here sums (:meth:`linear_residual`)."""
        config = self._config("norm_gate_up", x, weight, eps, bias, lora=lora)
        summed = self._reads_summed(lora)
        if config is not None:
            return self.gemm.norm_gate_up(
                x, weight, eps, bias, config=config, lora=lora, h_in=summed,
                **self._sums_next(x.shape[0], lora, next_lora),
            )  # fmt: skip
        return self._cublas_gate_up(x, weight, eps, bias, lora)

    def _cublas_gate_up(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None,
        lora: ProjectionLoRA | None = None,
    ) -> torch.Tensor:
        if self.silu is not None and _defers(eps, bias):
            return self.silu.silu_and_mul(self._linear(x, weight, None, lora), (x, eps))
        return self.plain_silu(self._linear(self.row_scaled(x, eps), weight, bias, lora))

    @staticmethod
    def _linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora: ProjectionLoRA | None,
    ) -> torch.Tensor:
        """cuBLAS's ``x @ weight.T (+ bias)``, plus the adapter's delta of the same rows (in
        the same GEMM where the adapter stacks its B beside the weight)."""
        if lora is not None and lora.stacked is not None:
            return lora.stacked(x, weight, lambda a, w: F.linear(a, w, bias))
        y = F.linear(x, weight, bias)
        return y if lora is None else lora.add(x, y)

    # ------------------------------------------------------------------ residual writers
    def linear_residual(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        bias: torch.Tensor | None,
        lora: ProjectionLoRA | None = None,
        next_lora: ProjectionLoRA | None = None,
    ) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``: the Triton GEMM's fresh tensor, or cuBLAS adding
        into ``residual`` in place (one launch; the model never reads the old stream again).
        ``next_lora``: the LoRA of the projection that reads this output (the O projection's:
        gate-up; the down projection's: the next layer's QKV), whose shrink the Triton GEMM
        sums in its epilogue into ``next_lora.h_in`` for that projection to read, if it runs
        in Triton too, instead of reading the whole of A in every column program."""
        config = self._config("linear_residual", x, weight, None, bias, residual, lora)
        summed = self._reads_summed(lora)
        if config is not None:
            return self.gemm.linear_residual(
                x, weight, residual, bias, config=config, lora=lora, h_in=summed,
                **self._sums_next(x.shape[0], lora, next_lora),
            )  # fmt: skip
        return self._cublas_residual(x, weight, residual, bias, lora)

    @staticmethod
    def _cublas_residual(
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        bias: torch.Tensor | None,
        lora: ProjectionLoRA | None,
    ) -> torch.Tensor:
        """The cuBLAS way of a residual writer: into ``residual`` in place (``addmm_``), or
        ``residual + x @ weight.T + bias``; then the adapter's delta, in place (or inside the
        GEMM, where the adapter stacks its B beside the weight)."""

        def gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (
                residual + F.linear(a, w, bias) if bias is not None else residual.addmm_(a, w.t())
            )

        if lora is not None and lora.stacked is not None:
            return lora.stacked(x, weight, gemm)
        out = gemm(x, weight)
        return out if lora is None else lora.add(x, out)

    # ------------------------------------------------------------------ the choice
    def _config(
        self,
        op: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None = None,
        lora: ProjectionLoRA | None = None,
    ) -> LinearConfig | None:
        """The Triton launch shape ``op`` runs for this call, or None for cuBLAS
        (:class:`LayerChoice`); what it would time is this very call, the cuBLAS way of the
        residual writers adding into a copy of the residual. With ``lora`` only the shapes
        whose tiles keep each slice apart (:func:`fused_linear.lora_fits`) take part, and
        both ways and the reference include the adapter's delta."""
        if x.shape[0] > self.choice.max_rows or _mixes_adapters(x, lora):
            return None
        gate_up = op == "norm_gate_up"
        m, k = x.shape
        n_out = weight.shape[0] // 2 if gate_up else weight.shape[0]
        sms = self.gemm.num_sms(x.device)
        if x.device.type == "cuda":
            rank = lora.A[0].shape[1] if lora is not None else 0  # 0: no LoRA inside
            candidates = self.gemm.tile_candidates(m, n_out, k, x.dtype, gate_up, sms, rank)
        else:  # the interpreter's tiles
            candidates = [self.gemm.choose_config(m, n_out, k, x.dtype, gate_up, False, sms)]
        if lora is not None:
            candidates = [c for c in candidates if self.gemm.lora_fits(lora, gate_up, c.block_n)]
            if not candidates:
                return None

        def run_triton(config: LinearConfig, w: torch.Tensor) -> torch.Tensor:
            if op == "linear_residual":
                return self.gemm.linear_residual(x, w, residual, bias, config=config, lora=lora)
            return getattr(self.gemm, op)(x, w, eps, bias, config=config, lora=lora)

        scratch: list[torch.Tensor] = []
        if lora is not None and lora.add_again is not None:  # called many times: repeatable
            lora = lora._replace(add=lora.add_again)
        if lora is not None:  # timed on copies of the weight: the delta after the GEMM
            lora = lora._replace(stacked=None)

        def run_cublas(w: torch.Tensor) -> object:
            if op == "norm_linear":
                return self._cublas_qkv(x, w, eps, bias, lora)
            if gate_up:
                return self._cublas_gate_up(x, w, eps, bias, lora)
            if not scratch:  # adds into a copy: the real residual stays as it is
                assert residual is not None
                scratch.append(residual.clone())
            return self._cublas_residual(x, w, scratch[0], bias, lora)

        def expected() -> torch.Tensor:
            if op == "linear_residual":
                return reference.linear_residual(x, weight, residual, bias, lora)
            return getattr(reference, op)(x, weight, eps, bias, lora)

        name = (op if bias is None else f"{op}+bias") + ("" if lora is None else "+lora")
        timing = None if lora is None else functools.partial(_rows_in_an_adapter, lora, m)
        return self.choice.launch_shape(
            name, x, weight, candidates, run_triton, run_cublas, expected, timing
        )

    def _cublas_qkv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None,
        lora: ProjectionLoRA | None = None,
    ) -> torch.Tensor:
        """The cuBLAS way of the QKV projection, as timed: the raw GEMM where the scale is
        deferred, else the scale pass and the GEMM (the adapter's delta after either)."""
        if _defers(eps, bias):
            return self._linear(x, weight, None, lora)
        return self._linear(self.row_scaled(x, eps), weight, bias, lora)
