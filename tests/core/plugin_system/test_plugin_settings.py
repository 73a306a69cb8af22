"""Declared plugin settings: one path for every built-in and the example plugin.

Python (``options``), TOML (``[plugins.<name>]``) and CLI flags
(``--<name>.<setting>``) all end in :func:`pitstop.plugin_system.settings.read_settings`;
a wrong type, an out-of-range value and an unknown key are refused before
any weight loads, naming the plugin, the setting and what it accepts.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import attrs
import pytest

import pitstop
from pitstop import EngineConfig
from pitstop.entrypoints.catalogue import describe
from pitstop.entrypoints.engine_args import (
    add_cli_flags,
    config_from_cli,
    config_from_toml,
    engine_config,
    setting_value,
)
from pitstop.errors import ConfigError, PluginError
from pitstop.plugin_system.plugin_manager import PluginManager, Strategy
from pitstop.plugin_system.settings import (
    allowed_values,
    declared_default,
    option_fields,
    read_settings,
    setting,
)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "tests" / "example_plugin"


@pytest.fixture(scope="module")
def plugins() -> PluginManager:
    """The built-ins plus the example plugin, loaded from its source folder."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        example = importlib.import_module("pitstop_example")
        return PluginManager(extra_modules=[example])
    finally:
        sys.path.remove(str(EXAMPLE))


def _with_settings(pm: PluginManager) -> list[Strategy]:
    return [s for s in pm.strategies() if s.settings is not None]


def _bad_values(att: attrs.Attribute) -> list[tuple[str, object]]:
    """(what is wrong, value) pairs that ``att`` must refuse."""
    md = att.metadata
    wrong_type = "many" if md["type"] in (int, float, bool) else 5
    bad = [("type", wrong_type)]
    if md["minimum"] is not None:
        bad.append(("range", md["minimum"] - 1))
    if md["choices"]:
        bad.append(("range", "none-of-these"))
    return bad


def test_every_built_in_and_the_example_declare_settings(plugins: PluginManager) -> None:
    names = {s.name for s in _with_settings(plugins)}
    assert {"prefix", "continuous", "chunked", "fcfs", "fused", "ngram", "draft", "lifo"} <= names


def test_wrong_type_and_out_of_range_name_plugin_setting_and_values(
    plugins: PluginManager,
) -> None:
    checked = 0
    for strategy in _with_settings(plugins):
        for att in option_fields(strategy.settings):
            key = f"{strategy.name}.{att.name}"
            # the default passes
            plugins.check_config(EngineConfig(options={key: declared_default(att)}))
            for _what, value in _bad_values(att):
                with pytest.raises(ConfigError) as info:
                    plugins.check_config(EngineConfig(options={key: value}))
                text = str(info.value)
                assert strategy.name in text and key in text, text
                assert allowed_values(att) in text and repr(value) in text, text
                checked += 1
    assert checked >= 6  # prefix, continuous, chunked and lifo: type and range each


def test_unknown_key_names_the_plugin_and_lists_its_settings(plugins: PluginManager) -> None:
    for strategy in _with_settings(plugins):
        with pytest.raises(ConfigError, match="unknown option") as info:
            plugins.check_config(EngineConfig(options={f"{strategy.name}.no_such": 1}))
        text = str(info.value)
        assert f"{strategy.kind} {strategy.name!r}" in text, text
        for att in option_fields(strategy.settings):
            assert f"{strategy.name}.{att.name}" in text and allowed_values(att) in text


def test_an_engine_setting_under_a_namespace_points_at_the_engine_flag(
    plugins: PluginManager,
) -> None:
    with pytest.raises(ConfigError, match="--max-batch-size"):
        plugins.check_config(EngineConfig(options={"chunked.max_batch_size": 64}))
    with pytest.raises(ConfigError, match="--max-num-batched-tokens"):
        plugins.check_config(EngineConfig(options={"fcfs.max_num_batched_tokens": 64}))


