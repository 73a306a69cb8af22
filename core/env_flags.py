"""On/off settings read from the environment (``PITSTOP_POISON_MEMORY``, ``PITSTOP_FREEZE_GC``, ...).

One reading for all of them: ``1``, ``true``, ``yes`` or ``on`` is on; ``0``,
``false``, ``no`` or ``off`` is off (any case, spaces around ignored); unset or
empty is the setting's default; anything else is a :class:`ConfigError` that
names the variable and the spellings, instead of a silent default.
"""

from __future__ import annotations

import os

from pitstop.errors import ConfigError

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """Environment variable ``name`` read as on/off; ``default`` when it is unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ConfigError(
        f"{name}={os.environ[name]!r} is not an on/off value; set it to one of "
        f"{', '.join(ON)} (on) or {', '.join(OFF)} (off), or unset it"
    )


FREEZE_GC_VAR = "PITSTOP_FREEZE_GC"
POISON_MEMORY_VAR = "PITSTOP_POISON_MEMORY"


def freeze_gc_from_env() -> bool:
    """``EngineConfig.freeze_gc``'s default: on unless ``PITSTOP_FREEZE_GC`` is off (:func:`env_flag`).

    The test suite turns it off (a full collection of a test process's heap
    costs about 0.3 s an engine there, hundreds of engines a run); its own
    tests ask for it by name (:mod:`pitstop.loop.gc_heap`).
    """
    return env_flag(FREEZE_GC_VAR, default=True)


def poison_from_env() -> bool:
    """Whether ``PITSTOP_POISON_MEMORY`` asks for poisoned memory (on: :func:`env_flag`;
    :mod:`pitstop.ground.poison`)."""
    return env_flag(POISON_MEMORY_VAR, default=False)
