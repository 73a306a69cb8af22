"""Alias of :mod:`pitstop.testing.scheduler` under the plural name the issue uses."""

from pitstop.testing.scheduler import *  # noqa: F403
from pitstop.testing.scheduler import __all__  # noqa: F401
