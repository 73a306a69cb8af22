"""Will the model fit? Weights and KV cache against the memory the device has, before allocating.

A model that cannot fit must be refused with the figures and the fix at
start-up, not killed by the kernel's out-of-memory handler minutes into
loading (dummy ``qwen3-8b`` in float32 is 33 GB: more than a 24 GB machine).
"""

from __future__ import annotations

import torch

from pitstop.errors import ConfigError
from pitstop.ground.model_config import ModelConfig

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


def rotary_table_bytes(model_config: ModelConfig, max_model_len: int) -> int:
    """Peak bytes of building the rotary cos/sin tables for ``max_model_len`` positions.

    The tables are float32 ``[max_model_len, head_size/2]`` each, built through an
    int64 and a float32 position vector and a frequency table of the same shape:
    about ``max_model_len * (12 + 6 * head_size)`` bytes at their peak.
    """
    return max_model_len * (12 + 6 * model_config.head_size)


def check_max_model_len_fits(
    max_model_len: int,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    kv_pages: int,
    page_size: int,
    kv_page_bytes: int,
) -> None:
    """Refuse a ``max_model_len`` whose tables or one sequence cannot fit, before allocating.

    ``kv_pages`` is the KV cache the configuration fixes up front (0 where it is
    sized after the weights, as on CUDA): it must hold one whole sequence of
    ``max_model_len`` tokens. The rotary tables (:func:`rotary_table_bytes`), the
    weights and the KV cache (at least one sequence of ``max_model_len`` tokens)
    must fit in the free memory. Each failure is a :class:`ConfigError` that names
    the numbers and the largest ``max_model_len`` that fits.
    """
    pages_per_seq = -(-max_model_len // page_size)
    if kv_pages and kv_pages < pages_per_seq:
        raise ConfigError(
            f"the KV cache holds {kv_pages * page_size:,} tokens, less than one sequence of "
            f"max_model_len={max_model_len:,}; give it more memory (kv_cache_gib, max_num_pages, "
            f"gpu_memory_utilization) or use max_model_len <= {kv_pages * page_size}"
        )
    available = available_bytes(device)
    if available is None:
        return
    element = torch.tensor([], dtype=dtype).element_size()
    weights = model_config.num_params * element
    rotary = rotary_table_bytes(model_config, max_model_len)
    kv = kv_pages * kv_page_bytes if kv_pages else pages_per_seq * kv_page_bytes
    budget = int(HEADROOM * available)
    if weights + rotary + kv <= budget:
        return
    per_token = rotary_table_bytes(model_config, 1) + (0 if kv_pages else kv_page_bytes / page_size)
    fixed = weights + (kv_pages * kv_page_bytes if kv_pages else 0)
    largest = max(0, int((budget - fixed) // per_token))
    gib = 2**30
    where = "GPU" if device.type == "cuda" else "host"
    what = "the KV cache" if kv_pages else "the KV cache of one sequence"
    raise ConfigError(
        f"max_model_len={max_model_len:,} needs {rotary / gib:.1f} GiB of rotary tables and "
        f"{kv / gib:.1f} GiB for {what}, plus {weights / gib:.1f} GiB of weights, but the "
        f"{where} has {available / gib:.1f} GiB free (at most {HEADROOM:.0%} of it is planned "
        f"for); use max_model_len <= {largest:,}"
    )
