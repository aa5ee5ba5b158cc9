"""The front's start-up read of the model: resolve it (a hub id may download), read its tokenizer, check both.

Resolution runs on a thread of its own, raced against the stop signals: a download may take minutes, or hang on
a silent network, and SIGTERM / SIGINT must end such a start at once. The thread is a daemon thread and is
never joined: huggingface_hub's own download threads may outlive it, which is why a process whose start was
abandoned so exits without waiting for them (:func:`ringstream.daemon.front.shell.serve`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
from dataclasses import replace
from typing import Callable

from ringstream.daemon.common.config import Config
from ringstream.daemon.common.model_dir import (
    ModelInfo, ModelNotFound, check_tokenizer_vocab, load_tokenizer, resolve_model_dir,
)
from ringstream.daemon.common.supervision import StartupError
from ringstream.daemon.front.validate import Validator

__all__ = ["LoadAbandoned", "load_model", "read_model"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class LoadAbandoned(StartupError):
    """A stop signal arrived while the model was still resolving: the start ends with exit 0, the resolving
    thread (and any download under it) left running until the process exits."""

    def __init__(self, model: str | None) -> None:
        super().__init__(f"stopped while resolving the model {model}", exit_code=0)


def read_model(config: Config) -> tuple[ModelInfo, Validator]:
    """The model of ``config`` resolved (:func:`resolve_model_dir`, ``max_model_len`` applied), with the
    request validator over its tokenizer; blocking (file reads, maybe a download).

    Raises:
        ModelNotFound: not there (yet).
        ModelError: refused (the model, or its tokenizer against its vocabulary).
        ValueError: ``max_model_len`` exceeds the model's context.
    """
    model = resolve_model_dir(config.model, config.max_model_len)
    if config.max_model_len is not None:
        if config.max_model_len > model.max_model_len:
            raise ValueError(f"max_model_len = {config.max_model_len} exceeds the model's context of "
                             f"{model.max_model_len} tokens")
        model = replace(model, max_model_len=config.max_model_len)
    tokenizer = load_tokenizer(model)
    check_tokenizer_vocab(tokenizer, model)  # before any worker loads the weights
    return model, Validator(tokenizer, model)


async def load_model(config: Config, on_stop: Callable[[], None]) -> tuple[ModelInfo, Validator]:
    """:func:`read_model` on a daemon thread while the loop waits for it or for a stop signal; the signals are
    handed to ``on_stop`` again afterwards.

    Raises:
        StartupError: exit 1 for :class:`ModelNotFound` (a retry may find it), exit 2 for a refusal or a
            setting at odds with the model (no retry fixes it).
        LoadAbandoned: a stop signal came first (exit 0).
    """
    loop = asyncio.get_running_loop()
    result: concurrent.futures.Future = concurrent.futures.Future()

    def read() -> None:
        try:
            result.set_result(read_model(config))
        except BaseException as exc:  # noqa: BLE001 (handed to the loop, which raises it)
            result.set_exception(exc)

    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    threading.Thread(target=read, name="ringstream-model", daemon=True).start()
    done, stopped = asyncio.wrap_future(result), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([done, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_stop)
    if not done.done():  # left pending: the thread may still set it, and nothing waits for it any more
        raise LoadAbandoned(config.model)
    try:
        return done.result()
    except ModelNotFound as exc:
        raise StartupError(str(exc)) from exc
    except Exception as exc:  # the model refused, or a setting at odds with it
        raise StartupError(str(exc), exit_code=2) from exc
