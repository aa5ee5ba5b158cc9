"""Structured outputs: the token mask of a request's constraint (JSON schema, regex, choice, grammar).

Each constrained sequence holds an ``llguidance.LLMatcher`` (Microsoft's llguidance: an Earley parser over a
lexer, whose token masks are computed lazily per step in tens of microseconds; what vLLM and SGLang offer as
their ``guidance`` backend). At each step the model runner asks every constrained row's matcher for the bitmask
of the tokens allowed next and sets the others' logits to ``-inf`` before greedy argmax or sampling; the sampled
token is then fed to the matcher, and the stream ends with ``stop`` when the constraint is complete.

Why llguidance and not xgrammar (vLLM's default): its wheel has no dependencies (xgrammar's pulls in triton and
a tensor-FFI runtime), it builds masks without a per-schema compile step (a matcher for a typical schema is
ready in under a millisecond), and it reads JSON schema, regex, Lark and GBNF grammars natively.

Matchers are built off the step loop (:meth:`GrammarCompiler.submit`, one thread per engine; llguidance
releases the GIL while it compiles): a large schema's lexer can take tens of milliseconds to seconds, and the
other streams keep stepping meanwhile. A constrained request is scheduled once its matcher is ready.

The grammar text of each constraint is kept (:func:`ringstream.daemon.common.grammar.grammar_text`, an LRU),
so a repeated schema costs only its matcher. A constraint llguidance cannot compile raises ValueError naming the field, which
the worker answers with ``INVALID_REQUEST`` before anything is scheduled. Limits: the wire's
``MAX_GRAMMAR_CHARS`` (64 KiB of schema, regex or grammar text) and llguidance's default parser limits (a
grammar whose lexer or parser would exceed them fails to compile, or ends its stream with ``error``).

Sources: llguidance (``guidance-ai/llguidance``: ``LLMatcher``, ``grammar_from``, the bitmask layout of
``llguidance.torch``); vLLM ``vllm/v1/structured_output/backend_guidance.py``.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import torch

from ringstream.daemon.common.grammar import ERROR_CHARS, grammar_text
from ringstream.ipc.wire import StructuredOutputs

__all__ = ["GrammarCompiler", "apply_bitmask", "token_bitmask"]


class GrammarCompiler:
    """Matchers for one model's vocabulary.

    Args:
        tokenizer: the model's ``tokenizers.Tokenizer``.
        vocab_size: width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_id: the token that ends a complete constraint's output.

    llguidance's view of the vocabulary (every token's bytes, ~20 ms for 32k tokens) is built on first use,
    once per engine.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf
                from transformers import PreTrainedTokenizerFast

                fast = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
                self._ll_tokenizer = llguidance.hf.from_tokenizer(fast, n_vocab=self.vocab_size,
                                                                  eos_token=self.eos_token_id)
            return self._ll_tokenizer

    def submit(self, constraint: StructuredOutputs, output_token_ids: list[int] = ()) -> Future:
        """:meth:`matcher` on the compile thread (a daemon thread, so a compile still running never holds up
        the process' exit): a Future of the matcher, or of its ValueError. A cancelled Future is skipped."""
        future: Future = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._compile_loop, name="grammar", daemon=True)
                self._thread.start()
        self._jobs.put((future, constraint, list(output_token_ids)))
        return future

    def _compile_loop(self) -> None:
        while True:
            future, constraint, output = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.matcher(constraint, output))
            except BaseException as exc:  # handed to the step loop, which ends the request with it
                future.set_exception(exc)

    def precheck(self, constraint: StructuredOutputs) -> None:
        """What can be refused at once, without compiling: ValueError for a constraint that names no kind or
        several, and for a model without an EOS token."""
        constraint.kind  # exactly one
        if self.eos_token_id is None:
            raise ValueError("structured_outputs: this model has no EOS token to end a constrained output")

    def matcher(self, constraint: StructuredOutputs, output_token_ids: list[int] = ()):
        """A matcher for ``constraint`` that has consumed ``output_token_ids`` (a resumed request's); ValueError
        naming the field for a constraint that does not compile, or for output that does not meet it."""
        import llguidance

        if self.eos_token_id is None:
            raise ValueError("structured_outputs: this model has no EOS token to end a constrained output")
        text = grammar_text(constraint)
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), text, log_level=0)
        if not matcher.is_error():
            # The first mask meets the parser's limits (llguidance's ParserTooComplex: a row of more than 2,000
            # items, e.g. an object of hundreds of optional properties): refused here, before the request is
            # scheduled, rather than ending its stream after one token.
            words = (self.vocab_size + 31) // 32
            scratch = torch.empty(words, dtype=torch.int32)
            matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), words * 4)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{constraint.kind}: {matcher.get_error()[:ERROR_CHARS]}")
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise ValueError(f"output_token_ids do not meet structured_outputs.{constraint.kind}: "
                             f"{matcher.get_error()}")
        return matcher


def token_bitmask(matchers: list, vocab_size: int) -> torch.Tensor:
    """``[len(matchers), ceil(vocab_size / 32)]`` int32 on the CPU: bit ``t % 32`` of word ``t // 32`` of row
    ``i`` is set where token ``t`` is allowed next by matcher ``i`` (llguidance's layout)."""
    words = (vocab_size + 31) // 32
    mask = torch.empty((len(matchers), words), dtype=torch.int32)
    for i, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(mask[i].data_ptr(), words * 4)
    return mask


_BITS: dict = {}


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """Set ``logits [n, vocab]`` to ``-inf`` at rows ``rows`` (``[m]`` int64, on the logits' device) where
    ``mask [m, words]`` (:func:`token_bitmask`, any device) does not allow the token; in place."""
    device = logits.device
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    mask = mask.to(device, non_blocking=True)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).view(mask.shape[0], -1)[:, :logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
