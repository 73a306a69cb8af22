"""The checked-weights mode: refuse a checkpoint holding NaN or infinite weights at load.

A checkpoint full of NaN loads and generates garbage (every logit NaN, so
every token id 0 or an error far from the cause). :func:`finite_weights`
wraps the stream of ``(name, tensor)`` pairs that the loader already walks
once to copy each tensor into its parameter, and checks each floating-point
tensor there, just before its copy: one ``torch.aminmax`` (a read of the
tensor, no temporary of its size; NaN propagates into it and an infinity
is its min or max). The first bad tensor is a :class:`ModelLoadError`
naming it and how many of its values are NaN and infinite. Turned off with
``check_weights=false`` (``EngineConfig``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from pitstop.errors import ModelLoadError


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise :class:`ModelLoadError` when floating-point ``tensor`` holds a NaN or an infinity.

    A weight kept in its quantized blocks (not a tensor) passes: the weight format that
    keeps it checks its scales (``weights=gguf`` does)."""
    if (
        not isinstance(tensor, torch.Tensor)
        or not tensor.is_floating_point()
        or tensor.numel() == 0
    ):
        return
    low, high = torch.aminmax(tensor.detach())
    if math.isfinite(float(low)) and math.isfinite(float(high)):
        return
    nan = int(torch.isnan(tensor).sum())
    inf = int(torch.isinf(tensor).sum())
    raise ModelLoadError(
        f"checkpoint tensor {name!r} holds {nan} NaN and {inf} infinite value(s) of "
        f"{tensor.numel()}: the checkpoint is broken (a failed conversion or training run); "
        "the model would generate garbage. Fix or re-download it (check_weights=false loads it "
        "anyway)"
    )


def finite_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` unchanged, each floating-point tensor checked as it passes (see module)."""
    for name, tensor in weights:
        check_finite(name, tensor)
        yield name, tensor
