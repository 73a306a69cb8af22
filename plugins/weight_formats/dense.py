"""`dense` weights: the checkpoint's tensors in the model's dtype, through the kernel set.

The default format, and exactly the path the Llama family took before weight
formats were a plugin kind: :meth:`DenseWeights.prepare` keeps the tensor it is
given, and ``linear`` *is* the kernel set's ``linear`` (the bound method, so a
call costs nothing more than before).
"""

from __future__ import annotations

from typing import Any

import torch

from pitstop.config import EngineConfig
from pitstop.plugin_system.hookspecs import hookimpl
from pitstop.plugin_system.protocols import KernelSet


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Device bytes of one tensor."""
    return tensor.numel() * tensor.element_size()


class DenseWeights:
    """Each linear weight kept as given; ``linear`` is the kernel set's."""

    name = "dense"

    def __init__(self, kernels: KernelSet) -> None:
        self.kernels = kernels
        self.linear = kernels.linear  # the kernel set's own op, bound once

    def prepare(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The weight itself."""
        del name
        return weight

    def resident_bytes(self, resident: torch.Tensor) -> int:
        """The tensor's bytes."""
        return tensor_bytes(resident)

    def describe(self) -> dict[str, str]:
        """The GEMM is the kernel set's."""
        kernel_name = getattr(self.kernels, "name", type(self.kernels).__name__)
        return {"linear": f"dense weights, the {kernel_name} kernel set's linear"}


def make_dense(
    config: EngineConfig, kernels: KernelSet, device: torch.device, dtype: torch.dtype
) -> DenseWeights:
    """The checkpoint's weights in the model's dtype, multiplied by the kernel set's linear."""
    del config, device, dtype
    return DenseWeights(kernels)


@hookimpl
def register_weight_formats(register: Any) -> None:
    """Register ``dense``, the default weight format."""
    register("dense", make_dense)
