"""Tool calls over the chat API: a request's ``tools`` / ``tool_choice`` (and the legacy ``functions`` /
``function_call``) read into a :class:`ToolPlan`, and the model's output turned into OpenAI's ``tool_calls``.

How each ``tool_choice`` is served (vLLM's scheme, ``vllm/entrypoints/openai/serving_chat.py``):

- ``none``: the tools are rendered into the prompt (the model may know of them) and the output is text.
- ``auto``: the output is free; a parser for the model's call format (:data:`PARSERS`) turns the calls it
  writes into ``tool_calls``. Hermes' format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  NousResearch's Hermes 2 Pro, Qwen 2.5 / 3) and Llama 3.x's JSON format (``{"name": ..., "parameters":
  {...}}``, optionally after ``<|python_tag|>``, calls separated by ``;``) are read; which one is chosen
  from the chat template (:func:`parser_for_template`) or the ``tool_call_parser`` setting.
- ``required``: the output is constrained (llguidance) to a JSON array of ``{"name", "parameters"}`` objects,
  each name one of the tools and its parameters valid under that tool's schema (at most one call when
  ``parallel_tool_calls`` is false), so it always parses.
- a named function: the output is constrained to that function's parameters schema; it is the call's
  ``arguments``. ``finish_reason`` stays ``stop``, as OpenAI's for a forced function.

:class:`ToolStream` reads the output as it arrives, for streaming deltas and whole answers alike (a whole answer
is the stream fed at once), so both give the same calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal, Union
from typing import Annotated

from msgspec import Meta, Struct

from ringstream.daemon.http.tool_schemas import (
    ToolRequestError, call_schema, json_constraint, parameters, required_schema,
)
from ringstream.ipc import protocol as P
from ringstream.ipc.wire import MAX_GRAMMAR_CHARS

__all__ = ["MAX_TOOLS", "PARSERS", "FunctionDef", "NamedToolChoice", "ToolDef", "ToolPlan", "ToolStream",
           "parser_for_template", "plan_tools"]

MAX_TOOLS = 128
"""Most tools (or legacy functions) of one request, OpenAI's limit."""
MAX_TOOL_SCHEMAS_CHARS = 2 * MAX_GRAMMAR_CHARS
"""Most characters of JSON the tools' parameters schemas take together: each is compiled to check it, at a few
milliseconds per KiB (llguidance), so this bounds a request's check at well under a second."""
PARSERS = ("hermes", "llama3_json")
"""The call formats ``auto`` can read (vLLM's ``--tool-call-parser`` names)."""
FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
"""OpenAI's function names: letters, digits, ``_``, ``-`` (and ``.``, which vLLM allows), 1 to 64."""


class FunctionDef(Struct, forbid_unknown_fields=True, kw_only=True):
    """A function the model may call: ``parameters`` is a JSON schema of its arguments (an object)."""

    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(Struct, forbid_unknown_fields=True):
    name: FunctionName


class NamedToolChoice(Struct, forbid_unknown_fields=True, kw_only=True):
    """``{"type": "function", "function": {"name": ...}}``: call this function."""

    type: Literal["function"]
    function: _FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]
FunctionCallChoice = Union[Literal["none", "auto"], _FunctionName]
"""The legacy ``function_call``: ``none``, ``auto`` or ``{"name": ...}``."""