def test_an_alias_and_its_key_are_one_setting(plugins: PluginManager) -> None:
    """``chunk_size`` and ``chunked.chunk_size`` reach the same field; the key wins, and an
    alias given as a keyword replaces the key (engine_config(options=..., chunk_size=...))."""
    by_key = EngineConfig(options={"chunked.chunk_size": 64})
    by_alias = engine_config(chunk_size=64)
    for config in (by_key, by_alias):
        assert plugins.create("scheduler", "chunked", config, None).token_budget == 64
        assert plugins.resolve(config).step_token_budget == 64
    both = EngineConfig(options={"chunk_size": 32, "chunked.chunk_size": 64})
    assert plugins.create("scheduler", "chunked", both, None).token_budget == 64
    assert (
        plugins.resolve(engine_config(options=both.options, chunk_size=16)).step_token_budget == 16
    )
    assert setting_value(by_alias, "chunk_size") == 64
    assert setting_value(EngineConfig(), "chunk_size") is None
    assert setting_value(engine_config(fused_qkv=False), "fused_qkv") is False
    fused = plugins.get("kernels", "fused")
    assert fused.read_settings(engine_config(fused_qkv=False)).qkv is False
    assert fused.read_settings(EngineConfig(options={"fused.qkv": False})).qkv is False
    with pytest.raises(ConfigError, match="unknown setting"):
        engine_config(chunk_sise=64)


def test_a_shared_alias_reaches_every_scheduler_that_reads_it(plugins: PluginManager) -> None:
    config = engine_config(max_prefill_batch=3, admission="shortest-first")
    for name in ("continuous", "chunked", "fcfs"):
        scheduler = plugins.create("scheduler", name, config, None)
        assert scheduler.max_prefill_batch == 3, name
    assert plugins.create("scheduler", "chunked", config, None).admission == "shortest-first"


def test_an_alias_no_selected_plugin_reads_is_logged(
    plugins: PluginManager, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="pitstop.plugin_system.plugin_manager"):
        plugins.check_config(engine_config(scheduler="continuous", chunk_size=64))
    assert "chunk_size = 64 has no effect" in caplog.text and "chunked" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pitstop.plugin_system.plugin_manager"):
        plugins.check_config(engine_config(scheduler="chunked", chunk_size=64))
    assert "no effect" not in caplog.text


def test_a_required_setting_is_refused_only_when_its_plugin_is_selected(
    plugins: PluginManager,
) -> None:
    plugins.check_config(EngineConfig())  # draft.model unset, draft not selected
    with pytest.raises(ConfigError, match=r"draft.*speculative_model"):
        engine_config(speculative="draft")
    config = engine_config(speculative="draft", speculative_model="smollm2-135m")
    assert plugins.get("proposer", "draft").read_settings(config).model == "smollm2-135m"


def test_plugins_that_share_an_alias_must_declare_it_alike() -> None:
    @attrs.frozen
    class Other:
        chunk: int = setting(7, type=int, minimum=1, alias="chunk_size", help="a clash")

    mod = type(sys)("fake_plugin_alias_clash")

    def hook(register) -> None:
        register("clash", lambda config, allocator: None, settings=Other)

    mod.register_schedulers = pitstop.hookimpl(hook)
    with pytest.raises(PluginError, match="alias 'chunk_size'"):
        PluginManager(extra_modules=[mod])


