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

Which one runs, and in which Triton launch shape, is
:class:`.triton_ops.layer_choice.LayerChoice`'s answer for the op and shape: timed once per
shape on a GPU (``fused.layer_tune``, up to ``fused.layer_tune_rows`` rows), else Triton
up to ``fused.layer_rows`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pitstop.plugins.kernels import reference

# Triton is imported only when the kernel set is built (pitstop.plugins.kernels.fused)
if TYPE_CHECKING:
    from pitstop.plugins.kernels.triton_ops.fused_linear import LinearConfig
    from pitstop.plugins.kernels.triton_ops.layer_choice import LayerChoice

RowScale = tuple[torch.Tensor, float]


def _defers(eps: float | None, bias: torch.Tensor | None) -> bool:
    """Whether the cuBLAS way leaves the row scale to the op after the GEMM: there is a norm
    and no bias (a bias comes after the scale, so with one the scale runs first)."""
    return eps is not None and bias is None


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

    # ------------------------------------------------------------------ QKV
    def norm_linear(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``rstd(x) * x @ weight.T (+ bias)`` as one tensor (the scale applied here)."""
        config = self._config("norm_linear", x, weight, eps, bias)
        if config is not None:
            return self.gemm.norm_linear(x, weight, eps, bias, config=config)
        return F.linear(self.row_scaled(x, eps), weight, bias)

    def norm_linear_deferred(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float | None, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, RowScale | None]:
        """The QKV projection: the Triton GEMM with the norm inside, or cuBLAS on the raw rows
        and ``(x, eps)`` for ``rope_and_store`` to scale with (no bias), or the scale first."""
        config = self._config("norm_linear", x, weight, eps, bias)
        if config is not None:
            return self.gemm.norm_linear(x, weight, eps, bias, config=config), None
        deferred = (x, eps) if _defers(eps, bias) else None
        return self._cublas_qkv(x, weight, eps, bias), deferred

    # ------------------------------------------------------------------ MLP
    def norm_gate_up(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``silu(gate) * up`` of the normed merged gate-up projection."""
        config = self._config("norm_gate_up", x, weight, eps, bias)
        if config is not None:
            return self.gemm.norm_gate_up(x, weight, eps, bias, config=config)
        return self._cublas_gate_up(x, weight, eps, bias)

    def _cublas_gate_up(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.silu is not None and _defers(eps, bias):
            return self.silu.silu_and_mul(F.linear(x, weight), (x, eps))
        return self.plain_silu(F.linear(self.row_scaled(x, eps), weight, bias))

    # ------------------------------------------------------------------ residual writers
    def linear_residual(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``: the Triton GEMM's fresh tensor, or cuBLAS adding
        into ``residual`` in place (one launch; the model never reads the old stream again)."""
        config = self._config("linear_residual", x, weight, None, bias, residual)
        if config is not None:
            return self.gemm.linear_residual(x, weight, residual, bias, config=config)
        if bias is not None:
            return residual + F.linear(x, weight, bias)
        return residual.addmm_(x, weight.t())

    # ------------------------------------------------------------------ the choice
    def _config(
        self,
        op: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> LinearConfig | None:
        """The Triton launch shape ``op`` runs for this call, or None for cuBLAS
        (:class:`LayerChoice`); what it would time is this very call, the cuBLAS way of the
        residual writers adding into a copy of the residual."""
        if x.shape[0] > self.choice.max_rows:
            return None
        gate_up = op == "norm_gate_up"
        m, k = x.shape
        n_out = weight.shape[0] // 2 if gate_up else weight.shape[0]
        sms = self.gemm.num_sms(x.device)
        if x.device.type == "cuda":
            candidates = self.gemm.tile_candidates(m, n_out, k, x.dtype, gate_up, sms)
        else:  # the interpreter's tiles
            candidates = [self.gemm.choose_config(m, n_out, k, x.dtype, gate_up, False, sms)]

        def run_triton(config: LinearConfig) -> torch.Tensor:
            if op == "linear_residual":
                return self.gemm.linear_residual(x, weight, residual, bias, config=config)
            return getattr(self.gemm, op)(x, weight, eps, bias, config=config)

        scratch: list[torch.Tensor] = []

        def run_cublas() -> object:
            if op == "norm_linear":
                return self._cublas_qkv(x, weight, eps, bias)
            if gate_up:
                return self._cublas_gate_up(x, weight, eps, bias)
            if not scratch:  # adds into a copy: the real residual stays as it is
                assert residual is not None
                scratch.append(residual.clone())
            if bias is not None:
                return scratch[0] + F.linear(x, weight, bias)
            return scratch[0].addmm_(x, weight.t())

        def expected() -> torch.Tensor:
            if op == "linear_residual":
                return reference.linear_residual(x, weight, residual, bias)
            return getattr(reference, op)(x, weight, eps, bias)

        name = op if bias is None else f"{op}+bias"
        return self.choice.launch_shape(
            name, x, weight, candidates, run_triton, run_cublas, expected
        )

    def _cublas_qkv(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The cuBLAS way of the QKV projection, as timed: the raw GEMM where the scale is
        deferred, else the scale pass and the GEMM."""
        if _defers(eps, bias):
            return F.linear(x, weight)
        return F.linear(self.row_scaled(x, eps), weight, bias)
