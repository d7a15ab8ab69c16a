"""Hyper-parameter sequence functions for studies: re-exported from :mod:`events.hp`."""

from events.hp import *  # noqa: F403
from events.hp import __all__  # noqa: F401
