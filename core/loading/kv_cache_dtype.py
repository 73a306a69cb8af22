"""The KV cache's element type: ``kv_cache_dtype`` resolved to a torch dtype this device can hold.

``auto`` keeps the model's dtype. ``fp8_e4m3`` / ``fp8_e5m2`` store one byte per
K/V element (half of bf16): values are divided by a per-layer K or V scale
and saturated to the format's finite range when stored, multiplied back when
read (the kernel sets do both; :mod:`pitstop.plugins.kernels.reference` is
the numerical reference).
"""

from __future__ import annotations

import inspect

import torch

from pitstop.errors import ConfigError

FP8_DTYPES: dict[str, str] = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_WIDE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The cache dtype for the ``kv_cache_dtype`` setting ``name``; an fp8 name this torch cannot cast is an error."""
    if name == "auto":
        return model_dtype
    if name in _WIDE:
        return _WIDE[name]
    if name not in FP8_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype must be one of auto, {', '.join(_WIDE)}, {', '.join(FP8_DTYPES)}; got {name!r}"
        )
    dtype = getattr(torch, FP8_DTYPES[name], None)
    reason = None
    if dtype is None:
        reason = f"this torch ({torch.__version__}) has no torch.{FP8_DTYPES[name]}"
    else:
        try:  # the casts the reference kernels need, on the cache's device
            probe = torch.tensor([1.5, -3.0], device=device).to(dtype).to(torch.float32)
            if probe.tolist() != [1.5, -3.0]:
                reason = f"torch casts to {dtype} on {device} give {probe.tolist()}"
        except (RuntimeError, TypeError) as exc:
            reason = f"torch cannot cast to {dtype} on {device} ({exc})"
    if reason is not None:
        raise ConfigError(
            f"kv_cache_dtype={name!r}: {reason}; use kv_cache_dtype='auto' (the model's dtype) "
            "or a torch with float8 support (2.1 or later)"
        )
    return dtype


def check_kernels_read_fp8(kernels: object, kernels_name: str, cache_dtype: torch.dtype) -> None:
    """Refuse a kernel set whose cache ops take no ``kv_scale`` when the cache is fp8.

    Such a kernel set was written for caches in the model's dtype: it would
    store fp8 values unscaled, or fail at the first step with a TypeError.
    """
    if cache_dtype.itemsize != 1:
        return
    for op in ("rope_and_store", "attention"):
        params = inspect.signature(getattr(kernels, op)).parameters
        takes = "kv_scale" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        if not takes:
            raise ConfigError(
                f"kernel set {kernels_name!r}: {op}() takes no kv_scale argument, so it cannot use "
                f"an fp8 KV cache ({cache_dtype}); use kv_cache_dtype='auto', or a kernel set with "
                "fp8 support (reference, fused)"
            )
