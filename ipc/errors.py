"""The exceptions of the client library: one per daemon error code, and the client's own.

Every one is a :class:`RingstreamError`. An ``Error`` message from the daemon
becomes the :class:`ServerError` subclass of its code (:func:`error_from`).
"""

from __future__ import annotations

from ringstream.ipc import protocol as P


class RingstreamError(Exception):
    """Base of every error this library raises."""


class DaemonUnavailable(RingstreamError):
    """No daemon can answer: its ipc socket is missing, stale or closed to this user, or it said nothing for ``timeout_s``."""


class StreamOrderError(RingstreamError):
    """A chunk arrived out of ``seq`` order, or after the terminal message."""


class ServerError(RingstreamError):
    """The daemon ended a request with an ``Error``; ``code`` is its error code."""

    code = P.ErrorCode.INTERNAL

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class InvalidRequest(ServerError):
    code = P.ErrorCode.INVALID_REQUEST


class PromptTooLong(ServerError):
    code = P.ErrorCode.PROMPT_TOO_LONG


class QueueFull(ServerError):
    code = P.ErrorCode.QUEUE_FULL


class QueueTimeout(ServerError):
    code = P.ErrorCode.QUEUE_TIMEOUT


class WorkerFailed(ServerError):
    code = P.ErrorCode.WORKER_FAILED


class ShuttingDown(ServerError):
    code = P.ErrorCode.SHUTTING_DOWN


class UnknownRequest(ServerError):
    code = P.ErrorCode.UNKNOWN_REQUEST


class InternalError(ServerError):
    code = P.ErrorCode.INTERNAL


ERRORS: dict[str, type[ServerError]] = {cls.code: cls for cls in ServerError.__subclasses__()}


def error_from(msg: P.Error) -> ServerError:
    """The typed exception for an ``Error`` message."""
    return ERRORS.get(msg.code, InternalError)(f"{msg.code}: {msg.message}", msg.id)
