"""Subcommands of ``pitstop`` that plugins and applications add: the ``register_commands`` hook.

A plugin module (named under the ``pitstop`` entry-point group, as every strategy is)
implements ``@pitstop.hookimpl def register_commands(register)`` and calls
``register(name, setup, run, help="", description="")`` for each subcommand: the CLI adds
the subparser ``name``, calls ``setup(parser)`` to add its arguments
(``pitstop.entrypoints.engine_args.add_cli_flags`` adds every engine and plugin setting),
and calls ``run(args) -> int`` (the exit status) when it is chosen. ``serve``, ``bench``,
``verify`` and the gguf source's ``cache`` are registered this way.

The engine's plugin manager loads the modules and knows nothing of commands; the CLI reads
them from its loaded modules (:func:`commands`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from pitstop.errors import PluginError
from pitstop.plugin_system.plugin_manager import ALLOW_LIST_VARIABLE, PluginManager
from pitstop.plugin_system.registration import PluginSource

HOOK = "register_commands"


@attrs.frozen
class Command:
    """One registered subcommand of ``pitstop``: its arguments and its entry function."""

    name: str
    setup: Callable[[Any], None]  # setup(argparse.ArgumentParser): add the arguments
    run: Callable[[Any], int]  # run(argparse.Namespace) -> exit status
    help: str
    description: str
    distribution: str
    version: str
    module: str


def commands(plugins: PluginManager) -> dict[str, Command]:
    """Every subcommand the modules ``plugins`` loaded register, by name; two that register
    one name are a :class:`PluginError` naming both."""
    found: dict[str, Command] = {}
    for source in plugins.sources:
        impl = getattr(source.module, HOOK, None)
        if impl is not None and hasattr(impl, "pitstop_impl"):
            impl(register=_registrar(source, found))
    return found


def _registrar(source: PluginSource, found: dict[str, Command]) -> Callable[..., None]:
    def register(
        name: str,
        setup: Callable[[Any], None],
        run: Callable[[Any], int],
        help: str = "",
        description: str = "",
    ) -> None:
        if not isinstance(name, str) or not name or name.startswith("-"):
            raise PluginError(
                f"{source.distribution}: a command needs a name such as 'serve', got {name!r}"
            )
        if not callable(setup) or not callable(run):
            raise PluginError(
                f"{source.distribution}: the command {name!r} needs callable setup(parser) "
                "and run(args) functions"
            )
        existing = found.get(name)
        if existing is not None:
            raise PluginError(
                f"two plugins register the command {name!r}: {existing.distribution} "
                f"({existing.module}) and {source.distribution} ({source.module.__name__}); "
                f"uninstall one, or narrow {ALLOW_LIST_VARIABLE}"
            )
        found[name] = Command(
            name,
            setup,
            run,
            help or (run.__doc__ or "").strip().split("\n")[0],
            description,
            source.distribution,
            source.version,
            source.module.__name__,
        )

    return register
