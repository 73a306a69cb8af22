"""Declared plugin settings: one typed, validated path from Python, TOML and CLI flags.

A plugin registers a settings class with its strategy,
``register("prefix", create_prefix, settings=PrefixSettings)``: a frozen
attrs class whose fields are made with :func:`setting`. The strategy's name
is the settings' namespace, so ``prefix.max_cached_pages`` is

- ``EngineConfig(options={"prefix.max_cached_pages": 8})`` in Python,
- ``[plugins.prefix]`` / ``max_cached_pages = 8`` in a TOML file,
- ``--prefix.max-cached-pages 8`` on the command line.

:func:`read_settings` turns an :class:`~pitstop.config.EngineConfig` into the
validated settings object, and :func:`resolve` does so once for a whole config when an
engine is built, before any weight loads: every registered strategy's settings checked,
each selected strategy's kept for its factory, the step budget derived. No plugin reads
its own settings.

A setting may also have a short name of its own, ``alias``: the chunked
scheduler's ``chunk_size`` is ``chunked.chunk_size`` and also plain
``chunk_size`` (``EngineConfig(chunk_size=512)``, ``chunk_size = 512`` at the
top of a TOML file, ``--chunk-size 512``), the name the article and older
pitstop versions use. Plugins that read the same quantity share one alias
(every built-in scheduler declares ``max_prefill_batch``); their declarations
must agree. A field made with :func:`engine_setting` is instead one of the
engine's own :class:`~pitstop.config.EngineConfig` fields (``max_batch_size``),
read through the plugin's settings class.

A ``required`` setting must be given when its plugin is the one selected
(the ``draft`` proposer's ``speculative_model``); a settings class may check
its fields against each other in ``__attrs_post_init__`` by raising
:class:`~pitstop.errors.ConfigError`.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from pitstop.errors import ConfigError


class SettingsSource(Protocol):
    """What settings are read from: an :class:`~pitstop.config.EngineConfig` (its
    ``options``, and its fields for :func:`engine_setting` ones)."""

    @property
    def options(self) -> Mapping[str, Any]:
        """The plugins' settings by ``<plugin>.<setting>`` key or alias."""
        ...


log = logging.getLogger(__name__)


class _InvalidSetting(ValueError):
    """Raised by a field validator; :func:`read_settings` turns it into a ConfigError."""


def setting(
    default: Any,
    *,
    help: str,
    type: type,
    minimum: float | None = None,
    choices: Sequence[Any] = (),
    optional: bool = False,
    alias: str | None = None,
    required: bool = False,
    legacy: Sequence[str] = (),
    at_most: str | None = None,
) -> Any:
    """One declared setting of a plugin's settings class.

    ``type`` is ``int``, ``float``, ``bool`` or ``str``; ``minimum`` bounds a
    number from below, ``choices`` lists the allowed values, ``optional``
    allows ``None`` (unset). ``alias`` is a short, top-level name for it
    (``chunk_size``: a keyword of :class:`EngineConfig`, a top-level TOML key
    and a ``--chunk-size`` flag); ``required`` (with a ``None`` default) makes
    it compulsory when the plugin is selected; ``legacy`` lists older
    ``options`` keys still accepted for it. ``at_most`` names an
    :func:`engine_setting` field declared before it whose value caps the
    default: left unset, the setting is ``min(default, that field)`` (the
    schedulers' ``max_prefill_batch``, 64, follows a smaller
    ``max_batch_size``); a value given is the class's own to check.
    """
    if type not in (int, float, bool, str):
        raise TypeError(f"setting type must be int, float, bool or str, got {type!r}")
    if required and default is not None:
        raise TypeError("a required setting has no default: give default=None")
    if alias is not None and (not alias.isidentifier() or "." in alias):
        raise TypeError(
            f"a setting alias is a Python identifier such as 'chunk_size', got {alias!r}"
        )
    metadata = {
        "help": help,
        "type": type,
        "minimum": minimum,
        "choices": tuple(choices),
        "optional": optional or required,
        "required": required,
        "engine": None,
        "alias": alias,
        "legacy": tuple(legacy),
        "default": default,
        "at_most": at_most,
    }
    if at_most is not None:
        cap = at_most
        value: Any = attrs.Factory(lambda self: min(default, getattr(self, cap)), takes_self=True)
    else:
        value = default
    return attrs.field(default=value, validator=_check_value, metadata=metadata)


