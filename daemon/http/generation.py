"""Running an OpenAI request's choices on the daemon: fan-out, merge, and the two answer shapes.

Each choice (a prompt x ``n``) is one request of the shared
:class:`~ringstream.ipc.client.AsyncClient`, run in a task of its own that
puts its chunks (or its error) on one queue; :func:`merged` yields them as
they come. Leaving the merge (the client disconnected, an error, the server
stopping) cancels every task, and a cancelled task closes its stream, which
sends ``Cancel`` to the daemon. The ``n`` requests of one prompt run in
parallel; the daemon's prefix cache shares the prompt's KV blocks.

:class:`Choices` gathers a whole answer (non-streaming); :func:`stream_sse`
writes server-sent events: one ``data: {json}`` event per piece of text, an
error after the stream began as a last ``data: {"error": ...}`` event, then
``data: [DONE]``. An error before the first piece of text is raised as
:class:`ApiError` instead, so that the client gets a proper HTTP status.

Every write of an answer (:func:`stream_sse`, :func:`send_json`) has a
deadline: a client that leaves it unread (its TCP receive window full) for
``write_timeout_s`` has its connection aborted and its daemon requests
cancelled, so a stuck reader holds neither a daemon slot nor a growing
buffer for long; the other streams are not slowed by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from aiohttp import web

from ringstream.daemon.http import openai_schema as S
from ringstream.daemon.http import responses as R
from ringstream.daemon.http.options import WRITE_TIMEOUT_S
from ringstream.ipc import protocol as P
from ringstream.ipc.client import AsyncClient
from ringstream.ipc.errors import RingstreamError

log = logging.getLogger("ringstream.http")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Job:
    """One choice to generate: its index in the answer, its prompt (text or token ids), its prompt's index
    and which of that prompt's ``n`` samples it is."""

    index: int
    prompt: S.Prompt
    prompt_index: int
    sample: int = 0


def jobs_of(prompts: list[S.Prompt], n: int) -> list[Job]:
    """The choices of ``prompts`` x ``n``: choice ``i * n + j`` is sample ``j`` of prompt ``i`` (OpenAI's order)."""
    return [Job(i * n + j, prompt, i, j) for i, prompt in enumerate(prompts) for j in range(n)]


def job_params(job: Job, params: dict) -> dict:
    """``params`` for one job: sample ``j`` of a seeded request gets ``seed + j``, so that the ``n`` samples
    differ from each other and the whole answer is still reproducible."""
    if job.sample and params.get("seed") is not None:
        return {**params, "seed": (params["seed"] + job.sample) % (P.MAX_SEED + 1)}
    return params


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _run(client: AsyncClient, job: Job, params: dict, queue: asyncio.Queue) -> None:
    prompt, params = job.prompt, job_params(job, params)
    try:
        if isinstance(prompt, str):
            stream = client.generate(prompt, **params)
        elif isinstance(prompt, tuple):  # chat messages, rendered by the daemon
            stream = client.generate(messages=list(prompt), **params)
        else:
            stream = client.generate(prompt_token_ids=prompt, **params)
        async for chunk in stream:
            queue.put_nowait((job, chunk))
    except RingstreamError as exc:
        queue.put_nowait((job, exc))
    except Exception as exc:  # a bug of ours: the client gets a 500, the log the trace
        log.exception("choice %d failed", job.index)
        queue.put_nowait((job, exc))


class ClientStuck(ConnectionError):
    """A client left an answer unread past the write deadline; its connection was aborted."""


