"""Every spelling of the engine's settings, folded into one plain :class:`EngineConfig`.

The engine takes an ``EngineConfig`` as it is; how a person or a program spells a setting is
this module's business (vLLM's ``EngineArgs`` plays the same part). A setting enters in one
of these ways, each folded into the same keywords (the config's fields plus ``options``):

- keywords: :func:`engine_config` (``engine_config(chunk_size=512, max_num_seqs=64)``): the
  engine's fields, vLLM's names (:mod:`pitstop.entrypoints.vllm_args`) and the plugins'
  aliases (``chunk_size=512`` becomes ``options["chunk_size"]``, replacing
  ``chunked.chunk_size``): :func:`fold_keywords`;
- a mapping: :func:`config_from_dict`; a TOML file (top-level keys or an ``[engine]`` table,
  ``[plugins.<name>]`` tables, an ``[options]`` table): :func:`config_from_toml`;
- flags (``--page-size``, ``--<plugin>.<setting>``, ``--<alias>``, ``--option KEY=VALUE``,
  vLLM's ``--max-num-seqs``): :func:`add_cli_flags` then :func:`config_from_cli`.

The plugins' aliases come from the installed plugins' :class:`~pitstop.entrypoints.catalogue.Catalogue`;
the plugin settings the config sets or selects are checked here, so that a bad value fails
where it was typed, before any weight loads. An unknown name is an error that names the
nearest known one.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from pitstop.config import EngineConfig
from pitstop.entrypoints.catalogue import Catalogue, default_text
from pitstop.entrypoints.vllm_args import (
    ACCEPTED,
    DTYPE_WORDS,
    KV_CACHE_DTYPE_WORDS,
    MULTI_VALUED,
    REFUSED,
    REMOVED,
    RENAMED,
    SERVE_REFUSED,
    merge,
    translate,
    vllm_names,
)
from pitstop.errors import ConfigError, PluginError, did_you_mean
from pitstop.plugin_system.plugin_manager import PluginManager, get_plugin_manager
from pitstop.plugin_system.registration import Strategy
from pitstop.plugin_system.settings import allowed_values, declared_default, strategy_settings

SETTING_DEST = "setting:"  # argparse dest prefix of the plugin-setting flags
VLLM_DEST = "vllm:"  # argparse dest prefix of vLLM's flags (--max-num-seqs)
TOML_TABLE = "plugins"  # [plugins.<strategy name>] tables of a config file

Aliases = Mapping[str, tuple[tuple[Strategy, attrs.Attribute], ...]]


def aliases(catalogue: Catalogue | None, fields: Collection[str]) -> Aliases:
    """The catalogue's aliases (``chunk_size`` -> each declaring strategy and field);
    a :class:`PluginError` while the plugins are still loading (``catalogue`` None), or
    for an alias that is the name of an engine setting (one of ``fields``)."""
    if catalogue is None:
        raise PluginError(
            "a plugin setting's alias was used while the plugins were still loading; "
            "build the EngineConfig in the plugin's factory, not when its module is imported"
        )
    for alias in set(catalogue.aliases) & set(fields):
        owners = ", ".join(d.owner for d, _ in catalogue.aliases[alias])
        raise PluginError(
            f"{owners}: the setting alias {alias!r} is the name of an engine setting; "
            "the plugin must choose another alias"
        )
    return catalogue.aliases


def fold_keywords(
    settings: Mapping[str, Any], fields: list[str], catalogue: Catalogue | None
) -> dict[str, Any]:
    """``EngineConfig``'s keywords from Python ones: vLLM's names translated, each plugin
    alias moved into ``options`` (replacing the same setting given by its
    ``<plugin>.<setting>`` key); any other name is an error naming the nearest known
    setting and listing those that exist (``fields`` first, then the aliases)."""
    settings = translate(settings)
    short = {k: v for k, v in settings.items() if k not in fields}
    if not short:
        return settings
    table = aliases(catalogue, fields)
    unknown = sorted(set(short) - set(table))
    if unknown:
        known = fields + sorted(table)
        named = ", ".join(f"{n}{did_you_mean(n, known + vllm_names())}" for n in unknown)
        raise ConfigError(
            f"unknown setting(s) {named}; known settings: {', '.join(known)} "
            "(and vLLM's names: docs/api.md)"
        )
    options = dict(settings.get("options") or {})
    for alias, value in short.items():
        for declaration, att in table[alias]:
            options.pop(f"{declaration.name}.{att.name}", None)
        options[alias] = value
    return {k: v for k, v in settings.items() if k in fields} | {"options": options}


def keywords_from_toml(path: str | Path, catalogue: Catalogue | None) -> dict[str, Any]:
    """A TOML file's settings (top-level keys, or an ``[engine]`` table; ``[plugins.<name>]``
    tables and top-level aliases become ``options``), by the names the file uses."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    if "engine" in data and isinstance(data["engine"], dict):
        data = {**{k: v for k, v in data.items() if k != "engine"}, **data["engine"]}
    if TOML_TABLE in data:  # [plugins.<name>] tables: entries of options
        tables = settings_from_toml(data, path)
        data = {k: v for k, v in data.items() if k != TOML_TABLE}
        data["options"] = {**tables, **(data.get("options") or {})}
    given = set(data) & set(catalogue.aliases if catalogue is not None else ())
    if given:  # chunk_size = 512 at the top level
        short = {k: data.pop(k) for k in sorted(given)}
        data["options"] = {**(data.get("options") or {}), **short}
    return data