def engine_setting(name: str, *, help: str) -> Any:
    """A plugin setting that is the engine-wide :class:`EngineConfig` field ``name``.

    Its type, default and validation are that field's (documented with the
    other engine settings); the plugin reads it through its settings class.
    """
    metadata = {
        "help": help,
        "type": None,
        "engine": name,
        "alias": None,
        "required": False,
        "legacy": (),
    }
    return attrs.field(default=None, metadata=metadata)


def declared_default(att: attrs.Attribute) -> Any:
    """The default a :func:`setting` declares (before an ``at_most`` cap)."""
    return att.metadata.get("default", att.default)


def allowed_values(att: attrs.Attribute) -> str:
    """What a setting accepts, in words ("an integer >= 0, or unset")."""
    md = att.metadata
    if md["engine"] is not None:
        return f"engine setting (--{md['engine'].replace('_', '-')})"
    if md["choices"]:
        text = "one of " + ", ".join(map(repr, md["choices"]))
    elif md["type"] is bool:
        text = "true or false"
    else:
        text = {int: "an integer", float: "a finite number", str: "a non-empty string"}[md["type"]]
        if md["minimum"] is not None:
            text += f" >= {md['minimum']:g}"
    return text + (", or unset" if md["optional"] else "")


def _check_value(_inst: Any, att: attrs.Attribute, value: Any) -> None:
    md = att.metadata
    if value is None and md["optional"]:
        return
    kind = md["type"]
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, str) and bool(value)
    if ok and md["minimum"] is not None:
        ok = value >= md["minimum"]
    if ok and md["choices"]:
        ok = value in md["choices"]
    if not ok:
        raise _InvalidSetting(att.name, value)


def is_settings_class(cls: Any) -> bool:
    """Whether ``cls`` is an attrs class whose every field was made with :func:`setting`
    or :func:`engine_setting`."""
    return (
        isinstance(cls, type)
        and attrs.has(cls)
        and all("engine" in att.metadata for att in attrs.fields(cls))
    )


def option_fields(cls: type) -> list[attrs.Attribute]:
    """The fields set through ``options`` / TOML / CLI (not engine-wide ones)."""
    return [att for att in attrs.fields(cls) if att.metadata["engine"] is None]


def aliased_fields(cls: type) -> list[attrs.Attribute]:
    """The fields that have a short top-level name (``alias``)."""
    return [att for att in option_fields(cls) if att.metadata.get("alias")]


def same_declaration(a: attrs.Attribute, b: attrs.Attribute) -> bool:
    """Whether two fields sharing one alias accept the same values with the same default."""
    keys = ("type", "minimum", "choices", "optional", "required", "at_most")
    return declared_default(a) == declared_default(b) and all(
        a.metadata[k] == b.metadata[k] for k in keys
    )


