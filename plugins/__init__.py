"""The built-in strategies, one sub-package per kind.

Nothing here is imported by the core: each strategy module is declared under
the ``pitstop`` entry-point group in pyproject.toml and loaded by the plugin
manager exactly as a third-party plugin is. For convenience this package
re-exports the plugin manager.
"""

from pitstop.plugin_system.plugin_manager import PluginManager, Strategy, get_plugin_manager

__all__ = ["PluginManager", "Strategy", "get_plugin_manager"]
