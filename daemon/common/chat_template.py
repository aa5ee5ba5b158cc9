"""Chat templates: render a model's Jinja chat template into the prompt text, without torch or transformers.

A Hugging Face model directory carries its template in ``chat_template.jinja``
or in ``tokenizer_config.json`` (``chat_template``: a string, or a list of
``{"name", "template"}`` of which ``default`` is used), beside ``bos_token``
and ``eos_token``. It is rendered as transformers' ``apply_chat_template``
does (``transformers/utils/chat_template_utils.py``): a sandboxed, immutable
Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block that renders its
body, ``raise_exception``, ``strftime_now`` and a ``tojson`` filter that does
not escape HTML. Templates from a model directory are untrusted code: the
sandbox keeps them from reaching Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplateError(Exception):
    """The model has no chat template, or its template failed on these messages (a 400 for the client)."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant tokens with it; rendered as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(token: Any) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with ``content``."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return "" if token is None else str(token)


class ChatTemplate:
    """A compiled chat template and the special tokens it may name.

    Raises ChatTemplateError from the constructor for a template that does not compile.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None
        self.source = source
        """The template's text (what the HTTP server reads a tool call format from)."""
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, override: str | Path | None = None) -> "ChatTemplate | None":
        """The template of a Hugging Face model directory, or None when it has none.

        ``override``: a template file to use instead of the model's (its special
        tokens still come from the model's ``tokenizer_config.json``). Raises
        ChatTemplateError for a template that does not compile, OSError for an
        unreadable override.
        """
        model_dir = Path(model_dir)
        config: dict = {}
        try:
            config = json.loads((model_dir / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        source: Any
        if override is not None:
            source = Path(override).read_text(encoding="utf-8")
        elif (model_dir / TEMPLATE_FILE).is_file():
            source = (model_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
        else:
            source = config.get("chat_template")
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}]``).

        ``extra`` adds template variables (``chat_template_kwargs``); the
        messages, special tokens and ``add_generation_prompt`` win over it.
        Raises ChatTemplateError when the template raises (``raise_exception``,
        e.g. roles out of order) or fails.
        """
        variables = dict(extra or {})
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt,
                         bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") \
                from None


def render_chat_prompt(template: ChatTemplate | None, messages: list[dict], add_generation_prompt: bool = True,
                       extra: dict[str, Any] | None = None) -> str:
    """The prompt text of ``messages`` under ``template``; ChatTemplateError when the model has none."""
    if template is None:
        raise ChatTemplateError("the model has no chat template (no chat_template in its tokenizer_config.json "
                                "or chat_template.jinja); use /v1/completions, or give the server --chat-template")
    return template.render(messages, add_generation_prompt, extra)