def keywords_from_cli(args: argparse.Namespace, fields: list[str]) -> dict[str, Any]:
    """The settings given by flags (those :func:`add_settings_flags`, :func:`add_vllm_flags`
    and ``EngineConfig``'s own flags added), by name; ``--config`` is not read here."""
    given = {
        name: getattr(args, name)
        for name in fields
        if getattr(args, name, None) is not None and name != "options"
    }
    for item in getattr(args, "option", None) or []:
        key, value = parse_option(item)
        given.setdefault("options", {})[key] = value
    for dest, value in vars(args).items():  # --<plugin>.<setting> flags
        if dest.startswith(SETTING_DEST) and value is not None:
            given.setdefault("options", {})[dest[len(SETTING_DEST) :]] = value
    for dest, value in vars(args).items():  # --max-num-seqs and vLLM's other flags
        if dest.startswith(VLLM_DEST) and value is not None:
            given[dest[len(VLLM_DEST) :]] = _flag_value(value)
    return given


def _flag_value(value: Any) -> Any:
    """A vLLM flag's value: a flag of several values alone is true, one value is itself."""
    if isinstance(value, list):
        return True if not value else value[0] if len(value) == 1 else value
    return value


def parse_option(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of an ``--option`` flag, the value as :func:`parse_scalar` reads it."""
    key, sep, value = item.partition("=")
    if not sep:
        raise ConfigError(f"--option expects KEY=VALUE, got {item!r}")
    return key, parse_scalar(value)


def parse_scalar(text: str) -> Any:
    """A flag's value as TOML reads it (``3``, ``true``, ``"x"``), else the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_bool_flag(text: str) -> bool:
    """A boolean flag's value; anything else is an argparse error (usage + message, exit 2)."""
    try:
        return _BOOL_WORDS[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"expected true or false (or yes/no, 1/0), got {text!r}"
        ) from None


def _flag_type(att: attrs.Attribute) -> Any:
    t = str(att.type)
    if "bool" in t:
        return parse_bool_flag
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def add_engine_flags(
    parser: argparse.ArgumentParser, fields: Iterable[attrs.Attribute], *, with_model: bool = True
) -> None:
    """``--config FILE``, one ``--flag`` per engine setting (``fields``: EngineConfig's,
    ``options`` and, without ``with_model``, ``model`` left out) and ``--option KEY=VALUE``.
    Every default stays None, so that a ``--config`` file's value is not overridden."""
    group = parser.add_argument_group("engine")
    group.add_argument("--config", metavar="FILE", help="TOML file of engine settings (flags win)")
    for att in fields:
        if att.name == "options" or (att.name == "model" and not with_model):
            continue
        help_text = att.metadata.get("help", "")
        if "default:" not in help_text:
            default = att.default
            shown = "none" if default is None else str(default)
            help_text += f" (default: {shown.lower() if isinstance(default, bool) else shown})"
        kwargs: dict[str, Any] = {"default": None, "help": help_text}
        if "bool" in str(att.type):  # --enforce-eager alone (vLLM's habit) is true
            kwargs.update(metavar="true|false", nargs="?", const=True)
        group.add_argument(
            "--" + att.name.replace("_", "-"), dest=att.name, type=_flag_type(att), **kwargs
        )
    group.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="a third-party plugin setting (repeatable)",
    )


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags: ``--max-num-seqs N``, ``--enable-prefix-caching`` /
    ``--no-enable-prefix-caching`` and the others of :mod:`pitstop.entrypoints.vllm_args`. A flag
    of an argument pitstop refuses parses (hidden from ``--help``) so that the
    config can refuse it by name."""
    group = parser.add_argument_group("vLLM's names for the settings above (docs/api.md)")
    for rule in RENAMED:
        flag = "--" + rule.vllm.replace("_", "-")
        help_text = f"vLLM's name of --{rule.pitstop.replace('_', '-')}" + (
            f" ({rule.note})" if rule.note else ""
        )
        help_text += f" (default: that of --{rule.pitstop.replace('_', '-')})"
        if rule.flag_type is bool:
            group.add_argument(
                flag,
                dest=VLLM_DEST + rule.vllm,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            group.add_argument(
                flag,
                dest=VLLM_DEST + rule.vllm,
                type=rule.flag_type,
                default=None,
                metavar="N",
                help=help_text,
            )
    for name, meaning in ACCEPTED.items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=VLLM_DEST + name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"vLLM's flag, {meaning} (default: false)",
        )
    for name in [*REFUSED, *SERVE_REFUSED, *REMOVED]:
        if "--" + name.replace("_", "-") in parser._option_string_actions:
            continue  # a command's own flag (pitstop serve --served-model-name)
        several = {"nargs": "*"} if name in MULTI_VALUED else {"nargs": "?", "const": True}
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=VLLM_DEST + name,
            type=parse_scalar,
            default=None,
            help=argparse.SUPPRESS,
            **several,
        )


def add_settings_flags(parser: argparse.ArgumentParser, catalogue: Catalogue) -> None:
    """One ``--<plugin>.<setting>`` flag per declared setting of ``catalogue``'s strategies
    (engine-wide ones have theirs), and one ``--<alias>`` flag per alias (``--chunk-size``)."""
    group = parser.add_argument_group("plugin settings (pitstop plugins --settings)")

    def add(flag: str, key: str, att: attrs.Attribute, help_text: str) -> None:
        kind = att.metadata["type"]
        group.add_argument(
            flag,
            dest=SETTING_DEST + key,
            type=parse_bool_flag if kind is bool else kind,
            default=None,
            metavar="true|false" if kind is bool else kind.__name__.upper(),
            help=f"{help_text} ({allowed_values(att)}; default {default_text(att)})",
        )

    for alias, declared in sorted(catalogue.aliases.items()):
        first, att = declared[0]
        readers = ", ".join(f"{d.kind} {d.name!r}" for d, _ in declared)
        also = flag_name(first.name, att.name)
        help_text = f"{att.metadata['help']}; read by {readers}; also {also}"
        add("--" + alias.replace("_", "-"), alias, att, help_text)
    for declaration, att in catalogue.flag_fields():
        add(
            flag_name(declaration.name, att.name),
            f"{declaration.name}.{att.name}",
            att,
            f"{declaration.kind} {declaration.name!r}: {att.metadata['help']}",
        )


def _catalogue(plugins: PluginManager | Catalogue | None) -> Catalogue:
    if isinstance(plugins, Catalogue):
        return plugins
    return Catalogue.of((plugins if plugins is not None else get_plugin_manager()).strategies())


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
            return getattr(strategy_settings(declaration, config), att.name)
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


def settings_from_toml(data: Mapping[str, Any], path: Any) -> dict[str, Any]:
    """The ``options`` entries of a file's ``[plugins.<name>]`` tables."""
    tables = data.get(TOML_TABLE, {})
    if not isinstance(tables, Mapping):
        raise ConfigError(
            f"config file {path}: '{TOML_TABLE}' must be a table of plugin tables, "
            f"e.g. [{TOML_TABLE}.prefix] with max_cached_pages = 8"
        )
    options: dict[str, Any] = {}
    for name, table in tables.items():
        if not isinstance(table, Mapping):
            raise ConfigError(
                f"config file {path}: [{TOML_TABLE}.{name}] must be a table of that plugin's "
                f"settings, got {table!r}"
            )
        for key, value in table.items():
            options[f"{name}.{key}"] = value
    return options


def flag_name(namespace: str, field: str) -> str:
    """The CLI flag of one setting: ``--<namespace>.<field with dashes>``."""
    return f"--{namespace}.{field.replace('_', '-')}"
