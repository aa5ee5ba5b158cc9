"""Process titles, so that ``ps`` and ``top`` name each ringstream process.

``ringstream: front [INSTANCE]`` for the front, ``ringstream: worker 0 cpu``
or ``ringstream: worker 1 cuda:1`` for each worker, ``ringstream: http`` for
the HTTP API child (``serve --http``), instead of the
interpreter's command line (a worker's would be multiprocessing's
``python3 -B -c from multiprocessing.spawn ...``). ``setproctitle`` rewrites
the command line that ``ps`` and /proc/PID/cmdline show, and the short name
of /proc/PID/comm (its first 15 bytes).
"""

from __future__ import annotations

from setproctitle import setproctitle

TITLE_PREFIX = "ringstream: "


def front_title(instance: str) -> str:
    return f"{TITLE_PREFIX}front [{instance}]"


def worker_title(index: int, device: str) -> str:
    return f"{TITLE_PREFIX}worker {index} {device}"


def http_title() -> str:
    return f"{TITLE_PREFIX}http"


def set_process_title(title: str) -> None:
    """Make ``title`` (from :func:`front_title`, :func:`worker_title` or :func:`http_title`) this process's title."""
    setproctitle(title)
