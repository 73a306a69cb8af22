"""Every spelling of the engine's settings, folded into one plain :class:`EngineConfig`.

The engine takes an ``EngineConfig`` as it is; how a person or a program spells a setting is
this module's business (vLLM's ``EngineArgs`` plays the same part):

- keywords: :func:`engine_config` (``engine_config(chunk_size=512, max_num_seqs=64)``): the
  engine's fields, the plugins' aliases (into ``options``) and vLLM's names;
- a mapping: :func:`config_from_dict`; a TOML file: :func:`config_from_toml`;
- flags: :func:`add_cli_flags` then :func:`config_from_cli`.

Each folds through :mod:`pitstop.entrypoints.options` against the installed plugins'
declared settings, then checks the plugin settings the config sets or selects, so that a
bad value fails here, where it was typed, before any weight loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from pitstop.config import EngineConfig
from pitstop.entrypoints.options import (
    add_engine_flags,
    add_settings_flags,
    add_vllm_flags,
    aliases,
    fold_keywords,
    keywords_from_cli,
    keywords_from_toml,
)
from pitstop.entrypoints.vllm_args import DTYPE_WORDS, KV_CACHE_DTYPE_WORDS, merge
from pitstop.errors import ConfigError
from pitstop.plugin_system.catalogue import Catalogue
from pitstop.plugin_system.plugin_manager import PluginManager, get_plugin_manager
from pitstop.plugin_system.settings import declared_default


def _catalogue(plugins: PluginManager | Catalogue | None) -> Catalogue:
    if isinstance(plugins, Catalogue):
        return plugins
    return (plugins if plugins is not None else get_plugin_manager()).catalogue


def engine_config(**keywords: Any) -> EngineConfig:
    """An :class:`EngineConfig` from keywords spelled any accepted way (the installed plugins'
    aliases and vLLM's names included); an unknown name is a :class:`ConfigError` naming the
    nearest known setting."""
    return config_from_dict(keywords)


def config_from_dict(
    values: Mapping[str, Any], *, plugins: PluginManager | Catalogue | None = None
) -> EngineConfig:
    """An :class:`EngineConfig` from a mapping of settings spelled any accepted way, its
    plugin settings checked against ``plugins`` (default: the installed ones)."""
    catalogue = _catalogue(plugins)
    folded = fold_keywords(values, EngineConfig.field_names(), catalogue)
    for name, words in (("dtype", DTYPE_WORDS), ("kv_cache_dtype", KV_CACHE_DTYPE_WORDS)):
        if isinstance(folded.get(name), str):  # vLLM's words: half, bfloat16, fp8, ...
            folded[name] = words.get(folded[name], folded[name])
    try:
        config = EngineConfig(**folded)
    except TypeError as exc:  # a wrong type that no validator caught
        raise ConfigError(str(exc)) from exc
    aliases(catalogue, EngineConfig.field_names())
    catalogue.check(config)
    return config


def config_from_toml(
    path: str | Path, *, plugins: PluginManager | Catalogue | None = None, **overrides: Any
) -> EngineConfig:
    """Load a TOML file (top-level keys, or an ``[engine]`` table; ``[plugins.<name>]`` tables);
    ``overrides`` win, whichever of vLLM's or pitstop's names either side uses."""
    data = keywords_from_toml(path, _catalogue(plugins))
    if "options" in overrides and "options" in data:
        overrides = {**overrides, "options": {**data["options"], **overrides["options"]}}
    return config_from_dict(merge(data, overrides), plugins=plugins)


def config_from_cli(
    args: argparse.Namespace, *, plugins: PluginManager | Catalogue | None = None
) -> EngineConfig:
    """Build from the flags :func:`add_cli_flags` added (flags beat ``--config FILE``)."""
    given = keywords_from_cli(args, EngineConfig.field_names())
    if getattr(args, "config", None):
        return config_from_toml(args.config, plugins=plugins, **given)
    return config_from_dict(given, plugins=plugins)


def add_cli_flags(
    parser: argparse.ArgumentParser,
    *,
    with_model: bool = True,
    plugins: PluginManager | Catalogue | None = None,
) -> None:
    """Add one ``--flag`` per :class:`EngineConfig` setting, plus ``--config FILE``, plus one
    ``--<plugin>.<setting>`` flag per declared setting of ``plugins`` (default: the installed
    ones), plus their aliases (``--chunk-size``) and vLLM's flags (``--max-num-seqs``)."""
    add_engine_flags(parser, attrs.fields(EngineConfig), with_model=with_model)
    add_settings_flags(parser, _catalogue(plugins))
    add_vllm_flags(parser)


def setting_names(plugins: PluginManager | Catalogue | None = None) -> list[str]:
    """The engine's settings, then the plugins' aliases (``chunk_size``)."""
    fields = EngineConfig.field_names()
    return fields + sorted(aliases(_catalogue(plugins), fields))


def setting_value(
    config: EngineConfig, alias: str, *, plugins: PluginManager | Catalogue | None = None
) -> Any:
    """A plugin setting of ``config`` read by its alias (``"chunk_size"``): the value given,
    else as the selected strategy that declares it reads it, else the declared default."""
    table = aliases(_catalogue(plugins), EngineConfig.field_names())
    if alias not in table:
        raise ConfigError(f"no plugin declares a setting with the alias {alias!r}")
    if alias in config.options:
        return config.options[alias]
    for declaration, att in table[alias]:
        if declaration.is_selected(config):
            return getattr(declaration.read(config), att.name)
    first, att = table[alias][0]
    return default_for(first.settings, att, config)


def default_for(cls: type, att: attrs.Attribute, config: Any) -> Any:
    """The default of ``att`` (a field of the settings class ``cls``) for ``config``: the
    declared one, capped by its ``at_most`` field's engine setting."""
    default = declared_default(att)
    cap = att.metadata.get("at_most")
    if cap is None:
        return default
    engine = attrs.fields_dict(cls)[cap].metadata["engine"]
    return min(default, getattr(config, engine))
