"""The plugin system: the hooks a plugin implements, the kinds of strategy and the
protocols each must satisfy, declared plugin settings, and the plugin manager that
loads built-in and third-party strategies the same way."""