def check_value(att: attrs.Attribute, value: Any, *, key: str, owner: str) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one ``att`` accepts (``key``: how the
    user gave it, e.g. ``chunk_size``)."""
    try:
        _check_value(None, att, value)
    except _InvalidSetting:
        raise ConfigError(
            f"{key} must be {allowed_values(att)}, got {value!r} (a setting of {owner})"
        ) from None


def read_settings(
    config: SettingsSource, namespace: str, cls: type, *, owner: str = "", selected: bool = False
) -> Any:
    """The validated settings of the plugin ``namespace`` from ``config``.

    ``options["<namespace>.<field>"]`` wins over the field's alias
    (``options["chunk_size"]``, which ``EngineConfig(chunk_size=...)`` sets),
    which wins over a ``legacy`` key, which wins over the default; an
    engine-wide field reads its :class:`EngineConfig` value. A wrong type, an
    out-of-range value, an unknown ``<namespace>.`` key, a ``required`` setting
    left unset while the plugin is ``selected``, or a check of the class's own
    ``__attrs_post_init__`` is a :class:`ConfigError` naming the plugin, the
    setting and what it accepts.
    """
    owner = owner or f"plugin {namespace!r}"
    by_name = {att.name: att for att in attrs.fields(cls)}
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}  # field -> the alias or legacy key it was read from
    prefix = namespace + "."
    for key, value in config.options.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        att = by_name.get(name)
        if att is None or att.metadata["engine"] is not None:
            raise ConfigError(_unknown(owner, key, att, cls, namespace))
        values[name] = value
    for att in attrs.fields(cls):
        md = att.metadata
        if md["engine"] is not None:
            values[att.name] = getattr(config, md["engine"])
            continue
        if att.name not in values:
            for key in ((md["alias"],) if md["alias"] else ()) + md["legacy"]:
                if key in config.options:
                    values[att.name] = config.options[key]
                    given_as[att.name] = key
                    break
        if selected and md["required"] and values.get(att.name) is None:
            names = f"{namespace}.{att.name}" + (f" ({md['alias']})" if md["alias"] else "")
            raise ConfigError(f"{owner} needs the setting {names}: {md['help']}")
    try:
        return cls(**values)
    except _InvalidSetting as exc:
        name, value = exc.args
        att = by_name[name]
        key = f"{namespace}.{name}"
        via = f" (given as {given_as[name]})" if name in given_as else ""
        raise ConfigError(
            f"{owner}: setting {key}{via} must be {allowed_values(att)}, got {value!r}"
        ) from None
    except ConfigError as exc:  # a check between fields, from the class's __attrs_post_init__
        raise ConfigError(f"{owner}: {exc}") from None


def _unknown(owner: str, key: str, att: Any, cls: type, namespace: str) -> str:
    if att is not None and att.metadata["engine"] is not None:  # an engine setting, namespaced
        flag = "--" + att.metadata["engine"].replace("_", "-")
        return (
            f"unknown option {key!r}: {owner} reads the engine setting "
            f"{att.metadata['engine']}; set that instead ({flag}, or "
            f"{att.metadata['engine']} = ... in TOML)"
        )
    known = (
        ", ".join(f"{namespace}.{a.name} ({allowed_values(a)})" for a in option_fields(cls))
        or "none"
    )
    return f"unknown option {key!r}: {owner} has the settings {known}"


def check_option_keys(
    options: Mapping[str, Any], declared: Mapping[str, str], engine: Collection[str] = ()
) -> None:
    """Raise :class:`ConfigError` for an ``options`` key that no plugin declares.

    ``declared`` maps each key a loaded plugin reads to the plugin that reads
    it. A key whose namespace (the part before the first dot) no plugin
    declares anything in is left alone, unless it is a near-miss of a
    declared key: third-party plugins that do not declare their keys yet keep
    working, while ``prefix.max_cache_pages`` is caught. A key no plugin
    declares that is the name of an engine setting (``engine``) is refused
    too: the engine reads its settings from their own fields, never from
    ``options``, so it would be ignored.
    """
    namespaces = {key.split(".", 1)[0] for key in declared}
    for key in options:
        if key in declared:
            continue
        if key in engine:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                f"option {key!r} is an engine setting, which options do not set: give it as "
                f"{key}=... (the flag {flag}, or the key {key} of a matrix table)"
            )
        close = difflib.get_close_matches(key, list(declared), n=1, cutoff=0.8)
        if key.split(".", 1)[0] not in namespaces and not close:
            continue
        hint = f"did you mean {close[0]!r}? " if close else ""
        known = ", ".join(f"{k} ({declared[k]})" for k in sorted(declared))
        raise ConfigError(f"unknown option {key!r}: {hint}options the loaded plugins read: {known}")


class Declared(Protocol):
    """A registered strategy as :func:`resolve` reads it
    (:class:`~pitstop.plugin_system.registration.Strategy`)."""

    kind: str
    name: str
    settings: type | None

    @property
    def owner(self) -> str:
        """How errors name it."""
        ...

    def is_selected(self, config: Any) -> bool:
        """Whether ``config`` picks it by name."""
        ...


class Registry(Protocol):
    """What :func:`resolve` reads of the plugin manager."""

    def get(self, kind: str, name: str) -> Any:
        """The strategy of ``kind`` called ``name`` (an unknown one is a PluginError)."""
        ...

    def strategies(self) -> list[Any]:
        """Every registered strategy."""
        ...

    def declared_options(self) -> dict[str, str]:
        """Every ``options`` key a registered strategy reads -> who reads it."""
        ...

    def selected_by(self) -> dict[str, str]:
        """Each kind -> the setting that selects its strategy by name (the kinds table's)."""
        ...


def strategy_settings(strategy: Declared, config: Any) -> Any:
    """A strategy's validated settings from ``config`` (None when it declares none); a
    ``required`` setting must be set only when ``config`` selects it."""
    if strategy.settings is None:
        return None
    selected = strategy.is_selected(config)
    return read_settings(
        config, strategy.name, strategy.settings, owner=strategy.owner, selected=selected
    )


def step_token_budget(scheduler_settings: Any, max_num_batched_tokens: int) -> int:
    """The most tokens one step computes: the scheduler's own budget when its settings
    have a ``step_token_budget()`` method (:class:`~pitstop.plugin_system.protocols.StepBudgetSettings`,
    the ``chunked`` scheduler's ``chunk_size``), else ``max_num_batched_tokens``."""
    budget = getattr(scheduler_settings, "step_token_budget", None)
    return budget() if callable(budget) else max_num_batched_tokens


@attrs.frozen
class ResolvedConfig:
    """A config turned, once, into what the engine builds from: each selected strategy's
    typed settings (by kind; None for one that declares none, or none selected) and the
    figures derived from them."""

    config: Any  # the EngineConfig it was resolved from
    settings: Mapping[str, Any]
    step_token_budget: int  # the most tokens one step computes (:func:`step_token_budget`)

    def of(self, kind: str) -> Any:
        """The typed settings of the selected ``kind`` strategy (None: it declares none)."""
        return self.settings.get(kind)


def resolve(
    config: Any, registry: Registry, *, kinds: Collection[str] | None = None
) -> ResolvedConfig:
    """Turn ``config`` into each selected strategy's typed settings and the step token
    budget, once, before any weight loads (the plugin manager's ``create`` hands each
    factory its settings).

    Raises :class:`~pitstop.errors.PluginError` on the first strategy name of ``config``
    that is not registered (``kernels="auto"`` is skipped: it resolves to a name later), and
    :class:`ConfigError` on a declared setting of any registered strategy that is of the
    wrong type, out of range or unknown (:func:`read_settings`), or on an ``options`` key
    that the plugins declare nothing like (:func:`check_option_keys`).

    ``kinds``: only the strategies of these kinds are looked up (a runner built alone needs
    its kernels, sampler and weight format); the step budget still follows the selected
    scheduler when one of that name is registered. The executor is looked up only at
    ``tensor_parallel_size > 1`` (at 1 the engine runs the model in its own process).
    """
    fields = attrs.fields_dict(type(config))
    selected: dict[str, Any] = {}
    for kind, field in registry.selected_by().items():
        if field not in fields or (kinds is not None and kind not in kinds):
            continue  # a model or a source is picked by the checkpoint, not by a setting
        name = getattr(config, field)
        if kind == "kernels" and name == "auto":  # named later, for the device
            continue
        if kind == "executor" and config.tensor_parallel_size == 1:
            continue  # one process: the engine runs the model itself
        if kind == "verifier" and config.speculative is None:
            continue  # built only with a proposer
        if name is not None:
            selected[kind] = registry.get(kind, name)
    every = registry.strategies()
    read = {(s.kind, s.name): strategy_settings(s, config) for s in every}
    check_option_keys(config.options, registry.declared_options(), fields)
    _warn_unread_aliases(config, every)
    settings = {kind: read[kind, s.name] for kind, s in selected.items()}
    scheduler = read.get(("scheduler", config.scheduler))  # its budget (chunked's chunk_size)
    budget = step_token_budget(scheduler, config.max_num_batched_tokens)
    return ResolvedConfig(config=config, settings=settings, step_token_budget=budget)


def setting_aliases(
    strategies: Iterable[Declared],
) -> dict[str, tuple[tuple[Any, attrs.Attribute], ...]]:
    """Each setting alias (``chunk_size``) -> the strategies that declare it, with the field."""
    found: dict[str, list[tuple[Any, attrs.Attribute]]] = {}
    for s in strategies:
        for att in aliased_fields(s.settings) if s.settings is not None else ():
            found.setdefault(att.metadata["alias"], []).append((s, att))
    return {alias: tuple(fields) for alias, fields in found.items()}


def _warn_unread_aliases(config: Any, strategies: Sequence[Declared]) -> None:
    """Log each alias ``config`` sets that none of its selected strategies reads
    (``chunk_size`` with ``scheduler="continuous"``)."""
    for alias, fields in setting_aliases(strategies).items():
        declared = [s for s, _ in fields]
        if alias in config.options and not any(s.is_selected(config) for s in declared):
            log.warning(
                "%s = %r has no effect: only %s read(s) it, and none is selected",
                alias,
                config.options[alias],
                ", ".join(s.owner for s in declared),
            )
