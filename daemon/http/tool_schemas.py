"""The JSON schemas a request's tools constrain the output to (``tool_choice`` required or a named function),
and their compile check; the tool-call plan itself is :mod:`ringstream.daemon.http.tools`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ringstream.daemon.common.grammar import check_constraint
from ringstream.ipc import protocol as P

if TYPE_CHECKING:
    from ringstream.daemon.http.tools import FunctionDef

__all__ = ["ToolRequestError", "call_schema", "json_constraint", "parameters", "required_schema"]


class ToolRequestError(ValueError):
    """A request's tools cannot be served: ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def required_schema(defs: list[FunctionDef], parallel: bool, field_tools: str) -> dict:
    """The JSON schema of ``tool_choice`` required: an array of ``{"name", "parameters"}`` calls, each valid
    under its function's schema. Each schema sits under the root's ``$defs`` (as ``fn0``, ``fn1``...) with its
    local ``$ref`` pointers rebased there, so that ``#/$defs/X`` and ``#`` keep naming what they name in it."""
    root_defs: dict = {}
    calls = []
    for i, f in enumerate(defs):
        params = call_schema(f)
        if '"$ref"' in json.dumps(params):
            key = f"fn{i}"
            try:
                root_defs[key] = _rebase_refs(params, f"#/$defs/{key}")
            except RecursionError:
                raise ToolRequestError(f"{field_tools}: the parameters schema of {f.name!r} is nested too deeply",
                                       field_tools) from None
            params = {"$ref": f"#/$defs/{key}"}
        calls.append({"type": "object", "properties": {"name": {"const": f.name}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if root_defs:
        schema["$defs"] = root_defs
    if not parallel:
        schema["maxItems"] = 1
    return schema


_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))
"""Schema keywords whose values are JSON data, not schemas: a ``$ref`` key in them is not a reference."""


def _rebase_refs(node, base: str):
    """``node`` with each local ``$ref`` (``#`` or ``#/...``) rewritten to start at ``base``."""
    if isinstance(node, dict):
        return {key: (base + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                      else value if key in _DATA_KEYWORDS else _rebase_refs(value, base))
                for key, value in node.items()}
    if isinstance(node, list):
        return [_rebase_refs(value, base) for value in node]
    return node


def parameters(f: FunctionDef) -> dict:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


def call_schema(f: FunctionDef) -> dict:
    """The schema a call's arguments are held to: the parameters schema, an object whether or not it says so
    (``{}`` admits a string or number otherwise, and OpenAI's arguments are always an object)."""
    params = parameters(f)
    return params if params.get("type") == "object" else {**params, "type": "object"}


def json_constraint(schema: dict, what: str, param: str) -> P.StructuredOutputs:
    """The constraint of ``schema``, compiled (cached by its text); ToolRequestError naming ``what``."""
    constraint = P.StructuredOutputs(json=json.dumps(schema))
    try:
        check_constraint(constraint)
    except ValueError as exc:
        raise ToolRequestError(f"{what} does not compile: {exc}", param) from None
    return constraint