def test_refused_before_any_weight_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_weights(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("weights were loaded before the settings were checked")

    monkeypatch.setattr("pitstop.loop.engine.load_model_source", no_weights)
    for options, fragment in [
        ({"prefix.max_cached_pages": -1}, "an integer >= 0"),
        ({"continuous.max_wait_steps": "soon"}, "continuous.max_wait_steps"),
        ({"chunked.nope": 1}, "chunked.max_wait_steps"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            pitstop.LLM("smollm2-135m", options=options)


def test_cli_flags_per_setting(plugins: PluginManager) -> None:
    parser = argparse.ArgumentParser()
    add_cli_flags(parser, plugins=plugins)
    args = parser.parse_args(
        ["--prefix.max-cached-pages", "3", "--lifo.max-pages", "5", "--chunk-size", "64"]
    )
    config = config_from_cli(args)
    assert config.options == {"prefix.max_cached_pages": 3, "lifo.max_pages": 5, "chunk_size": 64}
    assert setting_value(config, "chunk_size") == 64
    with pytest.raises(SystemExit):
        parser.parse_args(["--continuous.max-wait-steps", "soon"])


def test_toml_table_per_plugin(tmp_path: Path, plugins: PluginManager) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(
        'allocator = "lifo"\n[plugins.lifo]\nmax_pages = 7\n'
        "[plugins.prefix]\nmax_cached_pages = 2\n"
    )
    config = config_from_toml(path)
    assert config.options == {"lifo.max_pages": 7, "prefix.max_cached_pages": 2}
    plugins.check_config(config)
    path.write_text("[plugins.prefix]\nmax_cached_page = 2\n")
    with pytest.raises(ConfigError, match="prefix.max_cached_pages"):
        plugins.check_config(config_from_toml(path))
    path.write_text('[plugins]\nprefix = "x"\n')
    with pytest.raises(ConfigError, match=r"\[plugins.prefix\]"):
        config_from_toml(path)


def test_an_older_key_is_named_in_its_error(plugins: PluginManager) -> None:
    with pytest.raises(ConfigError, match=r"given as scheduler\.max_wait_steps"):
        plugins.check_config(EngineConfig(options={"scheduler.max_wait_steps": -2}))


def test_values_reach_the_strategies(plugins: PluginManager) -> None:
    config = EngineConfig(options={"lifo.max_pages": 3, "prefix.max_cached_pages": 0})
    assert plugins.create("allocator", "lifo", config, 10).num_pages == 3
    assert plugins.create("allocator", "prefix", config, 10).max_cached_pages == 0
    legacy = engine_config(admission="shortest-first", options={"scheduler.max_wait_steps": 3})
    continuous = plugins.create("scheduler", "continuous", legacy, None)
    assert continuous.max_wait_steps == 3 and continuous.admission == "shortest-first"
    both = EngineConfig(options={"scheduler.max_wait_steps": 3, "chunked.max_wait_steps": 9})
    assert plugins.create("scheduler", "chunked", both, None).max_wait_steps == 9
    assert plugins.create("scheduler", "continuous", both, None).max_wait_steps == 3


def test_every_setting_is_in_the_configuration_reference(plugins: PluginManager) -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [
        name
        for s in _with_settings(plugins)
        if s.distribution == "pitstop"
        for key, alias, *_ in describe(s.settings, s.name)
        for name in (key, alias)
        if name and f"`{name}`" not in text
    ]
    assert not missing, f"plugin settings missing from docs/configuration.md: {missing}"


def test_pitstop_plugins_lists_the_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from pitstop.entrypoints.cli import main

    assert main(["plugins", "--settings"]) == 0
    out = capsys.readouterr().out
    assert "prefix.max_cached_pages" in out and "an integer >= 0, or unset" in out
    assert "chunked.chunk_size (chunk_size)" in out and "an integer >= 1, or unset" in out
    assert "max_batch_size" in out and "engine setting (--max-batch-size)" in out


def test_registering_settings_that_are_not_declared_is_refused() -> None:
    class Loose:
        pass

    @attrs.frozen
    class Knob:
        level: int = setting(1, type=int, minimum=0, help="a knob")

    def module(kind_hook: str, name: str, settings: type):
        mod = type(sys)(f"fake_plugin_{kind_hook}_{name}")

        def hook(register) -> None:
            register(name, lambda config, num_pages: None, settings=settings)

        setattr(mod, kind_hook, pitstop.hookimpl(hook))
        return mod

    with pytest.raises(PluginError, match="pitstop.plugin_system.settings.setting"):
        PluginManager(
            load_entry_points=False, extra_modules=[module("register_allocators", "a", Loose)]
        )
    pm = PluginManager(
        load_entry_points=False, extra_modules=[module("register_allocators", "knob", Knob)]
    )
    assert read_settings(EngineConfig(options={"knob.level": 4}), "knob", Knob).level == 4
    with pytest.raises(PluginError, match="namespace 'knob'"):
        pm.add_module(module("register_schedulers", "knob", Knob), distribution="x", version="1")


def test_an_engine_setting_given_as_an_option_is_refused_naming_its_own_key() -> None:
    """The engine reads its settings from their fields, never from ``options``: a key there
    that names one (and no plugin declares) would be ignored, so it is refused, naming the
    field and its flag."""
    from pitstop.config import EngineConfig
    from pitstop.plugin_system.settings import check_option_keys

    fields = set(attrs.fields_dict(EngineConfig))
    with pytest.raises(
        ConfigError, match=r"'piecewise_max_tokens' is an engine setting.*--piecewise-max-tokens"
    ):
        check_option_keys({"piecewise_max_tokens": 8192}, {"lora.kernel": "lora"}, fields)
    check_option_keys(
        {"lora.kernel": "stacked", "thirdparty.knob": 1}, {"lora.kernel": "lora"}, fields
    )
