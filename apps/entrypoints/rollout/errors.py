"""The rollout engine's refusals; each message names the problem and the fix."""

from __future__ import annotations

from pitstop.errors import InvalidRequestError, PitstopError


class EngineSleepingError(PitstopError):
    """The engine is asleep (its weights or KV cache released) and cannot generate."""


class EngineBusyError(PitstopError):
    """Requests are still running; sleeping or changing weights now would corrupt them."""


class WeightUpdateError(InvalidRequestError):
    """A batch of weights was refused as a whole (nothing of it was applied)."""
