"""The catalogue: what the registered strategies declare, as a value the config reads.

Each strategy that declares a settings class (:mod:`pitstop.plugin_system.settings`) is one
:class:`Declaration`; the :class:`Catalogue` holds them all with the table of
their aliases (``chunk_size`` -> the ``chunked`` scheduler's field). The
plugin manager builds the catalogue of its registry; an
:class:`~pitstop.config.EngineConfig` parses its keywords against the
*installed* catalogue, which the package wires to the process-wide plugin
manager (:func:`use_installed`), so that neither the config nor this module
knows the plugin manager.

A declaration reads its settings from a config once per distinct input: the
same options and engine fields give the same settings object, without
validating them again (:meth:`Declaration.read`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from pitstop.plugin_system.settings import (
    SettingsSource,
    aliased_fields,
    check_value,
    option_fields,
    read_settings,
)


@attrs.frozen(eq=False)
class Declaration:
    """One strategy's declared settings: its kind, its name (the settings' namespace),
    how errors name it, its settings class and the config field that selects it."""

    kind: str
    name: str
    owner: str
    settings: type
    selected_by: str

    def is_selected(self, config: Any) -> bool:
        """Whether ``config`` picks this strategy by name (``kernels="auto"`` picks none yet)."""
        field = self.selected_by
        return field in attrs.fields_dict(type(config)) and getattr(config, field) == self.name

    def read(self, config: SettingsSource) -> Any:
        """The validated settings from ``config`` (:func:`pitstop.plugin_system.settings.read_settings`)."""
        return read_settings(
            config, self.name, self.settings, owner=self.owner, selected=self.is_selected(config)
        )


@attrs.frozen(eq=False)
class Catalogue:
    """Every declaration of a registry, with its aliases table."""

    declarations: tuple[Declaration, ...]
    aliases: Mapping[str, tuple[tuple[Declaration, attrs.Attribute], ...]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        found: dict[str, list[tuple[Declaration, attrs.Attribute]]] = {}
        for d in self.declarations:
            for att in aliased_fields(d.settings):
                found.setdefault(att.metadata["alias"], []).append((d, att))
        object.__setattr__(self, "aliases", {k: tuple(v) for k, v in found.items()})

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
            declaration.read(config)

    def selected(self, kind: str, config: SettingsSource) -> Declaration | None:
        """The declaration of the ``kind`` strategy ``config`` selects, if it declares settings."""
        return next(
            (d for d in self.declarations if d.kind == kind and d.is_selected(config)), None
        )

    def flag_fields(self) -> list[tuple[Declaration, attrs.Attribute]]:
        """Every declared option field, by declaration, for ``--<plugin>.<setting>`` flags."""
        return [(d, att) for d in self.declarations for att in option_fields(d.settings)]


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
