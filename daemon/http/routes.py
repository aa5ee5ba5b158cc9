"""The OpenAI-compatible API's aiohttp application: endpoints, errors and authentication over one daemon client.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` (and ``/v1/models/{name}``), ``GET /health``, ``GET /metrics``
(the daemon's Prometheus exposition, fetched over its socket per scrape). Requests
reach the daemon through one shared :class:`~ringstream.ipc.client.AsyncClient`,
so they are scheduled like any other client's (``priority`` is an extension
field). Every error is answered with OpenAI's error body. The server process
around it is :mod:`ringstream.daemon.http.server`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

from ringstream.daemon.http import constraints as C
from ringstream.daemon.http.chat import chat_messages, tool_delta, tool_message
from ringstream.daemon.http import generation as G
from ringstream.daemon.http import logprobs as L
from ringstream.daemon.http import openai_schema as S
from ringstream.daemon.http import responses as R
from ringstream.daemon.http import tools as T
from ringstream.daemon.common.chat_template import ChatTemplate, ChatTemplateError, render_chat_prompt
from ringstream.daemon.common.model_dir import model_name
from ringstream.daemon.http.options import BODY_TIMEOUT_S, MAX_BODY_BYTES, WRITE_TIMEOUT_S
from ringstream.ipc import protocol as P
from ringstream.ipc.client import AsyncClient
from ringstream.ipc.errors import InvalidRequest, RingstreamError

log = logging.getLogger("ringstream.http")

"""Largest request body, bytes; a larger one gets 413."""
STATUS_TIMEOUT_S = 2.0
"""How long ``/health`` and the model lookup wait for the daemon's status, seconds."""
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format."""
OPEN_PATHS = ("/health", "/metrics", "/get_load")
"""Paths served without the API key (health checkers, scrapers and a router polling load figures)."""
LONG_PROMPT_CHARS = 8192
"""A rendered chat prompt this long or longer is tokenised on a thread, off the event loop."""
CLOSING_STATUSES = frozenset({408, 413})
"""Errors answered before the body was read whole: the connection is closed after them."""


async def daemon_status(client: AsyncClient) -> P.StatusReply:
    """The daemon's status; ApiError 503 ``daemon_unavailable`` when it does not answer within
    :data:`STATUS_TIMEOUT_S`."""
    try:
        return await asyncio.wait_for(client.status(), STATUS_TIMEOUT_S)
    except (RingstreamError, TimeoutError) as exc:
        raise S.unavailable(f"the inference daemon is unavailable: {exc or 'no answer'}",
                            "daemon_unavailable") from None


def authorized(header: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <api_key>``, compared in constant time."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


@dataclass
class ServedModel:
    """What the daemon serves, as the API names it."""

    name: str
    path: str
    max_model_len: int | None
    chat_template: ChatTemplate | None
    template_error: str | None = None
    """Why the chat template could not be loaded (it then stays None)."""
    daemon_renders_chat: bool = False
    """The daemon takes ``messages`` and renders them with the model's template itself."""

    @property
    def root(self) -> str:
        """The model as its user named it (``root`` of ``/v1/models``, as vLLM reports it): the hub id
        ``org/name`` of a Hugging Face cache snapshot, else the model directory."""
        hub = model_name(self.path)
        return hub if hub != Path(self.path).name else self.path


