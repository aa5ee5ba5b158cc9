"""ringstream: a host-local LLM inference daemon, and the client apps use to talk to it.

Apps write::

    from ringstream import Client, AsyncClient

The daemon's parts install under this one name: ``ringstream.daemon``
(front, scheduler, workers, engine), ``ringstream.ipc`` (protocol, rings,
client) and ``ringstream.tools`` (ringstream-top, benchmarks). The client
names below are loaded on first use, so ``import ringstream.daemon.worker.loop``
does not pull in the client and ``import ringstream`` stays cheap.
"""

from __future__ import annotations

import importlib
from pathlib import Path

__version__ = "0.1.0"

# In a source checkout the parts sit next to this folder (pyproject.toml maps them at install): look there too,
# so that a checkout on PYTHONPATH runs its own code, installed or not. An installed ringstream has its parts
# inside this folder and no pyproject.toml beside it.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "daemon" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)

_CLIENT_NAMES = (
    "AsyncClient", "Client", "Completion", "DaemonUnavailable", "InternalError", "InvalidRequest", "PromptTooLong",
    "QueueFull", "QueueTimeout", "RingstreamError", "ServerError", "ShuttingDown", "StreamOrderError",
    "UnknownRequest", "WorkerFailed",
)
__all__ = ["__version__", *_CLIENT_NAMES]


def __getattr__(name: str):
    if name in _CLIENT_NAMES:
        return getattr(importlib.import_module("ringstream.ipc.client"), name)
    raise AttributeError(f"module 'ringstream' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
