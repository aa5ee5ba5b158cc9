"""ringstream's processes: front, scheduler, workers and engine."""

from ringstream import __version__

__all__ = ["__version__"]
