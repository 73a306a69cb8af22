"""max_model_len is checked against the model's context and the memory before anything is allocated."""

from __future__ import annotations

import logging
import time

import attrs
import pytest
import torch

import pitstop.loop.memory as memory
from pitstop import LLM, EngineConfig
from pitstop.config import ALLOW_LONG_MAX_MODEL_LEN_ENV, resolve_max_model_len
from pitstop.errors import ConfigError
from pitstop.plugins.models.llama_presets import PRESETS


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)


@pytest.mark.parametrize("length", [2**40, 2**31])
def test_a_length_past_int32_is_refused_when_the_config_is_built(length: int) -> None:
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"max_model_len=.* int32.*e\.g\. 8192"):
        LLM("smollm2-135m", max_model_len=length)
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize("length", [20000, 3 * 10**7])
def test_a_length_past_the_models_context_is_refused_with_the_override_named(length: int) -> None:
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"context of 8,192 tokens.*max_model_len <= 8192") as err:
        LLM("smollm2-135m", max_model_len=length)
    assert ALLOW_LONG_MAX_MODEL_LEN_ENV in str(err.value)
    assert "allow_long_max_model_len" in str(err.value)
    assert time.perf_counter() - start < 20


def test_the_override_loads_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="pitstop.config"):
        llm = LLM("smollm2-135m", max_model_len=20000, device="cpu")
    assert llm.config.max_model_len == 20000
    assert "exceeds the model's context of 8192" in caplog.text


def test_the_config_override_and_the_default() -> None:
    model = attrs.evolve(PRESETS["llama3-8b"], max_position_embeddings=8192)
    small = attrs.evolve(model, max_position_embeddings=2048)
    allowed = EngineConfig(max_model_len=9000, allow_long_max_model_len=True)
    assert resolve_max_model_len(allowed, model) == 9000
    assert resolve_max_model_len(EngineConfig(), model) == 4096
    assert resolve_max_model_len(EngineConfig(), small) == 2048
    assert resolve_max_model_len(EngineConfig(max_model_len=8192), model) == 8192
    with pytest.raises(ConfigError, match="8,193"):
        resolve_max_model_len(EngineConfig(max_model_len=8193), model)
    windowed = attrs.evolve(model, sliding_window=4096)  # the model's own limit: no override
    with pytest.raises(ConfigError, match="sliding_window=4096"):
        resolve_max_model_len(attrs.evolve(allowed, max_model_len=8000), windowed)


def test_overridden_past_the_kv_cache_fails_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3e7 once built a 9 GB rotary table for 200 s; now refused in moments, nothing allocated."""
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
    built: list[int] = []
    from pitstop.plugins.models import llama

    real = llama.rotary_cache
    monkeypatch.setattr(
        llama, "rotary_cache", lambda cfg, n, dev: built.append(n) or real(cfg, n, dev)
    )
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"KV cache holds [\d,]+ tokens.*max_model_len <= \d+"):
        LLM("smollm2-135m", max_model_len=3 * 10**7, device="cpu")
    assert time.perf_counter() - start < 20
    assert built == []


def test_rotary_tables_that_do_not_fit_are_refused_with_the_largest_that_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda device: 16 * 2**30)
    cfg = PRESETS["qwen3-0.6b"]
    cpu = torch.device("cpu")
    kw = {"kv_pages": 2**26, "page_size": 16, "kv_page_bytes": 16}
    with pytest.raises(
        ConfigError, match=r"GiB of rotary tables.*use max_model_len <= ([\d,]+)"
    ) as err:
        memory.check_max_model_len_fits(2**30, cfg, torch.bfloat16, cpu, **kw)
    largest = int(str(err.value).rsplit("<= ", 1)[1].replace(",", ""))
    memory.check_max_model_len_fits(largest, cfg, torch.bfloat16, cpu, **kw)  # fits
    with pytest.raises(ConfigError):
        memory.check_max_model_len_fits(largest + 1000, cfg, torch.bfloat16, cpu, **kw)


def test_one_sequence_of_kv_counts_where_the_cache_is_sized_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA the cache is sized after the weights: one whole sequence must still fit."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 80 * 2**30)
    cfg = PRESETS["llama3-8b"]  # 128 KiB of bf16 KV per token
    page = 16 * 2 * cfg.kv_bytes_per_token
    with pytest.raises(ConfigError, match="KV cache of one sequence"):
        memory.check_max_model_len_fits(
            2**20,
            cfg,
            torch.bfloat16,
            torch.device("cpu"),
            kv_pages=0,
            page_size=16,
            kv_page_bytes=page,
        )
    memory.check_max_model_len_fits(
        8192, cfg, torch.bfloat16, torch.device("cpu"), kv_pages=0, page_size=16, kv_page_bytes=page
    )
