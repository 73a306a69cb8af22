"""The errors pitstop raises. Each message names the problem and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import NoReturn


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


def fail_request(message: str) -> NoReturn:
    """Raise :class:`InvalidRequestError` with ``message`` (request checks end here)."""
    raise InvalidRequestError(message)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the known name nearest ``name``, or ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
