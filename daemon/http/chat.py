"""A chat request's messages as chat templates read them, and the answer bodies of tool calls
(:mod:`ringstream.daemon.http.tools`' pieces as OpenAI's deltas and messages)."""

from __future__ import annotations

from ringstream.daemon.http import openai_schema as S
from ringstream.daemon.http import responses as R
from ringstream.daemon.http import tools as T

__all__ = ["chat_messages", "tool_delta", "tool_message"]


def chat_messages(req: S.ChatCompletionRequest) -> list[dict]:
    """The messages as the template reads them: content a string (text parts joined); ApiError 400 for others."""
    out = []
    for i, msg in enumerate(req.messages):
        content = msg.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise S.bad_request(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(part.text for part in content)
        role = "tool" if msg.role == "function" else msg.role  # the legacy function result, as templates read it
        item = {"role": role, "content": "" if content is None else content}
        if msg.name is not None:
            item["name"] = msg.name
        calls = T.message_tool_calls(msg.tool_calls if msg.tool_calls is not None else
                                     [{"type": "function", "function": msg.function_call}] if msg.function_call
                                     else None)
        if calls is not None:
            item["tool_calls"] = calls
        if msg.tool_call_id is not None:
            item["tool_call_id"] = msg.tool_call_id
        out.append(item)
    return out


def tool_delta(piece: T.Piece, legacy: bool) -> R.Delta | None:
    """The streamed delta of one piece of a tool-reading answer (None for an empty one)."""
    if piece.call is not None:
        call = piece.call
        function = R.DeltaFunction(call.name, call.arguments)
        if legacy:
            return R.Delta(function_call=function) if call.index == 0 else None
        return R.Delta(tool_calls=[R.DeltaToolCall(call.index, call.id, "function", function)])
    if piece.more_arguments:
        function = R.DeltaFunction(arguments=piece.more_arguments)
        return R.Delta(function_call=function) if legacy else R.Delta(tool_calls=[R.DeltaToolCall(0, function=function)])
    return R.Delta(content=piece.content) if piece.content else None


def tool_message(stream: T.ToolStream, text: str, finish: str | None) -> tuple[R.AssistantMessage, str | None]:
    """A whole answer read for tool calls: its message and finish reason (the stream fed at once)."""
    pieces = stream.feed(text)
    more, finish = stream.finish(finish)
    content = "".join(piece.content for piece in pieces + more)
    calls = [R.ToolCallBody(c.id, R.FunctionCallBody(c.name, c.arguments)) for c in stream.calls]
    message = R.AssistantMessage(content or (None if calls else ""))
    if stream.plan.legacy and calls:
        message.function_call = calls[0].function
    elif calls:
        message.tool_calls = calls
    return message, finish
