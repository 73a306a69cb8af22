"""The errors pitstop raises. Each message names the problem and the fix."""

from __future__ import annotations


class PitstopError(Exception):
    """Base class of every error pitstop raises on purpose."""


class ConfigError(PitstopError, ValueError):
    """An engine configuration value is invalid (raised before any weight loads)."""


class PluginError(PitstopError, LookupError):
    """A strategy name is unknown, claimed twice, or a plugin failed to load."""


class ModelLoadError(PitstopError, OSError):
    """A model file is missing, unreadable, or of an unsupported architecture."""


class InvalidRequestError(PitstopError, ValueError):
    """A request (prompt or sampling parameters) is invalid; the engine keeps serving."""


class OutOfPagesError(PitstopError, RuntimeError):
    """An allocator was asked for pages it does not have; nothing was changed (preempt and retry)."""


class WorkerDiedError(PitstopError, RuntimeError):
    """A tensor-parallel rank failed or died; the engine cannot run on and must be rebuilt."""
