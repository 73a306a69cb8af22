"""The plugin manager: loads built-in and third-party strategies the same way.

Every plugin, built-in or not, is a module named under the ``pitstop``
entry-point group of some installed distribution. Loading imports each
module, registers it with pluggy, then calls its register hooks with a
``register`` callable that records the strategy together with the
distribution it came from. ``PITSTOP_PLUGINS`` (comma-separated entry-point
or distribution names) narrows which entry points load.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, overload

import attrs
import pluggy

from pitstop.errors import ConfigError, PluginError, did_you_mean
from pitstop.ground.model_config import ModelConfig
from pitstop.plugin_system import hookspecs, protocols
from pitstop.plugin_system.architecture import Architecture
from pitstop.plugin_system.executor import Executor
from pitstop.plugin_system.kinds import KINDS as KIND_TABLE
from pitstop.plugin_system.kinds import missing_members
from pitstop.plugin_system.registration import (
    PluginSource,
    Strategy,
    check_registration,
    takes_settings,
)
from pitstop.plugin_system.settings import (
    ResolvedConfig,
    aliased_fields,
    option_fields,
    resolve,
    same_declaration,
    setting_aliases,
    strategy_settings,
)
from pitstop.plugin_system.verifier import Verifier

if TYPE_CHECKING:
    from pitstop.config import EngineConfig

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "pitstop"
ALLOW_LIST_VARIABLE = "PITSTOP_PLUGINS"

# kind -> the register hook that fills it (the whole table: pitstop.plugin_system.kinds.KINDS)
KINDS: dict[str, str] = {name: kind.hook for name, kind in KIND_TABLE.items()}


class PluginManager:
    """Loads plugins and keeps the registry of strategies by kind and name."""

    def __init__(
        self,
        *,
        allow: Iterable[str] | None = None,
        extra_modules: Iterable[ModuleType] = (),
        load_entry_points: bool = True,
    ) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.sources: list[PluginSource] = []
        self.registry: dict[str, dict[str, Strategy]] = {kind: {} for kind in KINDS}
        if allow is None:
            env = os.environ.get(ALLOW_LIST_VARIABLE, "").strip()
            allow = [a.strip() for a in env.split(",") if a.strip()] if env else None
        self.allow = set(allow) if allow is not None else None
        if load_entry_points:
            self._load_entry_points()
        for module in extra_modules:
            self.add_module(module, distribution="(in-process)", version="")

    # ------------------------------------------------------------------ loading
    def _load_entry_points(self) -> None:
        seen: set[tuple[str, str]] = set()
        for dist in md.distributions():
            dist_name = dist.metadata["Name"] or "?"
            for ep in dist.entry_points:
                if ep.group != ENTRY_POINT_GROUP or (dist_name, ep.name) in seen:
                    continue
                seen.add((dist_name, ep.name))  # a distribution seen twice on sys.path counts once
                if (
                    self.allow is not None
                    and ep.name not in self.allow
                    and dist_name not in self.allow
                ):
                    log.debug(
                        "plugin %s from %s not in %s; skipped",
                        ep.name,
                        dist_name,
                        ALLOW_LIST_VARIABLE,
                    )
                    continue
                try:
                    module = ep.load()
                except Exception as exc:  # a broken plugin names itself
                    raise PluginError(
                        f"plugin {ep.name!r} ({ep.value}) from distribution {dist_name} failed to load: {exc}"
                    ) from exc
                self.add_module(
                    module, distribution=dist_name, version=dist.version, entry_point=ep.name
                )

    def add_module(
        self, module: ModuleType, *, distribution: str, version: str, entry_point: str | None = None
    ) -> None:
        """Register one plugin module and collect the strategies it registers."""
        if self.pm.is_registered(module):
            return
        self.pm.register(module, name=entry_point or module.__name__)
        source = PluginSource(entry_point or module.__name__, module, distribution, version)
        self.sources.append(source)
        for kind, hook_name in KINDS.items():
            impl = getattr(module, hook_name, None)
            if impl is None or not hasattr(impl, "pitstop_impl"):
                continue
            impl(register=self._registrar(kind, source))

    def _registrar(self, kind: str, source: PluginSource) -> Callable[..., None]:
        def register(
            name: str,
            factory: Callable[..., Any],
            description: str = "",
            options: Mapping[str, str] | None = None,
            settings: type | None = None,
            architecture: Any = None,
            auto_devices: Iterable[str] = (),
        ) -> None:
            auto_devices = tuple(auto_devices)
            check_registration(kind, source, name, factory, settings, architecture, auto_devices)
            if settings is not None:
                self._check_aliases(kind, name, settings, source)
                for other in self.strategies():
                    if other.name == name and other.settings is not None:
                        raise PluginError(
                            f"the {kind} {name!r} of {source.distribution} and the {other.kind} "
                            f"{name!r} of {other.distribution} both declare settings under the "
                            f"namespace {name!r}; rename one"
                        )
            if architecture is not None:
                self._check_gguf_claims(name, architecture, source)
                self._check_presets(name, architecture, source)
            existing = self.registry[kind].get(name)
            if existing is not None:
                raise PluginError(
                    f"two plugins register the {kind} {name!r}: {existing.distribution} "
                    f"({existing.module}) and {source.distribution} ({source.module.__name__}); "
                    f"uninstall one, or narrow {ALLOW_LIST_VARIABLE}"
                )
            self.registry[kind][name] = Strategy(
                kind=kind,
                name=name,
                factory=factory,
                distribution=source.distribution,
                version=source.version,
                module=source.module.__name__,
                description=description or (factory.__doc__ or "").strip().split("\n")[0],
                options=dict(options or {}),
                settings=settings,
                architecture=architecture,
                takes_settings=settings is not None and takes_settings(factory),
                auto_devices=auto_devices,
            )

        return register

    def _check_aliases(self, kind: str, name: str, settings: type, source: PluginSource) -> None:
        """Plugins sharing one alias declare it alike (pitstop.entrypoints.engine_args refuses an alias that
        is an engine setting's name)."""
        shared = self.setting_aliases()
        for att in aliased_fields(settings):
            alias = att.metadata["alias"]
            for other, other_att in shared.get(alias, ()):
                if not same_declaration(att, other_att):
                    raise PluginError(
                        f"{source.distribution}: the {kind} {name!r} declares the alias "
                        f"{alias!r} unlike {other.owner} does (type, default, minimum and "
                        "choices must agree); rename one"
                    )

    # ------------------------------------------------------------------ lookup
    def setting_aliases(self) -> Mapping[str, tuple[tuple[Strategy, attrs.Attribute], ...]]:
        """Each setting alias (``chunk_size``) -> the declarations of it, with the field."""
        return setting_aliases(self.strategies())

    def auto_kernels(self, device_type: str) -> str:
        """The kernel set ``kernels="auto"`` picks on a device of ``device_type``: one that
        declares that type (``register(..., auto_devices=...)``), else one that declares
        ``"*"`` (any device); the first by name when several do."""
        for wanted in (device_type, "*"):
            names = sorted(
                s.name for s in self.registry["kernels"].values() if wanted in s.auto_devices
            )
            if names:
                return names[0]
        raise ConfigError(
            f"kernels='auto': no registered kernel set declares itself for {device_type!r} "
            f"devices; pass kernels=NAME (registered: {', '.join(self.names('kernels'))})"
        )

    def names(self, kind: str) -> list[str]:
        """The registered names of one kind, sorted."""
        return sorted(self.registry[kind])

    def get(self, kind: str, name: str) -> Strategy:
        """The strategy of ``kind`` called ``name``; an unknown name lists those that exist."""
        if kind not in self.registry:
            raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
        try:
            return self.registry[kind][name]
        except KeyError:
            have = ", ".join(self.names(kind)) or "none registered"
            raise PluginError(
                f"unknown {kind} {name!r}{did_you_mean(name, self.names(kind))}; "
                f"registered {kind} names: {have}"
                + (f" ({ALLOW_LIST_VARIABLE} is set)" if self.allow is not None else "")
            ) from None

    def architecture(self, name: str) -> Architecture:
        """The loading rules of the model architecture ``name`` (a checkpoint's
        ``architectures`` entry); an unknown name lists those registered."""
        return self.get("model", name).architecture

    def architecture_for_hf(self, raw: Mapping[str, Any]) -> tuple[str, Architecture] | None:
        """The registered architecture a ``config.json`` names (by ``architectures``,
        then ``model_type``), or None."""
        for name in raw.get("architectures") or ():
            if isinstance(name, str) and name in self.registry["model"]:
                return name, self.registry["model"][name].architecture
        for s in self.registry["model"].values():
            if raw.get("model_type") in s.architecture.model_types:
                return s.name, s.architecture
        return None

    def hf_model_types(self) -> dict[str, str]:
        """Every ``config.json`` model_type a registered architecture reads -> its name."""
        return {
            t: s.name for s in self.registry["model"].values() for t in s.architecture.model_types
        }

    def architecture_for_gguf(self, gguf_architecture: Any) -> tuple[str, Architecture] | None:
        """The registered architecture that claims a GGUF file's ``general.architecture``
        (through its :class:`~pitstop.plugin_system.architecture.GGUFRules`), or None."""
        if not isinstance(gguf_architecture, str):  # absent, or not text: nobody claims it
            return None
        name = self.gguf_claims().get(gguf_architecture)
        return None if name is None else (name, self.registry["model"][name].architecture)

    def gguf_claims(self) -> dict[str, str]:
        """Every GGUF ``general.architecture`` value a registered architecture reads -> its name."""
        return {
            value: s.name
            for s in self.registry["model"].values()
            if s.architecture.gguf is not None
            for value in s.architecture.gguf.architectures
        }

    def _check_gguf_claims(
        self, name: str, architecture: Architecture, source: PluginSource
    ) -> None:
        """Two architectures claiming one GGUF ``general.architecture`` is an error naming both."""
        claims = self.gguf_claims()
        for value in architecture.gguf.architectures if architecture.gguf else ():
            other = claims.get(value)
            if other is not None and other != name:
                strategy = self.registry["model"][other]
                raise PluginError(
                    f"two model plugins read GGUF files of general.architecture {value!r}: "
                    f"{other} of {strategy.distribution} ({strategy.module}) and {name} of "
                    f"{source.distribution} ({source.module.__name__}); uninstall one, or "
                    f"narrow {ALLOW_LIST_VARIABLE}"
                )

    def presets(self) -> dict[str, ModelConfig]:
        """Every ``dummy:<name>`` shape the registered architectures give, by name."""
        return {
            preset: config
            for s in self.registry["model"].values()
            for preset, config in s.architecture.presets.items()
        }

    def _check_presets(self, name: str, architecture: Architecture, source: PluginSource) -> None:
        """A preset is of the architecture that gives it, and only one gives each name."""
        given = self.presets()
        for preset, config in architecture.presets.items():
            if not isinstance(config, ModelConfig) or config.architecture != name:
                raise PluginError(
                    f"{source.distribution}: the preset {preset!r} of the model {name!r} must be "
                    f"a pitstop.ground.model_config.ModelConfig with architecture={name!r}, got {config!r}"
                )
            if preset in given:
                raise PluginError(
                    f"two model plugins give the preset {preset!r}: {given[preset].architecture} "
                    f"and {name} of {source.distribution} ({source.module.__name__}); rename one"
                )

    def resolve(
        self, config: EngineConfig, *, kinds: Collection[str] | None = None
    ) -> ResolvedConfig:
        """:func:`pitstop.plugin_system.settings.resolve` against these plugins."""
        return resolve(config, self, kinds=kinds)

    def check_config(self, config: EngineConfig) -> None:
        """Check ``config`` against the registered plugins, as :meth:`resolve` does."""
        self.resolve(config)

    def selected_by(self) -> dict[str, str]:
        """Each kind -> the :class:`EngineConfig` setting that selects its strategy by name
        (``proposer`` -> ``speculative``; a model's is no setting: the checkpoint picks it)."""
        return {name: kind.selected_by for name, kind in KIND_TABLE.items()}

    def declared_options(self) -> dict[str, str]:
        """Every ``options`` key a registered strategy reads -> the strategy that reads it."""
        declared: dict[str, str] = {}
        for s in self.strategies():
            keys = list(s.options)
            if s.settings is not None:
                for att in option_fields(s.settings):
                    keys += [f"{s.name}.{att.name}", *att.metadata["legacy"]]
                    keys += [att.metadata["alias"]] if att.metadata["alias"] else []
            for key in keys:
                declared.setdefault(key, f"{s.kind} {s.name!r}")
        return declared

    @overload
    def create(
        self, kind: Literal["allocator"], name: str, *args: Any, **kwargs: Any
    ) -> protocols.Allocator: ...
    @overload
    def create(
        self, kind: Literal["scheduler"], name: str, *args: Any, **kwargs: Any
    ) -> protocols.Scheduler: ...
    @overload
    def create(
        self, kind: Literal["kernels"], name: str, *args: Any, **kwargs: Any
    ) -> protocols.KernelSet: ...
    @overload
    def create(
        self, kind: Literal["sampler"], name: str, *args: Any, **kwargs: Any
    ) -> protocols.Sampler: ...
    @overload
    def create(
        self, kind: Literal["proposer"], name: str, *args: Any, **kwargs: Any
    ) -> protocols.Proposer: ...
    @overload
    def create(
        self, kind: Literal["model"], name: str, *args: Any, **kwargs: Any
    ) -> protocols.Model: ...
    @overload
    def create(
        self, kind: Literal["weights"], name: str, *args: Any, **kwargs: Any
    ) -> protocols.WeightFormat: ...
    @overload
    def create(
        self, kind: Literal["source"], name: str, *args: Any, **kwargs: Any
    ) -> protocols.ModelSourceReader: ...
    @overload
    def create(
        self, kind: Literal["grammar"], name: str, *args: Any, **kwargs: Any
    ) -> protocols.GrammarBackend: ...
    @overload
    def create(
        self, kind: Literal["executor"], name: str, *args: Any, **kwargs: Any
    ) -> Executor: ...
    @overload
    def create(
        self, kind: Literal["verifier"], name: str, *args: Any, **kwargs: Any
    ) -> Verifier: ...
    @overload
    def create(self, kind: str, name: str, *args: Any, **kwargs: Any) -> Any: ...

    def create(self, kind: str, name: str, *args: Any, **kwargs: Any) -> Any:
        """Build the named strategy with its factory and check it against its kind's protocol.

        A factory with a ``settings`` keyword gets the strategy's typed settings: the
        ``settings`` given (the engine gives :meth:`ResolvedConfig.of`), else, for a strategy
        built alone (a test, a conformance suite), those read from the config it is built
        from (its first argument; :func:`pitstop.plugin_system.settings.strategy_settings`). A
        :class:`PluginError` names the plugin and every protocol member the object
        lacks (:func:`pitstop.plugin_system.kinds.missing_members`).
        """
        strategy = self.get(kind, name)
        settings = kwargs.pop("settings", None)
        if strategy.takes_settings:
            kwargs["settings"] = (
                settings if settings is not None else strategy_settings(strategy, args[0])
            )
        obj = strategy.factory(*args, **kwargs)
        missing = missing_members(KIND_TABLE[kind], obj)
        if missing:
            protocol = KIND_TABLE[kind].protocol
            raise PluginError(
                f"{strategy.owner}: its factory returned a {type(obj).__name__} that lacks "
                f"{', '.join(missing)}; a {kind} must provide every member of "
                f"pitstop.plugin_system.protocols.{protocol.__name__} (optional ones have defaults in its "
                "base class, e.g. pitstop.plugin_system.protocols.KernelSetBase / ProposerBase)"
            )
        return obj

    def strategies(self) -> list[Strategy]:
        """Every registered strategy, by kind then name."""
        return [s for kind in KINDS for _, s in sorted(self.registry[kind].items())]

    @property
    def hook(self) -> Any:
        """pluggy's hook relay, for the observer hooks."""
        return self.pm.hook

    def has_observers(self, hook_name: str) -> bool:
        """Whether any loaded plugin implements the observer hook ``hook_name``."""
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())


_default: PluginManager | None = None


def get_plugin_manager(*, reload: bool = False) -> PluginManager:
    """The process-wide plugin manager, loaded on first use."""
    global _default
    if _default is None or reload:
        _default = PluginManager()
    return _default