async def write_within(request: web.Request, response: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """``response.write(data)`` (it waits for the socket to drain past about 64 KiB buffered).

    Raises ClientStuck, after aborting the connection, when the client has
    not taken the data within ``timeout_s`` seconds.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await response.write(data)
    except TimeoutError:
        _abort(request, timeout_s)
        raise ClientStuck(f"the client read nothing for {timeout_s:g} s") from None


def _abort(request: web.Request, timeout_s: float) -> None:
    log.warning("%s %s: the client read nothing for %g s; connection aborted", request.method, request.path,
                timeout_s)
    transport = request.transport
    if transport is not None:
        transport.abort()


async def send_json(request: web.Request, body, timeout_s: float) -> web.Response:
    """Send ``body`` (a Struct) as the whole JSON answer within ``timeout_s`` seconds; returns the sent
    response. A client that does not take it in time has its connection aborted (no exception)."""
    response = web.Response(body=S.JSON_ENCODER.encode(body), content_type="application/json")
    try:
        async with asyncio.timeout(timeout_s):
            await response.prepare(request)
            await response.write_eof()
    except TimeoutError:
        _abort(request, timeout_s)
    except ConnectionError:  # gone meanwhile: aiohttp cancels the handler
        pass
    return response


async def merged(client: AsyncClient, jobs: list[Job], params: dict
                 ) -> AsyncIterator[tuple[Job, P.Chunk | Exception]]:
    """Run ``jobs``; yield ``(job, chunk)`` as chunks arrive and ``(job, exception)`` for a failed one.

    The first sample of each prompt starts at once, its other ``n - 1`` once
    its first chunk arrived: the prompt's prefill is done then and its KV
    blocks are in the worker's prefix cache, so the others reuse them instead
    of each computing the same prefill in one step (parallel sampling as
    vLLM's, which gets the same from its block allocator). Ends when every job
    ended (a chunk with ``finish_reason`` or an exception). Leaving early
    cancels the jobs still running (their daemon requests too).
    """
    queue: asyncio.Queue = asyncio.Queue()
    followers: dict[int, list[Job]] = {}
    for job in jobs:
        if job.sample:
            followers.setdefault(job.prompt_index, []).append(job)
    # A leader with followers streams from the daemon even for a whole answer: its first chunk starts them.
    lead = {**params, "stream": True}
    tasks = [asyncio.create_task(_run(client, job, lead if job.prompt_index in followers else params, queue))
             for job in jobs if not job.sample]
    open_jobs = len(jobs)
    try:
        while open_jobs:
            job, item = await queue.get()
            if not job.sample and job.prompt_index in followers:  # its prompt is cached now (or failed)
                tasks += [asyncio.create_task(_run(client, follower, params, queue))
                          for follower in followers.pop(job.prompt_index)]
            if isinstance(item, Exception) or item.finish_reason is not None:
                open_jobs -= 1
            yield job, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def as_api_error(exc: Exception) -> S.ApiError:
    if isinstance(exc, RingstreamError):
        return S.api_error_from(exc)
    return S.ApiError(500, f"internal error: {type(exc).__name__}", "server_error")


@dataclass
class Choices:
    """The text, finish reason, token counts and (when asked) logprobs of every choice of one answer."""

    count: int
    texts: dict[int, list[str]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    """Prompt tokens of each prompt (counted once whatever ``n``)."""
    completion_tokens: int = 0
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[P.TokenLogprob]] = field(default_factory=dict)
    """Each choice's token logprobs, for a request that asked."""
    prompt_logprobs: dict[int, tuple[list[int], list[P.TokenLogprob | None]]] = field(default_factory=dict)
    """Each choice's prompt token ids and logprobs, for a request that asked (``echo`` with ``logprobs``)."""

    def add(self, job: Job, chunk: P.Chunk) -> None:
        self.texts.setdefault(job.index, []).append(chunk.text)
        if chunk.logprobs is not None:
            self.token_ids.setdefault(job.index, []).extend(chunk.token_ids)
            self.logprobs.setdefault(job.index, []).extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs[job.index] = (chunk.prompt_token_ids or [], chunk.prompt_logprobs)
        if chunk.finish_reason is not None:
            self.finish[job.index] = S.finish_reason(chunk.finish_reason)
            if chunk.usage is not None:
                self.prompt_tokens.setdefault(job.prompt_index, chunk.usage.prompt_tokens)
                self.completion_tokens += chunk.usage.completion_tokens

    def text(self, index: int) -> str:
        return "".join(self.texts.get(index, ()))

    def usage(self) -> R.UsageBody:
        prompt = sum(self.prompt_tokens.values())
        return R.UsageBody(prompt, self.completion_tokens, prompt + self.completion_tokens)


async def gather(client: AsyncClient, jobs: list[Job], params: dict) -> Choices:
    """Run every job to its end; raises ApiError for the first that failed (the others are cancelled)."""
    choices = Choices(len(jobs))
    async with contextlib.aclosing(merged(client, jobs, params)) as items:
        async for job, item in items:
            if isinstance(item, Exception):
                raise as_api_error(item)
            choices.add(job, item)
    return choices


EventMaker = Callable[[Job, P.Chunk, "str | None", bool],
                     "R.CompletionBody | R.ChatChunkBody | list[R.ChatChunkBody]"]
"""``(job, chunk, finish_reason, first piece of this choice) -> the event's body`` (or a list of them, each an
event, none for a chunk that adds nothing yet)."""
UsageMaker = Callable[[R.UsageBody], "R.CompletionBody | R.ChatChunkBody"]


async def stream_sse(request: web.Request, client: AsyncClient, jobs: list[Job], params: dict,
                     make_event: EventMaker, make_usage: UsageMaker | None,
                     write_timeout_s: float = WRITE_TIMEOUT_S) -> web.StreamResponse:
    """Answer with server-sent events of the jobs' text as it arrives.

    ``make_usage`` (``stream_options.include_usage``) adds a last event with
    empty ``choices`` and the whole request's usage. Raises ApiError when
    the first job to answer failed before any text was sent. A client that
    leaves a write unread for ``write_timeout_s`` seconds has its connection
    aborted and the jobs cancelled (the response is returned, unfinished).
    """
    response: web.StreamResponse | None = None
    choices = Choices(len(jobs))
    started: set[int] = set()
    encode = S.JSON_ENCODER.encode

    async def send(data: bytes) -> None:
        nonlocal response
        if response is None:
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
        await write_within(request, response, data, write_timeout_s)

    try:
        async with contextlib.aclosing(merged(client, jobs, params)) as items:
            async for job, item in items:
                if isinstance(item, Exception):
                    error = as_api_error(item)
                    if response is None:
                        raise error
                    await send(b"data: " + encode(error.body()) + b"\n\n")
                    break
                choices.add(job, item)
                finish = S.finish_reason(item.finish_reason)
                if not item.text and finish is None and not item.logprobs:
                    continue
                first = job.index not in started
                started.add(job.index)
                made = make_event(job, item, finish, first)
                for body in made if isinstance(made, list) else (made,):
                    await send(b"data: " + encode(body) + b"\n\n")
            else:
                if make_usage is not None:
                    await send(b"data: " + encode(make_usage(choices.usage())) + b"\n\n")
        await send(DONE_EVENT)
    except (ClientStuck, ConnectionError):  # the client is gone: its jobs were cancelled as the stream closed
        return response
    try:
        async with asyncio.timeout(write_timeout_s):
            await response.write_eof()
    except TimeoutError:
        _abort(request, write_timeout_s)
    except ConnectionError:
        pass
    return response


def now_s() -> int:
    return int(time.time())
