"""ringstream's processes: front, scheduler, workers and engine."""

__version__ = "0.1.0"
