"""Where a runner computes and how much KV cache it gets: device, dtype, and pages.

The KV pages are fixed by the config before any weight loads
(:func:`pages_asked`), or, on CUDA without a fixed size, planned from the
memory the weights and ``gpu_memory_utilization`` leave after one profile
step at the largest step (:func:`plan_num_pages`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pitstop.config import EngineConfig
from pitstop.errors import ConfigError
from pitstop.ground.model_config import ModelConfig
from pitstop.loading.kv_cache_dtype import resolve_kv_cache_dtype

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when present, else CPU; a CUDA name without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {name!r} asked for, but this machine has no CUDA device; use device='cpu'"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> float32 on CPU, bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def kv_bytes_per_page(model_config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one page of ``page_size`` tokens over all layers, in cache dtype ``dtype``."""
    return model_config.kv_bytes_per_token * page_size * dtype.itemsize


def pages_asked(
    config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> int | None:
    """The KV pages the config fixes before any weight loads; None: sized from free GPU memory.

    ``max_num_pages`` when set; else a ``kv_cache_gib`` budget (1 GiB on the CPU
    when none is given) over the bytes of a page in ``kv_cache_dtype``; on CUDA
    without either, the cache takes what the weights and
    ``gpu_memory_utilization`` leave (:func:`plan_num_pages`).
    ``dtype`` is the model's.
    """
    if config.max_num_pages is not None:
        return config.max_num_pages
    if device.type != "cuda" or config.kv_cache_gib is not None:
        cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
        per_page = kv_bytes_per_page(model_config, config.page_size, cache_dtype)
        return max(1, int((config.kv_cache_gib or 1.0) * 2**30) // per_page)
    return None


def plan_num_pages(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    per_page: int,
    profile: Callable[[], int],
) -> int:
    """How many pages of ``per_page`` bytes a runner's KV cache gets: ``max_num_pages``, a GiB
    budget, or free GPU memory (after ``profile()``: the bytes the largest step takes beyond
    the weights, :func:`profile_peak_memory`)."""
    cfg = config
    asked = pages_asked(cfg, model_config, device, dtype)
    if asked is not None and (device.type != "cuda" or cfg.max_num_pages is None):
        return asked
    peak = profile()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * cfg.gpu_memory_utilization) - (total - free) - peak
    fit = max(0, budget // per_page)
    if cfg.max_num_pages is not None:
        if cfg.max_num_pages > fit:
            raise ConfigError(
                f"max_num_pages={cfg.max_num_pages} needs {cfg.max_num_pages * per_page / 2**30:.2f} GiB, "
                f"but at gpu_memory_utilization={cfg.gpu_memory_utilization} only {fit} pages fit; "
                f"use max_num_pages <= {fit} or raise gpu_memory_utilization"
            )
        return cfg.max_num_pages
    if fit < 1:
        raise ConfigError(
            f"no room for a KV cache at gpu_memory_utilization={cfg.gpu_memory_utilization}; raise it"
        )
    return fit


def profile_peak_memory(
    config: EngineConfig,
    device: torch.device,
    page_size: int,
    step_token_budget: int,
    run_step: Callable[[int, int, int], int],
) -> int:
    """Extra memory a forward at the largest step takes beyond the weights and the KV cache
    (bytes): what the cache's budget must leave free.

    ``run_step(num_seqs, num_tokens, pages_per_seq)`` allocates a KV cache of
    ``num_seqs * pages_per_seq`` pages, runs one made-up step of that shape, and returns
    the bytes of that cache, which the caller drops afterwards. They are not part of the
    answer: the real cache takes their place (counted in, they cut the real cache by a
    ``max_model_len`` of tokens: 0.375 GiB of qwen3-30b-a3b's, 3% of its cache on an H100).
    """
    cfg = config
    assert cfg.max_model_len is not None
    tokens = min(cfg.max_num_batched_tokens, max(cfg.max_model_len, step_token_budget))
    n_seqs = max(1, min(cfg.max_batch_size, -(-tokens // cfg.max_model_len)))
    # no made-up sequence longer than max_model_len: its positions would run past the
    # rotary table (a device-side assert with the reference kernels' index_select)
    per_seq = min(cfg.max_model_len, tokens // n_seqs)
    pages = (per_seq + page_size - 1) // page_size
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    cache_bytes = run_step(n_seqs, per_seq, pages)
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - base - cache_bytes)
