"""A model that cannot fit is refused at start-up, with the figures and the fix (issue 22, point 10)."""

from __future__ import annotations

import time

import pytest

from pitstop import LLM
from pitstop.errors import ConfigError


def test_a_model_larger_than_the_host_is_refused_before_allocating() -> None:
    """dummy qwen3-32b in float32 is 131 GB: refused in moments, not killed by the OOM killer."""
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"needs 1\d\d\.\d GiB of weights .*float32.*bfloat16"):
        LLM("dummy:qwen3-32b", device="cpu", dtype="float32")
    assert time.perf_counter() - start < 30


def test_the_figures_and_the_kv_cache_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights plus the KV cache asked for, against 90% of what is free."""
    import pitstop.loop.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 20 * 2**30)
    with pytest.raises(
        ConfigError, match=r"plus 30\.0 GiB of KV cache, but the host has 20\.0 GiB"
    ):
        LLM("dummy:qwen3-0.6b", device="cpu", dtype="bfloat16", kv_cache_gib=30)
    with pytest.raises(ConfigError, match="needs 30.5 GiB of weights"):
        LLM("dummy:qwen3-8b", device="cpu", dtype="float32", kv_cache_gib=0.5)


def test_unknown_free_memory_skips_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import pitstop.loop.memory as memory
    from pitstop.plugins.models.llama_presets import PRESETS

    monkeypatch.setattr(memory, "available_bytes", lambda device: None)
    memory.check_fits(PRESETS["qwen3-32b"], torch.float32, torch.device("cpu"), 0)
