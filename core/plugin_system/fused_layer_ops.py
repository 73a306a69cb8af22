"""The fused decoder layer's ops of a kernel set: :class:`FusedLayerOps`.

Its own module only to keep :mod:`pitstop.plugin_system.protocols` short; that module
imports it, so ``pitstop.plugin_system.protocols.FusedLayerOps`` is the name to use. A kernel
set declaring ``fuses_layer`` (:class:`~pitstop.plugin_system.protocols.KernelSetBase`)
provides these ops; the Llama-family models then run each decoder layer through them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class FusedLayerOps(Protocol):
    """The ops of a fused decoder layer, which a kernel set declaring ``fuses_layer`` provides.

    A layer runs as ``norm_linear`` (norm + QKV), ``rope_and_store``, ``attention``,
    ``linear_residual`` (O + residual add), ``norm_gate_up`` (norm + gate-up + SiLU·mul)
    and ``linear_residual`` (down + residual add). The model multiplies each RMSNorm's gain
    into the projection after it at load, so ``norm_linear`` scales each row by ``1 /
    rms(x)`` alone. ``lora``: an adapter plugin's delta of the projection, or None;
    ``next_lora``: the next projection's, whose shrink a set may sum here (or ignore)."""

    def norm_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None = None,
        lora: Any = None,
    ) -> torch.Tensor:
        """``rstd(x)[:, None] * (x @ weight.T) (+ bias)``; ``eps=None`` skips the norm."""
        ...

    def norm_gate_up(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float | None,
        bias: torch.Tensor | None = None,
        lora: Any = None,
        next_lora: Any = None,
    ) -> torch.Tensor:
        """``silu(g) * u`` where ``[g | u]`` is :meth:`norm_linear` over the merged gate-up weight."""
        ...

    def linear_residual(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        bias: torch.Tensor | None = None,
        lora: Any = None,
        next_lora: Any = None,
    ) -> torch.Tensor:
        """``residual + x @ weight.T (+ bias)``: a new tensor, or ``residual`` itself updated in
        place (the model never reads the old stream again), as the set chooses."""
        ...
