"""``int8``: weight-only int8 with one scale per output channel, in plain torch.

Written from pitstop's docs alone (docs/plugins.md, "A weight format"): each
linear weight row ``W[n]`` is stored as ``round(W[n] / scale[n])`` in int8 with
``scale[n] = amax(|W[n]|) / 127``, a quarter of float32's bytes and half of
bf16's. ``linear`` widens the weight back to the activation dtype and runs the
kernel set's ``linear``: the activations are never quantized, so the only error
is the weight's rounding (at most half a step, ``scale / 2``, per element).
Dequantizing on every call makes it slower than dense; the point is the memory
and the protocol, not speed.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from pitstop.plugin_system.protocols import KernelSet
from pitstop.plugin_system.settings import setting

INT8_MAX = 127.0


@attrs.frozen
class Int8Settings:
    """The settings of the ``int8`` weight format."""

    min_features: int = setting(
        0,
        type=int,
        minimum=0,
        help="keep dense every weight with fewer input features than this (0: quantize all)",
    )


@attrs.frozen(eq=False)
class Int8Weight:
    """One resident weight: int8 rows ``[N, K]`` and their float32 scales ``[N, 1]``."""

    qweight: torch.Tensor
    scale: torch.Tensor


class Int8Weights:
    """Per-channel int8 weights, widened to the activation dtype in each linear."""

    name = "int8"

    def __init__(self, kernels: KernelSet, settings: Int8Settings) -> None:
        self.kernels = kernels
        self.settings = settings

    def prepare(self, name: str, weight: torch.Tensor) -> Any:
        """Each row rounded to int8 at its own scale; the output head and narrow weights
        stay dense (returned as they are)."""
        if name == "lm_head" or weight.shape[1] < self.settings.min_features:
            return weight
        wide = weight.float()
        scale = wide.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / INT8_MAX
        qweight = (wide / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return Int8Weight(qweight, scale)

    def linear(self, x: torch.Tensor, resident: Any, bias: torch.Tensor | None = None) -> Any:
        """``x @ W.T + bias`` with ``W`` widened from int8 (no host sync: graph-safe)."""
        if isinstance(resident, torch.Tensor):  # kept dense
            return self.kernels.linear(x, resident, bias)
        weight = (resident.qweight.to(torch.float32) * resident.scale).to(x.dtype)
        return self.kernels.linear(x, weight, bias)

    def resident_bytes(self, resident: Any) -> int:
        """One byte a weight, four a row for the scale; a dense weight's own bytes."""
        if isinstance(resident, torch.Tensor):
            return resident.numel() * resident.element_size()
        return resident.qweight.numel() + 4 * resident.scale.numel()

    def describe(self) -> dict[str, str]:
        """What runs each linear."""
        return {"linear": "int8 per-channel weights widened to the activation dtype (torch)"}


def make_int8(
    config: Any, kernels: KernelSet, device: torch.device, dtype: torch.dtype, *, settings
) -> Int8Weights:
    """Weight-only int8, one scale per output channel, in plain torch."""
    del config, device, dtype
    return Int8Weights(kernels, settings)