def parser_for_template(source: str | None) -> str | None:
    """The call format a chat template teaches its model, from the markers it renders: ``<tool_call>``
    (Hermes) or ``<|python_tag|>`` / ``ipython`` (Llama 3.x); None when it shows neither."""
    if not source:
        return None
    if "<tool_call>" in source:
        return "hermes"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's tools are served.

    Attributes:
        tools: the tools as the chat template reads them (``[{"type": "function", "function": {...}}]``).
        choice: ``none``, ``auto``, ``required`` or ``named``.
        name: the named function (``choice == "named"``).
        parser: the call format read for ``auto`` (one of :data:`PARSERS`).
        constraint: the output constraint of ``required`` / ``named``.
        legacy: the request used ``functions``; the answer is ``function_call`` (one call), not ``tool_calls``.
    """

    tools: list[dict]
    choice: str
    name: str | None = None
    parser: str | None = None
    constraint: P.StructuredOutputs | None = None
    legacy: bool = False


def plan_tools(tools: list[ToolDef] | None, tool_choice: ToolChoice | None, functions: list[FunctionDef] | None,
               function_call: FunctionCallChoice | None, parallel_tool_calls: bool | None,
               parser: str | None, constrained: bool, parser_off: bool = False) -> ToolPlan | None:
    """The :class:`ToolPlan` of a chat request's tool fields; None when it has no tools (and names none).

    ``parser``: the call format of the served model (:func:`parser_for_template` or the setting), None when
    unknown (``parser_off``: the server's ``tool_call_parser`` is ``none``); ``constrained``: the request has its own output constraint (``response_format``...). Raises
    ToolRequestError for both ``tools`` and ``functions``, a ``tool_choice`` without tools, a named function
    that is not among them, two tools of one name, ``auto`` without a known call format, ``required`` or a
    named function together with another output constraint, and a parameters schema that does not compile.
    """
    legacy = functions is not None or function_call is not None
    if legacy and (tools is not None or tool_choice is not None):
        raise ToolRequestError("give tools / tool_choice or the legacy functions / function_call, not both",
                               "functions")
    field_tools, field_choice = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    if legacy:
        defs = list(functions or ())
        choice = function_call
        if isinstance(choice, _FunctionName):
            choice = NamedToolChoice(type="function", function=choice)
        parallel = False
    else:
        defs = [tool.function for tool in tools or ()]
        choice = tool_choice
        parallel = parallel_tool_calls is not False
    if len(defs) > MAX_TOOLS:
        raise ToolRequestError(f"{len(defs)} {field_tools}; at most {MAX_TOOLS}", field_tools)
    names = [f.name for f in defs]
    if len(set(names)) != len(names):
        raise ToolRequestError(f"two {field_tools} are named {_first_repeat(names)!r}", field_tools)
    if not defs:
        if choice in (None, "none"):
            return None
        raise ToolRequestError(f"{field_choice} needs {field_tools}", field_choice)
    total = 0
    for f in defs:
        if f.parameters is not None and f.parameters.get("type", "object") != "object":
            raise ToolRequestError(f"{field_tools}: the parameters of {f.name!r} must be an object schema",
                                   field_tools)
        size = len(json.dumps(parameters(f)))
        total += size
        if size > MAX_GRAMMAR_CHARS:
            raise ToolRequestError(f"{field_tools}: the parameters schema of {f.name!r} is {size} characters of "
                                   f"JSON; at most {MAX_GRAMMAR_CHARS}", field_tools)
        if total > MAX_TOOL_SCHEMAS_CHARS:  # before compiling: the compile cost grows with the schemas' size
            raise ToolRequestError(f"{field_tools}: the parameters schemas are more than {MAX_TOOL_SCHEMAS_CHARS} "
                                   "characters of JSON together", field_tools)
    for f in defs:
        json_constraint(call_schema(f), f"{field_tools}: the parameters schema of {f.name!r}", field_tools)
    rendered = [{"type": "function", "function": _function_dict(f)} for f in defs]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan(rendered, "none", legacy=legacy)
    if choice == "auto":
        if parser is None:
            why = "this server's tool_call_parser is none" if parser_off else (
                f"the model's chat template shows none; set tool_call_parser ({' or '.join(PARSERS)})")
            raise ToolRequestError(f"{field_choice} auto (the default with {field_tools}) needs the model's tool "
                                   f"call format, and {why}; or ask for {field_choice} none, required or a named "
                                   "function", field_choice)
        return ToolPlan(rendered, "auto", parser=parser, legacy=legacy)
    if constrained:
        raise ToolRequestError(f"{field_choice} {choice if isinstance(choice, str) else 'of a named function'} "
                               "constrains the output itself; it cannot be combined with response_format or "
                               "structured_outputs", field_choice)
    by_name = {f.name: f for f in defs}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in by_name:
            raise ToolRequestError(f"{field_choice} names {name!r}, which is not among the {field_tools} "
                                   f"({', '.join(names)})", field_choice)
        schema = call_schema(by_name[name])
        return ToolPlan(rendered, "named", name=name, legacy=legacy,
                        constraint=json_constraint(schema, f"{field_tools}: the parameters schema of {name!r}",
                                                    field_tools))
    schema = required_schema(defs, parallel, field_tools)
    if len(json.dumps(schema)) > MAX_GRAMMAR_CHARS:
        raise ToolRequestError(f"{field_tools}: tool_choice required constrains the output to a call of any of "
                               f"them, and their schemas together are more than {MAX_GRAMMAR_CHARS} characters of "
                               "JSON; offer fewer, or name one", field_tools)
    return ToolPlan(rendered, "required", legacy=legacy,
                    constraint=json_constraint(schema, f"{field_tools}: the calls' schema", field_tools))


def _first_repeat(names: list[str]) -> str:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return ""


def _function_dict(f: FunctionDef) -> dict:
    out: dict = {"name": f.name}
    if f.description is not None:
        out["description"] = f.description
    out["parameters"] = parameters(f)
    return out


# --------------------------------------------------------------------------
# reading the output


@dataclass
class Call:
    """One tool call as read: its index in the answer, id, function name and arguments (a JSON string)."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass
class Piece:
    """What a stretch of output adds to the answer: text, a new call (whole, or opened with ``arguments``
    still to come in later pieces' ``more_arguments``)."""

    content: str = ""
    call: Call | None = None
    more_arguments: str = ""


def new_call_id() -> str:
    """OpenAI's shape of a call id: ``call_`` and 24 characters."""
    return "call_" + uuid.uuid4().hex[:24]


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolStream:
    """Reads one choice's output under ``plan``: :meth:`feed` each piece of text, :meth:`finish` at the end.

    Text that may still turn out to open a call (a tail that is a prefix of ``<tool_call>``, or a whole
    Llama-format answer, which is a call only if all of it parses) is held back until it is known.
    """

    plan: ToolPlan
    calls: list[Call] = field(default_factory=list)
    _held: str = ""
    _in_call: bool = False
    _decided: bool = False
    """Llama format: whether the answer's first non-space text has been seen (a call starts with it)."""
    _buffering: bool = False
    _space: str = ""
    """Hermes format: white space not sent yet (dropped where it only separates calls)."""

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` completes."""
        choice = self.plan.choice
        if choice == "none" or not text and not self._held:
            return [Piece(text)] if text else []
        if choice == "named":
            if not self.calls:
                self.calls.append(Call(0, new_call_id(), self.plan.name or "", text))
                return [Piece(call=self.calls[0])]
            self.calls[0].arguments += text
            return [Piece(more_arguments=text)]
        if choice == "required":
            self._held += text
            return []
        if self.plan.parser == "llama3_json":
            return self._feed_llama(text)
        return self._feed_hermes(text)

    def finish(self, finish_reason: str | None) -> tuple[list[Piece], str | None]:
        """The pieces still held, and the answer's finish reason: ``tool_calls`` where calls were read from an
        output that ended by itself (``stop``) under ``auto`` or ``required``."""
        pieces: list[Piece] = []
        held, self._held = self._held, ""
        if self.plan.choice == "required":
            calls = _required_calls(held)
            if calls is None:
                pieces.append(Piece(held))
            else:
                pieces += self._add_calls(calls)
        elif self.plan.parser == "llama3_json" and self._buffering:
            calls = self._known(_llama_calls(held))
            pieces += [Piece(held)] if calls is None else self._add_calls(calls)
        elif self._in_call:  # ended before </tool_call>: a call if what came parses
            calls = self._known(_hermes_call(held))
            pieces += [Piece(_HERMES_OPEN + held)] if calls is None else self._add_calls(calls)
        elif held:
            pieces.append(Piece(held))
        if self._space and not self.calls:
            pieces.insert(0, Piece(self._space))
        self._space = ""
        if self.calls and finish_reason == "stop" and self.plan.choice in ("auto", "required"):
            finish_reason = "function_call" if self.plan.legacy else "tool_calls"
        return pieces, finish_reason

    def _known(self, calls: list[tuple[str, str]] | None) -> list[tuple[str, str]] | None:
        """``calls`` if each names one of the request's tools, else None (a call to a tool not offered stays text:
        a client dispatching by name has nothing to run it with)."""
        names = {tool["function"]["name"] for tool in self.plan.tools}
        return calls if calls is not None and all(name in names for name, _ in calls) else None

    def _add_calls(self, calls: list[tuple[str, str]]) -> list[Piece]:
        pieces = []
        for name, arguments in calls:
            call = Call(len(self.calls), new_call_id(), name, arguments)
            self.calls.append(call)
            pieces.append(Piece(call=call))
        return pieces

    def _feed_hermes(self, text: str) -> list[Piece]:
        pieces: list[Piece] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._in_call:
                end = buf.find(_HERMES_CLOSE)
                if end < 0:
                    self._held = buf
                    return pieces
                calls = self._known(_hermes_call(buf[:end]))
                pieces += [Piece(_HERMES_OPEN + buf[:end + len(_HERMES_CLOSE)])] if calls is None \
                    else self._add_calls(calls)
                self._in_call = False
                buf = buf[end + len(_HERMES_CLOSE):]
                continue
            start = buf.find(_HERMES_OPEN)
            if start >= 0:
                before, buf = buf[:start], buf[start + len(_HERMES_OPEN):]
                pieces += self._text(before)
                self._space, self._in_call = "", True
                continue
            keep = _partial_suffix(buf, _HERMES_OPEN)
            out, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
            return pieces + self._text(out)
        return pieces

    def _text(self, text: str) -> list[Piece]:
        """Text outside calls: trailing white space is held until text follows it (or the answer ends without a
        call), so that content does not depend on where the stream split."""
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        body, self._space = self._space + body, text[len(body):]
        return [Piece(body)]

    def _feed_llama(self, text: str) -> list[Piece]:
        if self._buffering:
            self._held += text
            return []
        if self._decided:
            return [Piece(text)]
        buf = self._held + text
        stripped = buf.lstrip()
        if not stripped:
            self._held = buf
            return []
        if stripped.startswith("{") or stripped.startswith(_PYTHON_TAG) or _PYTHON_TAG.startswith(stripped):
            self._buffering, self._held = True, buf
            return []
        self._decided, self._held = True, ""
        return [Piece(buf)]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _arguments(value) -> str | None:
    """A call's arguments as OpenAI sends them: a JSON string of an object (a string holding one is kept)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _hermes_call(body: str) -> list[tuple[str, str]] | None:
    """The call of one ``<tool_call>`` body (``{"name": ..., "arguments": {...}}``), or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = _arguments(obj.get("arguments", obj.get("parameters", {})))
    return None if arguments is None else [(obj["name"], arguments)]


def _llama_calls(text: str) -> list[tuple[str, str]] | None:
    """Llama 3.x's calls: ``{"name": ..., "parameters": {...}}`` objects separated by ``;`` (the whole text),
    optionally after ``<|python_tag|>``; None unless all of it parses."""
    text = text.strip().removeprefix(_PYTHON_TAG).strip()
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = _arguments(obj.get("parameters", obj.get("arguments", {})))
        if arguments is None:
            return None
        calls.append((obj["name"], arguments))
        rest = text[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        pos = len(text) - len(rest)
    return calls or None


def _required_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a ``required`` answer (a JSON array of ``{"name", "parameters"}``), or None."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = _arguments(item.get("parameters", {}))
        if arguments is None:
            return None
        calls.append((item["name"], arguments))
    return calls



def message_tool_calls(value) -> list[dict] | None:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's ``arguments`` a dict
    where it is a JSON string of one (vLLM's reading, as Hermes / Llama templates iterate them), also under
    ``function`` (``tool_call.function.arguments``) where templates look."""
    if not isinstance(value, list):
        return None
    out = []
    for call in value:
        if not isinstance(call, dict):
            continue
        call = dict(call)
        function = call.get("function")
        if isinstance(function, dict):
            function = dict(function)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    function["arguments"] = parsed
            call["function"] = function
        out.append(call)
    return out

