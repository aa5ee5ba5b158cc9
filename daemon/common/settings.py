"""Live settings: what ``Admin`` and SIGHUP may change without a restart, checked all or nothing.

Pure functions over :class:`ringstream.daemon.common.config.Config` values (no
sockets, no state), so the front applies their result and tests call them
directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ringstream.daemon.common.config import Config

__all__ = ["LIVE_SETTINGS", "SettingsChange", "change_settings", "reload_changes"]

LIVE_SETTINGS = (
    "max_concurrency", "queue_size", "priority_queue_limits", "queue_full_policy", "aging_rate", "preemption",
    "timeout_s", "queue_timeout_s", "client_timeout_s", "drain_timeout_s", "log_level",
)
"""Config fields that ``Admin`` and SIGHUP change without a restart; the others need one."""


@dataclass(frozen=True, slots=True)
class SettingsChange:
    """The outcome of :func:`change_settings`."""

    config: Config
    """The new configuration (the old one when nothing changed)."""
    changed: dict
    """The settings whose value differs from before: ``{name: new value}`` (empty when none)."""
    notes: tuple[str, ...] = ()
    """What takes effect differently from what was asked (said to the caller and logged)."""


def change_settings(config: Config, changes: dict, max_num_seqs: list[int] | tuple[int, ...] = ()) -> SettingsChange:
    """Apply live ``changes`` to ``config``: all or nothing.

    Args:
        config: the settings in force.
        changes: ``{name: value}``, names from :data:`LIVE_SETTINGS`. ``log_level``
            is accepted in any case; ``queue_timeout_s`` 0 or None means no queue timeout.
        max_num_seqs: the workers' slots (``max_num_seqs`` each reported), for the
            note when ``max_concurrency`` asks for more than a worker can run.

    Returns:
        The new config, the settings that actually changed, and notes.

    Raises:
        ValueError: an unknown or non-live name, or a value the config refuses (named).
    """
    unknown = sorted(set(changes) - set(LIVE_SETTINGS))
    if unknown:
        raise ValueError(f"not a live setting: {', '.join(unknown)} (live: {', '.join(LIVE_SETTINGS)})")
    changes = dict(changes)
    if isinstance(changes.get("log_level"), str):
        changes["log_level"] = changes["log_level"].lower()
    if "queue_timeout_s" in changes and changes["queue_timeout_s"] in (0, None):
        changes["queue_timeout_s"] = None
    try:
        fresh = msgspec.convert({**msgspec.structs.asdict(config), **changes}, Config, strict=False).check()
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None
    changed = {name: getattr(fresh, name) for name in changes if getattr(fresh, name) != getattr(config, name)}
    notes = []
    slots = min(max_num_seqs, default=0)
    if "max_concurrency" in changes and slots and fresh.max_concurrency > slots:
        notes.append(f"max_concurrency={fresh.max_concurrency} takes effect as {slots}: a worker runs at most "
                     f"max_num_seqs={slots} requests at once (max_num_seqs changes only with a restart)")
    return SettingsChange(fresh if changed else config, changed, tuple(notes))


def reload_changes(config: Config, fresh: Config) -> tuple[dict, list[str]]:
    """What a re-read config file changes: ``({live name: value}, [names that need a restart])``."""
    changed = {name for name in Config.__struct_fields__ if getattr(fresh, name) != getattr(config, name)}
    live = {name: getattr(fresh, name) for name in sorted(changed & set(LIVE_SETTINGS))}
    return live, sorted(changed - set(LIVE_SETTINGS))
