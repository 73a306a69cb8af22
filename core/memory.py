"""Will the model fit? Weights and KV cache against the memory the device has, before allocating.

A model that cannot fit must be refused with the figures and the fix at
start-up, not killed by the kernel's out-of-memory handler minutes into
loading (dummy ``qwen3-8b`` in float32 is 33 GB: more than a 24 GB machine).
"""

from __future__ import annotations

import torch

from pitstop.errors import ConfigError
from pitstop.model_config import ModelConfig

HEADROOM = 0.9
"""The fraction of available memory a model may plan to take (the rest: activations, the runtime)."""


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` now: the GPU's free memory, or the host's MemAvailable (None if unknown)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_bytes: int,
    *,
    what: str = "the model",
) -> None:
    """Raise :class:`ConfigError` when weights plus ``kv_cache_bytes`` exceed the free memory.

    ``kv_cache_bytes`` is the cache the configuration asks for up front (0
    where the cache is sized from what is left after the weights, as on CUDA).
    """
    available = available_bytes(device)
    if available is None:
        return
    element = torch.tensor([], dtype=dtype).element_size()
    weights = model_config.num_params * element
    need = weights + kv_cache_bytes
    if need <= HEADROOM * available:
        return
    gib = 2**30
    where = "GPU" if device.type == "cuda" else "host"
    kv = f" plus {kv_cache_bytes / gib:.1f} GiB of KV cache" if kv_cache_bytes else ""
    smaller_dtype = "dtype='bfloat16' (half of float32), " if element > 2 else ""
    raise ConfigError(
        f"{what} needs {weights / gib:.1f} GiB of weights ({model_config.num_params / 1e9:.2f}B "
        f"parameters in {str(dtype).removeprefix('torch.')}){kv}, but the {where} has "
        f"{available / gib:.1f} GiB free (at most {HEADROOM:.0%} of it is planned for); use "
        f"{smaller_dtype}a smaller model, a smaller kv_cache_gib / max_num_pages, or a machine "
        f"with more memory"
    )
