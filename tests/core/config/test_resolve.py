"""Settings resolved once: the config knows no plugin manager, resolve() reads each
strategy's typed settings once and create() hands them over."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from pitstop.config import EngineConfig
from pitstop.entrypoints.engine_args import engine_config
from pitstop.errors import ConfigError
from pitstop.plugin_system.plugin_manager import PluginManager
from pitstop.plugins.schedulers.chunked import ChunkedSettings

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    return PluginManager()


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth, TYPE_CHECKING included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module or ""}
    return found


@pytest.mark.parametrize("module", ["config", "catalogue", "settings", "vllm_args"])
def test_the_config_and_its_parsing_know_no_plugin_manager(module: str) -> None:
    imported = _imported(
        next(p for d in ("core", "apps/entrypoints") for p in (ROOT / d).rglob(f"{module}.py"))
    )
    assert not {m for m in imported if "plugin_manager" in m}, imported
    if module != "config":
        assert not {m for m in imported if m.startswith("pitstop.config")}, imported


def test_resolve_gives_the_selected_strategies_settings_and_the_budget(
    plugins: PluginManager,
) -> None:
    config = engine_config(
        chunk_size=64, allocator="prefix", options={"prefix.max_cached_pages": 2}
    )
    resolved = plugins.resolve(config)
    assert isinstance(resolved.of("scheduler"), ChunkedSettings)
    assert resolved.of("scheduler").chunk_size == 64 and resolved.step_token_budget == 64
    assert resolved.of("allocator").max_cached_pages == 2
    assert resolved.of("proposer") is None  # none selected
    assert plugins.resolve(EngineConfig(scheduler="continuous")).step_token_budget == 8192
    with pytest.raises(ConfigError, match="chunked.max_wait_steps"):
        plugins.resolve(EngineConfig(options={"chunked.max_wait_steps": -1}))


def test_create_hands_the_resolved_settings_over(plugins: PluginManager) -> None:
    config = engine_config(chunk_size=32)
    settings = plugins.resolve(config).of("scheduler")
    scheduler: Any = plugins.create("scheduler", "chunked", config, None, settings=settings)
    assert scheduler.settings is settings and scheduler.token_budget == 32
    alone: Any = plugins.create("scheduler", "chunked", config, None)  # built alone: read for it
    assert alone.settings == settings


def test_resolve_reads_each_strategys_settings_once(
    plugins: PluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No memo: resolve reads every registered strategy's settings exactly once, and the
    engine hands the selected ones to their factories instead of reading them again."""
    from pitstop.plugin_system import settings

    reads: list[str] = []
    original = settings.read_settings

    def counted(config: Any, name: str, cls: type, **kw: Any) -> Any:
        reads.append(name)
        return original(config, name, cls, **kw)

    config = engine_config(chunk_size=48)
    monkeypatch.setattr(settings, "read_settings", counted)
    plugins.resolve(config)
    assert sorted(reads) == sorted(set(reads)) and "chunked" in reads


def test_a_declaration_reads_what_it_is_given(plugins: PluginManager) -> None:
    from pitstop.plugin_system.settings import strategy_settings

    chunked = plugins.get("scheduler", "chunked")
    assert chunked.settings is not None
    first = strategy_settings(chunked, engine_config(chunk_size=48))
    assert strategy_settings(chunked, engine_config(chunk_size=48, seed=3)) == first  # seed unread
    assert strategy_settings(chunked, engine_config(chunk_size=24)).chunk_size == 24
    assert strategy_settings(chunked, engine_config(chunk_size=48, max_batch_size=128)) != first
