"""Alias of :mod:`pitstop.testing.allocator` under the plural name the issue uses."""

from pitstop.testing.allocator import *  # noqa: F403
from pitstop.testing.allocator import __all__  # noqa: F401
