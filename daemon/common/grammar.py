"""The grammar text of an output constraint (``StructuredOutputs``), and its check; no torch, no vocabulary.

Shared by the engine (:mod:`ringstream.daemon.engine.structured`, which builds the token matchers) and the HTTP
server (which refuses a constraint that does not compile before the request reaches the daemon). The grammar
engine is llguidance (``guidance-ai/llguidance``): ``grammar_from`` and ``LLMatcher.grammar_from_json_schema``
turn a JSON schema, regex, choice list, Lark or GBNF grammar into its grammar text.
"""

from __future__ import annotations

import functools
import json

from ringstream.ipc.wire import StructuredOutputs

__all__ = ["ERROR_CHARS", "GRAMMAR_CACHE_SIZE", "check_constraint", "grammar_text"]

GRAMMAR_CACHE_SIZE = 256
"""Grammar texts (and check results) kept, by constraint."""
ERROR_CHARS = 500
"""Characters of llguidance's error kept in a refusal (its messages can quote the whole grammar)."""


def grammar_text(constraint: StructuredOutputs) -> str:
    """llguidance's grammar for ``constraint``; ValueError naming the field for one it cannot read.

    JSON (``json``, ``json_object``) is compact (no whitespace between tokens) unless ``whitespace_flexible``:
    llguidance's default lets a model pad with whitespace, which a weak model does until ``max_tokens``.
    """
    kind = constraint.kind
    value = getattr(constraint, kind)
    return _grammar_text(kind, tuple(value) if kind == "choice" else value, constraint.whitespace_flexible)


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _grammar_text(kind: str, value, whitespace_flexible: bool) -> str:
    import llguidance

    try:
        if kind in ("json", "json_object"):
            schema = value if kind == "json" else '{"type": "object"}'
            try:
                parsed = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"not JSON: {exc}") from None
            except RecursionError:
                raise ValueError("the schema is nested too deeply") from None
            if parsed is True:  # JSON Schema's "anything"
                schema = "{}"
            elif parsed is False:
                raise ValueError("the schema false admits no value")
            defaults = {"whitespace_flexible": whitespace_flexible}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        if kind == "regex":
            return llguidance.grammar_from("regex", value)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(value)))
        return llguidance.grammar_from("grammar", value)  # Lark, or GBNF (``::=``)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.{kind}: {exc}") from None


def check_constraint(constraint: StructuredOutputs) -> None:
    """ValueError (llguidance's message, at most ``ERROR_CHARS`` of it) where ``constraint`` does not compile;
    needs no vocabulary. Results are cached by constraint: clients send the same tools with every request."""
    kind = constraint.kind
    value = getattr(constraint, kind)
    error = _check(kind, tuple(value) if kind == "choice" else value, constraint.whitespace_flexible)
    if error:
        raise ValueError(error)


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _check(kind: str, value, whitespace_flexible: bool) -> str | None:
    import llguidance

    try:
        text = _grammar_text(kind, value, whitespace_flexible)
    except ValueError as exc:
        return str(exc)
    error = llguidance.LLMatcher.validate_grammar(text)
    return error[:ERROR_CHARS] if error and not error.startswith("WARNING") else None
