"""EngineConfig: keyword arguments, TOML and CLI flags, and clear errors before any weight loads."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs
import pytest

from pitstop import EngineConfig
from pitstop.entrypoints.engine_args import (
    add_cli_flags,
    config_from_cli,
    config_from_toml,
    engine_config,
    setting_value,
)
from pitstop.errors import ConfigError
from pitstop.plugin_system.plugin_manager import get_plugin_manager

ROOT = Path(__file__).resolve().parents[3]


def budget(config: EngineConfig) -> int:
    """The step token budget ``config`` resolves to (its scheduler's, or max_num_batched_tokens)."""
    return get_plugin_manager().resolve(config).step_token_budget


def _cli(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    return config_from_cli(parser.parse_args(list(argv)))


def test_defaults_are_valid_and_frozen() -> None:
    config = EngineConfig()
    assert config.allocator == "paged" and config.scheduler == "chunked"
    # issue 22: the default bounds every step by a token budget, as vLLM's does
    assert (
        setting_value(config, "chunk_size") is None
        and budget(config) == config.max_num_batched_tokens
    )
    assert budget(engine_config(chunk_size=256)) == 256
    assert budget(engine_config(scheduler="continuous", chunk_size=256)) == 8192
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.page_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"page_size": 0}, "page_size"),
        ({"page_size": 1.5}, "page_size"),
        ({"max_batch_size": -1}, "max_batch_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"prefill_priority": "medium"}, "prefill_priority"),
        ({"admission": "random"}, "admission"),
        ({"fused_rmsnorm": "yes"}, "fused_rmsnorm"),
        ({"allocator": ""}, "allocator"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"max_prefill_batch": 8, "max_batch_size": 4}, "max_prefill_batch"),
    ],
)
def test_invalid_values_name_the_setting(settings: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        engine_config(**settings)


def test_toml_file_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(
        'allocator = "prefix"\npage_size = 32\n[options]\n"scheduler.max_wait_steps" = 8\n'
    )
    config = config_from_toml(path, page_size=64)
    assert config.allocator == "prefix" and config.page_size == 64
    assert config.options == {"scheduler.max_wait_steps": 8}


def test_toml_engine_table(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('[engine]\nscheduler = "chunked"\nchunk_size = 256\n')
    assert setting_value(config_from_toml(path), "chunk_size") == 256


def test_toml_unknown_key_lists_the_known_ones(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text("pagesize = 16\n")
    with pytest.raises(ConfigError) as err:
        config_from_toml(path)
    assert "pagesize" in str(err.value) and "page_size" in str(err.value)


def test_toml_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        config_from_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("page_size = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config_from_toml(bad)


def test_cli_flags_and_config_file(tmp_path: Path) -> None:
    config = _cli(
        "--page-size",
        "8",
        "--fused-attention",
        "false",
        "--option",
        "x.y=3",
        "--scheduler",
        "chunked",
    )
    assert (
        config.page_size == 8
        and setting_value(config, "fused_attention") is False
        and config.scheduler == "chunked"
    )
    assert config.options == {"x.y": 3, "fused_attention": False}  # an alias is a plugin setting
    path = tmp_path / "engine.toml"
    path.write_text('allocator = "prefix"\npage_size = 32\n')
    config = _cli("--config", str(path), "--page-size", "4")
    assert config.allocator == "prefix" and config.page_size == 4


def test_cli_invalid_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="page_size"):
        _cli("--page-size", "0")


def test_every_setting_is_in_the_configuration_reference() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [name for name in EngineConfig.field_names() if f"`{name}`" not in text]
    assert not missing, f"settings missing from docs/configuration.md: {missing}"