class HttpApi:
    """The aiohttp application's handlers over one daemon client.

    Args:
        client: connected to the daemon (the caller owns and closes it).
        model_name: the name clients use (default: the model directory's name, from the daemon's status).
        api_key: required bearer token, or None.
        chat_template: a template file overriding the model's own.
        max_body_bytes: largest request body, bytes (413 beyond).
        body_timeout_s: most time a body may take to arrive, seconds (408 beyond).
        write_timeout_s: most time a write may wait for a client that does not read, seconds; then the
            connection is aborted and its daemon requests cancelled.
        tool_call_parser: the call format ``tool_choice`` auto reads (``hermes``, ``llama3_json``); ``auto``: the
            one the chat template shows; ``none``: auto tool choice is refused.
        unknown_fields: ``error`` answers a request field the API does not know with 400 naming it (OpenAI's
            behaviour); ``warn`` logs it and serves the request (vLLM's).
    """

    def __init__(self, client: AsyncClient, *, model_name: str | None = None, api_key: str | None = None,
                 chat_template: str | Path | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 body_timeout_s: float = BODY_TIMEOUT_S, write_timeout_s: float = WRITE_TIMEOUT_S,
                 tool_call_parser: str = "auto", unknown_fields: str = "error") -> None:
        self.client = client
        self.tool_call_parser = tool_call_parser
        self.unknown_fields = unknown_fields
        self.body_timeout_s = body_timeout_s
        self.write_timeout_s = write_timeout_s
        self.model_name = model_name
        self.api_key = api_key
        self.chat_template_path = chat_template
        self._model: ServedModel | None = None
        self._tokenizer = None
        self._names: L.TokenStrings | None = None
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[self._errors, self._auth])
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{name:.+}", self.model),
            web.get("/health", self.health),
            web.get("/get_load", self.get_load),
            web.get("/metrics", self.metrics),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/version", self.version),
        ])

    # -- middlewares ------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        try:
            return await handler(request)
        except S.ApiError as exc:
            return _error(exc)
        except web.HTTPException as exc:  # aiohttp's own: 404 no route, 405, 413 body too large
            if exc.status < 400:
                raise
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            return _error(S.ApiError(exc.status, exc.text or exc.reason, kind))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            err = S.ApiError(500, "internal error", "server_error")
            return web.json_response(err.body(), status=500)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key is not None and request.path not in OPEN_PATHS \
                and not authorized(request.headers.get("Authorization"), self.api_key):
            raise S.ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                             "authentication_error", None, "invalid_api_key")
        return await handler(request)

    # -- the served model ---------------------------------------------------------------------

    async def served_model(self) -> ServedModel:
        """The served model, from the daemon's status on first use; ApiError 503 while it cannot be asked."""
        if self._model is not None:
            return self._model
        status = await daemon_status(self.client)
        if not status.model:
            raise S.unavailable("the inference daemon has not loaded its model yet", "starting")
        lens = [w.max_model_len for w in status.workers if w.max_model_len]
        template, error = None, None
        try:
            template = ChatTemplate.from_model_dir(status.model, self.chat_template_path)
        except (ChatTemplateError, OSError) as exc:
            error = str(exc)
            log.warning("chat template: %s", exc)
        served = ServedModel(self.model_name or model_name(status.model), status.model,
                             min(lens) if lens else None, template, error, status.accepts_messages)
        if not lens and not status.ready:  # before the first worker is ready: a client retries after the load
            raise S.unavailable("the inference daemon is starting: its workers are loading the model",
                                "starting")
        if lens:  # kept once a worker has reported its context length (before that, asked again next time)
            self._model = served
        return served

    async def _check_model(self, requested: str | None) -> ServedModel:
        served = await self.served_model()
        if requested and requested not in (served.name, served.path, served.root):
            raise S.ApiError(404, f"the model {requested!r} does not exist; this server serves {served.name!r}",
                             "invalid_request_error", "model", "model_not_found")
        return served

    async def _tokens(self, served: ServedModel, text: str) -> list[int]:
        """Token ids of a rendered chat prompt, special tokens not added (the template holds them).

        A long prompt is tokenised on a thread (``tokenizers`` releases the GIL), so that other streams go on.
        """
        self._load_tokenizer(served)
        if len(text) < LONG_PROMPT_CHARS:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        return (await asyncio.to_thread(self._tokenizer.encode_batch, [text], add_special_tokens=False))[0].ids

    def _load_tokenizer(self, served: ServedModel):
        """The model's tokenizer, loaded on first use; ApiError 500 when it cannot be."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer  # no torch: only the tokenizer's own library
            try:
                self._tokenizer = Tokenizer.from_file(str(Path(served.path) / "tokenizer.json"))
            except Exception as exc:  # tokenizers raises plain Exception subclasses
                raise S.ApiError(500, f"cannot load the model's tokenizer: {exc}", "server_error") from None
            self._names = L.TokenStrings(self._tokenizer)
        return self._tokenizer

    def _token_strings(self, served: ServedModel) -> L.TokenStrings:
        """Token strings for logprobs, from this process's tokenizer (the front spends nothing on them)."""
        self._load_tokenizer(served)
        return self._names

    # -- endpoints ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 ``{"status": "serving"}`` when the daemon serves with a live worker, else 503 with its state."""
        try:
            status = await asyncio.wait_for(self.client.status(), STATUS_TIMEOUT_S)
        except (RingstreamError, TimeoutError) as exc:
            return web.json_response({"status": "unavailable", "message": str(exc) or "no answer"}, status=503,
                                     headers={"Retry-After": str(S.RETRY_AFTER_S)})
        live = sum(w.alive for w in status.workers)
        ok = status.ready and status.state == "serving" and live > 0
        state = "no_live_worker" if status.state == "serving" and not live else status.state
        body = {"status": state, "workers_alive": live}
        return web.json_response(body, status=200 if ok else 503,
                                 headers=None if ok else {"Retry-After": str(S.RETRY_AFTER_S)})

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang's ``/get_load``, which vllm-router's load-aware policies (``power_of_two``) poll: ``{"load"}``,
        the requests the daemon holds (waiting in its queue or computing), with ``num_reqs`` (computing) and
        ``num_waiting_reqs`` (waiting) beside it; 503 while the daemon cannot be asked."""
        status = await daemon_status(self.client)
        return web.json_response({"load": status.waiting + status.running, "num_reqs": status.running,
                                  "num_waiting_reqs": status.waiting})

    async def metrics(self, request: web.Request) -> web.Response:
        """The daemon's Prometheus exposition; 503 while the daemon cannot be asked, 501 from one too old."""
        try:
            text = await asyncio.wait_for(self.client.metrics(), STATUS_TIMEOUT_S)
        except InvalidRequest:
            raise S.ApiError(501, "the inference daemon does not serve metrics (it is older than this server)",
                             "server_error") from None
        except (RingstreamError, TimeoutError) as exc:
            raise S.unavailable(f"the inference daemon is unavailable: {exc or 'no answer'}",
                                "daemon_unavailable") from None
        return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: the token ids the daemon would read for a prompt, or for a chat's messages."""
        req = S.decode_body(await self._body(request), S.TokenizeRequest)
        served = await self._check_model(req.model)
        tokenizer = self._load_tokenizer(served)
        if (req.prompt is None) == (req.messages is None):
            raise S.bad_request("give prompt or messages, one of them", "prompt")
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            text = req.prompt
        else:
            if served.chat_template is None:
                raise S.bad_request(served.template_error or "the model has no chat template", "messages",
                                    "chat_template_error")
            try:
                text = render_chat_prompt(served.chat_template, chat_messages(req), req.add_generation_prompt,
                                          req.chat_template_kwargs)
            except ChatTemplateError as exc:
                raise S.bad_request(str(exc), "messages", "chat_template_error") from None
            add_special = bool(req.add_special_tokens)
        encoding = (await asyncio.to_thread(tokenizer.encode_batch, [text], add_special_tokens=add_special))[0]
        ids = encoding.ids
        strs = [tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
        return _json(S.TokenizeResponse(count=len(ids), max_model_len=served.max_model_len, tokens=ids,
                                        token_strs=strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: ``{"prompt": text}`` of ``tokens`` (special tokens kept, as vLLM's)."""
        req = S.decode_body(await self._body(request), S.DetokenizeRequest)
        served = await self._check_model(req.model)
        tokenizer = self._load_tokenizer(served)
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if any(t >= vocab for t in req.tokens):
            raise S.bad_request(f"tokens: token id {max(req.tokens)} is outside the vocabulary of {vocab}", "tokens")
        return web.json_response({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})

    async def version(self, request: web.Request) -> web.Response:
        """``{"version": ...}``: this server's (ringstream's) version, as vLLM's ``/version`` gives its own."""
        from ringstream import __version__

        return web.json_response({"version": __version__})

    def _card(self, served: ServedModel) -> R.ModelCard:
        return R.ModelCard(id=served.name, created=G.now_s(), root=served.root, max_model_len=served.max_model_len)

    async def models(self, request: web.Request) -> web.Response:
        served = await self.served_model()
        return _json(R.ModelList([self._card(served)]))

    async def model(self, request: web.Request) -> web.Response:
        served = await self._check_model(request.match_info["name"])
        return _json(self._card(served))

    async def _body(self, request: web.Request) -> bytes:
        """The whole request body; ApiError 408 when it takes over ``body_timeout_s`` (413 from aiohttp when
        it exceeds ``max_body_bytes``)."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await request.read()
        except TimeoutError:
            raise S.ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                             "invalid_request_error", None, "body_timeout") from None

    @staticmethod
    async def _constraint(req):
        """The request's output constraint, checked on a thread: compiling a large schema takes milliseconds to
        seconds, which would stall every other connection on the event loop."""
        if not C.has_constraint(req):
            return None
        return await asyncio.get_running_loop().run_in_executor(None, C.structured_outputs_of, req)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = S.decode_request(await self._body(request), S.CompletionRequest, self.unknown_fields)
        prompts = S.completion_prompts(req)
        served = await self._check_model(req.model)
        jobs = G.jobs_of(prompts, req.n or 1)
        params = S.generate_params(req, req.max_tokens, bool(req.stream), await self._constraint(req))
        rid, created = G.new_id("cmpl"), G.now_s()
        asked = req.logprobs is not None
        names = self._token_strings(served) if asked or (req.echo and any(isinstance(p, list) for p in prompts)) \
            else None

        def echoed(job: G.Job) -> str:
            return "" if not req.echo else job.prompt if isinstance(job.prompt, str) else names.decode(job.prompt)

        offsets: dict[int, int] = {}

        def logprobs(index: int, ids: list[int], entries: list) -> R.CompletionLogprobs:
            body = L.completion_logprobs(entries, ids, names, offsets.get(index, 0))
            if body.tokens:
                offsets[index] = body.text_offset[-1] + len(body.tokens[-1])
            return body

        def event(job: G.Job, chunk: P.Chunk, finish: str | None, first: bool) -> R.CompletionBody:
            text, body = chunk.text, None
            if first:
                text = echoed(job) + text
            if asked:
                ids, entries = list(chunk.token_ids), list(chunk.logprobs or ())
                if req.echo and chunk.prompt_logprobs is not None:
                    ids, entries = (chunk.prompt_token_ids or []) + ids, chunk.prompt_logprobs + entries
                body = logprobs(job.index, ids, entries)
            return R.CompletionBody(rid, created, served.name, [R.CompletionChoice(job.index, text, finish, body)])

        if req.stream:
            usage = (lambda u: R.CompletionBody(rid, created, served.name, [], usage=u)) \
                if req.stream_options is not None and req.stream_options.include_usage else None
            return await G.stream_sse(request, self.client, jobs, params, event, usage, self.write_timeout_s)
        got = await G.gather(self.client, jobs, params)
        choices = []
        for job in jobs:
            i, body = job.index, None
            if asked:
                prompt_ids, prompt_entries = got.prompt_logprobs.get(i, ([], [])) if req.echo else ([], [])
                body = logprobs(i, prompt_ids + got.token_ids.get(i, []),
                                list(prompt_entries) + got.logprobs.get(i, []))
            choices.append(R.CompletionChoice(i, echoed(job) + got.text(i), got.finish.get(i), body))
        return await G.send_json(request, R.CompletionBody(rid, created, served.name, choices, usage=got.usage()),
                                 self.write_timeout_s)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = S.decode_request(await self._body(request), S.ChatCompletionRequest, self.unknown_fields)
        served = await self._check_model(req.model)
        if served.chat_template is None and served.template_error is not None:
            raise S.bad_request(served.template_error, "messages", "chat_template_error")
        max_tokens = req.max_completion_tokens or req.max_tokens
        constraint = await self._constraint(req)
        plan = await self._tool_plan(served, req, constraint is not None)
        if plan is not None and plan.constraint is not None:
            constraint = plan.constraint
        if plan is None and self._daemon_renders(served, req, max_tokens):
            prompt = tuple(chat_messages(req))  # G.Job: a tuple of messages, rendered and tokenised by the daemon
        else:
            prompt, max_tokens = await self._render(served, req, max_tokens, plan)
        jobs = G.jobs_of([prompt], req.n or 1)
        params = S.generate_params(req, max_tokens, bool(req.stream), constraint)
        rid, created = G.new_id("chatcmpl"), G.now_s()

        names = self._token_strings(served) if req.logprobs else None
        streams = {} if plan is None else {job.index: T.ToolStream(plan) for job in jobs}
        roled: set[int] = set()

        def body(job: G.Job, delta: R.Delta, finish: str | None, logprobs) -> R.ChatChunkBody:
            if job.index not in roled:
                roled.add(job.index)
                delta.role = "assistant"
            return R.ChatChunkBody(rid, created, served.name, [R.ChatChunkChoice(job.index, delta, finish, logprobs)])

        def event(job: G.Job, chunk: P.Chunk, finish: str | None, first: bool) -> list[R.ChatChunkBody]:
            logprobs = L.chat_logprobs(chunk.logprobs or [], names) if names is not None else None
            stream = streams.get(job.index)
            if stream is None:
                return [body(job, R.Delta(content=chunk.text or (None if job.index in roled else "")), finish,
                             logprobs)]
            pieces = stream.feed(chunk.text)
            if finish is not None:
                more, finish = stream.finish(finish)
                pieces += more
            deltas = [tool_delta(piece, plan.legacy) for piece in pieces]
            deltas = [d for d in deltas if d is not None]
            if not deltas and (finish is not None or logprobs is not None):
                deltas = [R.Delta()]
            return [body(job, delta, finish if i == len(deltas) - 1 else None, logprobs if i == 0 else None)
                    for i, delta in enumerate(deltas)]

        if req.stream:
            usage = (lambda u: R.ChatChunkBody(rid, created, served.name, [], usage=u)) \
                if req.stream_options is not None and req.stream_options.include_usage else None
            return await G.stream_sse(request, self.client, jobs, params, event, usage, self.write_timeout_s)
        got = await G.gather(self.client, jobs, params)
        choices = []
        for i in range(len(jobs)):
            message, finish = R.AssistantMessage(got.text(i)), got.finish.get(i)
            if plan is not None:
                message, finish = tool_message(T.ToolStream(plan), got.text(i), finish)
            choices.append(R.ChatChoice(i, message, finish, L.chat_logprobs(got.logprobs.get(i, []), names)
                                        if names is not None else None))
        return await G.send_json(request, R.ChatCompletionBody(rid, created, served.name, choices, got.usage()),
                                 self.write_timeout_s)

    async def _tool_plan(self, served: ServedModel, req: S.ChatCompletionRequest,
                         constrained: bool) -> T.ToolPlan | None:
        """The request's :class:`~ringstream.daemon.http.tools.ToolPlan` (None without tools); the
        parameters schemas of ``required`` / named calls compile on a thread. ApiError 400 naming the field."""
        if req.tools is None and req.functions is None and req.tool_choice is None and req.function_call is None:
            return None
        parser = self.tool_call_parser
        if parser == "auto":
            parser = T.parser_for_template(served.chat_template.source if served.chat_template else None)
        elif parser == "none":
            parser = None
        try:
            return await asyncio.get_running_loop().run_in_executor(None, functools.partial(
                T.plan_tools, req.tools, req.tool_choice, req.functions, req.function_call,
                req.parallel_tool_calls, parser, constrained, self.tool_call_parser == "none"))
        except T.ToolRequestError as exc:
            raise S.bad_request(str(exc), exc.param) from None

    def _daemon_renders(self, served: ServedModel, req: S.ChatCompletionRequest, max_tokens: int | None) -> bool:
        """Whether the daemon can render this chat as this server would: it takes ``messages``, with the model's
        own template (no ``--chat-template``), no ``chat_template_kwargs``, the generation prompt, and a
        ``max_tokens`` given (the rest of the context needs the prompt's token count here)."""
        return (served.daemon_renders_chat and served.chat_template is not None and self.chat_template_path is None
                and not req.chat_template_kwargs and req.add_generation_prompt and max_tokens is not None
                and not any(m.tool_calls is not None or m.function_call is not None or m.tool_call_id is not None
                            for m in req.messages))

    async def _render(self, served: ServedModel, req: S.ChatCompletionRequest, max_tokens: int | None,
                      plan: T.ToolPlan | None = None) -> tuple[list[int], int | None]:
        """The chat's token ids, rendered and tokenised here (``plan``'s tools handed to the template as
        transformers does, its ``tools`` variable), and ``max_tokens`` (None: the rest of the context)."""
        extra = dict(req.chat_template_kwargs or {})
        if plan is not None:
            extra["tools"] = plan.tools
        try:
            text = render_chat_prompt(served.chat_template, chat_messages(req), req.add_generation_prompt, extra)
        except ChatTemplateError as exc:
            raise S.bad_request(str(exc), "messages", "chat_template_error") from None
        ids = await self._tokens(served, text)
        if not ids:
            raise S.bad_request("the rendered chat prompt is empty", "messages")
        if max_tokens is None and served.max_model_len is not None:
            max_tokens = served.max_model_len - len(ids)
            if max_tokens < 1:
                raise S.bad_request(f"the messages are {len(ids)} tokens; the model's context is "
                                    f"{served.max_model_len}", "messages", "context_length_exceeded")
        return ids, max_tokens


def _json(body) -> web.Response:
    return web.Response(body=S.JSON_ENCODER.encode(body), content_type="application/json")


def _error(exc: S.ApiError) -> web.Response:
    response = web.json_response(exc.body(), status=exc.status, headers=exc.headers())
    if exc.status in CLOSING_STATUSES:
        response.force_close()
    return response
