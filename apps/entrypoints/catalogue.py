"""The catalogue: the registered strategies that declare settings, with their aliases.

Each registered :class:`~pitstop.plugin_system.registration.Strategy` with a settings class
(:mod:`pitstop.plugin_system.settings`) is one *declaration*; the :class:`Catalogue` holds
them with the table of their aliases (``chunk_size`` -> the ``chunked`` scheduler's field).
The entry points (:mod:`pitstop.entrypoints.engine_args`) build it from the plugin
manager's registry (:meth:`Catalogue.of`) and fold, check and offer as flags a config's
spellings against it; the engine never reads it. Reading a config's settings is
:func:`pitstop.plugin_system.settings.resolve`. :func:`describe` and :func:`default_text`
put a settings class in words, for ``pitstop plugins --settings`` and the flags' help.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from pitstop.plugin_system.settings import (
    SettingsSource,
    allowed_values,
    check_value,
    declared_default,
    option_fields,
    setting_aliases,
    strategy_settings,
)

if TYPE_CHECKING:
    from pitstop.plugin_system.registration import Strategy


@attrs.frozen(eq=False)
class Catalogue:
    """Every strategy of a registry that declares settings, with its aliases table."""

    declarations: tuple[Strategy, ...]
    aliases: Mapping[str, tuple[tuple[Strategy, attrs.Attribute], ...]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "aliases", setting_aliases(self.declarations))

    @classmethod
    def of(cls, strategies: Iterable[Strategy]) -> Catalogue:
        """The catalogue of ``strategies`` (a registry's ``strategies()``): those with settings."""
        return cls(tuple(s for s in strategies if s.settings is not None))

    def check(self, config: SettingsSource) -> None:
        """Validate the plugin settings ``config`` sets by alias, and the settings of the
        strategies it selects (raises :class:`~pitstop.errors.ConfigError`)."""
        to_read = {d.owner: d for d in self.declarations if d.is_selected(config)}
        for alias, declared in self.aliases.items():
            if alias in config.options:
                first, att = declared[0]
                check_value(att, config.options[alias], key=alias, owner=first.owner)
                to_read |= {d.owner: d for d, _ in declared}
        for declaration in to_read.values():
            strategy_settings(declaration, config)

    def flag_fields(self) -> list[tuple[Strategy, attrs.Attribute]]:
        """Every declared option field, by declaration, for ``--<plugin>.<setting>`` flags."""
        return [(d, att) for d in self.declarations for att in option_fields(d.settings)]


def default_text(att: attrs.Attribute) -> str:
    """A setting's default in words: ``64``, or ``64, or max_batch_size when smaller``."""
    text = repr(declared_default(att))
    cap = att.metadata.get("at_most")
    return f"{text}, or {cap} when smaller" if cap else text


def describe(
    cls: type, namespace: str, engine_defaults: Any = None
) -> list[tuple[str, str, str, str, str]]:
    """One row per setting: (key, alias, allowed values, default, help).

    ``alias`` is ``""`` for a setting without one; an engine-wide setting's
    key is its :class:`EngineConfig` name, its default read from
    ``engine_defaults`` (an ``EngineConfig()``) when given.
    """
    rows = []
    for att in attrs.fields(cls):
        md = att.metadata
        if md["engine"]:
            key = md["engine"]
            default = repr(getattr(engine_defaults, md["engine"], "(engine setting)"))
        else:
            key = f"{namespace}.{att.name}"
            default = "(required)" if md["required"] else default_text(att)
        rows.append((key, md["alias"] or "", allowed_values(att), default, md["help"]))
    return rows
