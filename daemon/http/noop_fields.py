"""Request fields of other servers and SDKs (vLLM's, vllm-router's, OpenAI's) that the daemon accepts only at
the values that change nothing it serves; :func:`ringstream.daemon.http.openai_schema.decode_request` refuses
the rest, naming the field."""

from __future__ import annotations

__all__ = ["ANY", "NOOP_VALUES"]

ANY = object()
"""In :data:`NOOP_VALUES`: any value is a no-op (a tag that changes no output)."""
NOOP_VALUES: dict[str, tuple] = {
    # vLLM's extensions, at the values that leave the output as the daemon makes it
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "include_stop_str_in_output": (False,),
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "truncate_prompt_tokens": (), "allowed_token_ids": (), "bad_words": ((), []),
    "logits_processors": (), "cache_salt": (), "kv_transfer_params": (), "vllm_xargs": (),
    # what vllm-router's typed requests add (SGLang's names)
    "no_stop_trim": (False,), "return_hidden_states": (False,), "stream_reasoning": (True,),
    "separate_reasoning": (True,), "include_reasoning": (True,), "lora_path": (), "regex": (), "ebnf": (),
    "session_params": (), "continue_final_message": (False,),
    # OpenAI's that do not shape the output, and those that do (served at null only)
    "store": (False,), "metadata": (ANY,), "service_tier": ("auto", "default"), "safety_identifier": (ANY,),
    "prompt_cache_key": (ANY,), "modalities": (["text"],), "reasoning_effort": (), "verbosity": (), "audio": (),
    "prediction": (), "web_search_options": (),
}
"""Fields known to the API whose other values the daemon does not serve: each is accepted null or at one of these
values (the no-op ones: ``skip_special_tokens`` true is what the daemon does; ``ANY``: a tag that changes no
output), else a 400 naming it. Routers (vllm-router re-serialises every chat request with ``no_stop_trim``,
``separate_reasoning``... at their defaults) and SDKs send them; refusing their defaults would break them,
ignoring other values would serve a request the client did not ask for."""
