"""What one ``register()`` call of a plugin's hook records: a :class:`Strategy`, from a
:class:`PluginSource`, its arguments checked by
:func:`check_registration` before anything enters the registry."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs

from pitstop.errors import PluginError
from pitstop.plugin_system.architecture import Architecture
from pitstop.plugin_system.kinds import KINDS as KIND_TABLE
from pitstop.plugin_system.settings import is_settings_class, strategy_settings

if TYPE_CHECKING:
    from pitstop.config import EngineConfig


@attrs.frozen
class Strategy:
    """One registered strategy: its kind, name, factory and where it came from."""

    kind: str
    name: str
    factory: Callable[..., Any]
    distribution: str
    version: str
    module: str
    description: str = ""
    options: Mapping[str, str] = attrs.field(factory=dict)  # the ``options`` keys it reads -> doc
    settings: type | None = None  # its declared settings class (see pitstop.plugin_system.settings)
    architecture: Any = (
        None  # a model's pitstop.plugin_system.architecture.Architecture (loading rules)
    )
    takes_settings: bool = False  # its factory has a ``settings`` keyword: create() fills it
    # a kernel set's device types where ``kernels="auto"`` picks it ("*": any, as a fallback)
    auto_devices: tuple[str, ...] = ()

    @property
    def owner(self) -> str:
        """How errors name it: ``scheduler 'chunked' (pitstop 0.1.0)``."""
        return owner(self.kind, self.name, self.distribution, self.version)

    def is_selected(self, config: EngineConfig) -> bool:
        """Whether ``config`` picks this strategy by name (``kernels="auto"`` picks none yet)."""
        field = KIND_TABLE[self.kind].selected_by
        return field in attrs.fields_dict(type(config)) and getattr(config, field) == self.name

    def read_settings(self, config: EngineConfig) -> Any:
        """Its validated settings from ``config``, for a strategy built alone (a test, a
        conformance suite; :func:`pitstop.plugin_system.settings.strategy_settings`)."""
        return strategy_settings(self, config)


def owner(kind: str, name: str, distribution: str, version: str) -> str:
    """How errors name a strategy: ``scheduler 'chunked' (pitstop 0.1.0)``."""
    return f"{kind} {name!r} ({distribution} {version})".replace(" )", ")")


def takes_settings(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` has a ``settings`` keyword (create() then hands it its settings)."""
    return takes_keyword(factory, "settings")


def takes_keyword(factory: Callable[..., Any], keyword: str) -> bool:
    """Whether ``factory`` can be called with ``keyword=`` (a model's ``weights``)."""
    try:
        param = inspect.signature(factory).parameters.get(keyword)
    except (TypeError, ValueError):  # a builtin or a C callable: no signature to read
        return False
    return param is not None and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)


@attrs.frozen
class PluginSource:
    """A loaded plugin module and the distribution that declared it."""

    entry_point: str
    module: ModuleType
    distribution: str
    version: str


def check_registration(
    kind: str,
    source: PluginSource,
    name: Any,
    factory: Any,
    settings: Any,
    architecture: Any,
    auto_devices: tuple[Any, ...],
) -> None:
    """The arguments of one ``register()`` call, each checked on its own (PluginError)."""
    if auto_devices and kind != "kernels":
        raise PluginError(
            f"{source.distribution}: the {kind} {name!r} is not a kernel set; only kernel "
            "sets take auto_devices= (the device types where kernels='auto' picks them)"
        )
    if not all(isinstance(d, str) and d for d in auto_devices):
        raise PluginError(
            f"{source.distribution}: the kernel set {name!r} needs auto_devices= device "
            f"type names such as ('cuda',) or ('*',), got {auto_devices!r}"
        )
    if not isinstance(name, str) or not name:
        raise PluginError(f"{source.distribution}: a {kind} needs a non-empty name, got {name!r}")
    if not callable(factory):
        raise PluginError(f"{source.distribution}: the {kind} {name!r} factory is not callable")
    if (architecture is None) != (kind != "model") or (
        architecture is not None and not isinstance(architecture, Architecture)
    ):
        raise PluginError(
            f"{source.distribution}: the {kind} {name!r} "
            + (
                "needs architecture=pitstop.plugin_system.architecture.Architecture(...): how its "
                "config.json is read, which tensors it holds, its rotary tables"
                if kind == "model"
                else "is not a model; only models take architecture="
            )
        )
    if settings is not None and kind == "source":
        raise PluginError(
            f"{source.distribution}: the model source {name!r} takes no settings: a source "
            "is built from the plugin manager alone, not from an engine's config"
        )
    if settings is not None and not is_settings_class(settings):
        raise PluginError(
            f"{source.distribution}: the {kind} {name!r} settings must be an attrs class "
            f"whose fields are made with pitstop.plugin_system.settings.setting(), got {settings!r}"
        )
