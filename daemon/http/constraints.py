"""The output constraint of an OpenAI request: ``response_format``, vLLM's ``structured_outputs`` or its older
``guided_*`` fields, read into the wire's :class:`ringstream.ipc.protocol.StructuredOutputs` and checked (the
grammar compiled by llguidance, no vocabulary needed) before the request reaches the daemon."""

from __future__ import annotations

import json

import msgspec

from ringstream.daemon.http import openai_schema as S
from ringstream.ipc import protocol as P

__all__ = ["has_constraint", "structured_outputs_of"]


def has_constraint(req: S._Sampling) -> bool:
    """Whether ``req`` names an output constraint (:func:`structured_outputs_of` then has work to do)."""
    return any(getattr(req, name) is not None for name in (
        "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"))


_STRUCTURED_KEYS = frozenset(("json", "regex", "choice", "grammar", "json_object", "whitespace_flexible"))


def structured_outputs_of(req: S._Sampling) -> P.StructuredOutputs | None:
    """The output constraint of ``req``, from ``response_format``, ``structured_outputs`` or vLLM's
    ``guided_*`` fields (one of them), checked: ApiError 400 naming the field for a malformed one, for several,
    and for a schema, regex or grammar that does not compile (llguidance's message)."""
    given: list[tuple[str, P.StructuredOutputs]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            given.append(("response_format", P.StructuredOutputs(json_object=True)))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise S.bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                                  "response_format")
            given.append(("response_format", _structured({"json": json.dumps(schema)}, "response_format")))
        elif kind != "text":
            raise S.bad_request('response_format.type must be "text", "json_object" or "json_schema"',
                              "response_format")
    so = req.structured_outputs
    if so is not None:
        if not isinstance(so, dict) or not so.keys() <= _STRUCTURED_KEYS:
            raise S.bad_request(f"structured_outputs must be an object of {', '.join(sorted(_STRUCTURED_KEYS))}",
                              "structured_outputs")
        fields = dict(so)
        if isinstance(fields.get("json"), (dict, bool)):
            fields["json"] = json.dumps(fields["json"])
        given.append(("structured_outputs", _structured(fields, "structured_outputs")))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            if key == "json" and not isinstance(value, str):
                value = json.dumps(value)
            given.append((name, _structured({key: value}, name)))
    if not given:
        return None
    if len(given) > 1:
        raise S.bad_request(f"give one output constraint, not {' and '.join(name for name, _ in given)}",
                          given[1][0])
    name, constraint = given[0]
    try:
        from ringstream.daemon.common.grammar import check_constraint

        check_constraint(constraint)
    except ValueError as exc:
        raise S.bad_request(f"{name}: {exc}", name) from None
    return constraint


def _structured(fields: dict, name: str) -> P.StructuredOutputs:
    try:  # built by keyword, then checked against the wire's types and limits (its array form)
        constraint = P.StructuredOutputs(**fields)
        msgspec.convert(msgspec.to_builtins(constraint), P.StructuredOutputs)
        constraint.kind  # exactly one
    except (msgspec.ValidationError, ValueError) as exc:
        message = str(exc).removeprefix("structured_outputs: ")  # the wire's own wording names the field too
        raise S.bad_request(f"{name}: {message}", name) from None
    return constraint
