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
