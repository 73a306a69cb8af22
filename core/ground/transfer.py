"""Host values onto the device without holding the host.

A copy from pageable host memory makes the host wait for everything already queued on the
stream (CUDA stages it through a buffer of its own), so the next step could not be prepared
while this one runs. Values go through pinned memory instead: a block of PyTorch's host cache,
held until its copy has run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def host_tensor(values: Any, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """``values`` (a list, a numpy array or a CPU tensor) as a host tensor, pinned where
    ``device`` is a GPU; a list takes ``dtype``, an array or a tensor keeps its own."""
    if isinstance(values, torch.Tensor):
        host = values
    elif isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
    else:
        host = torch.tensor(values, dtype=dtype)
    return host.pin_memory() if device.type == "cuda" else host


def to_device(values: Any, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` (see :func:`host_tensor`), copied without blocking the host."""
    host = host_tensor(values, dtype, device)
    return host.to(device, non_blocking=True) if device.type == "cuda" else host
