"""Incremental detokenization with stop-string handling for streamed output.

``IncrementalDetokenizer`` turns one request's output tokens, fed one at a
time, into text deltas that are safe to send to a client as they are produced:

* Every delta is whole characters. A token that ends inside a multi-byte UTF-8
  character (byte-level BPE splits emoji, CJK and Cyrillic across tokens)
  yields ``""`` until the character completes. Decoding uses
  ``tokenizers.decoders.DecodeStream`` and, where that class is missing, the
  prefix / read-offset algorithm of vLLM's ``detokenize_incrementally`` and
  Hugging Face TGI's ``decode_token`` (the same algorithm DecodeStream
  implements).
* Stop strings: any suffix of the text that could be the start of a stop
  string is held back. When a stop string appears, possibly spread over
  several tokens, only the text before it is emitted and nothing after it ever
  leaks.
* Final flush rule: when a request finishes for any reason other than a stop
  string (length, EOS, stop token), ``flush`` returns the remainder such that
  the concatenation of all deltas equals
  ``tokenizer.decode(ids, skip_special_tokens=True)`` of the token ids fed
  in. Consequently a character cut off by ``max_tokens`` ends the text as
  U+FFFD (REPLACEMENT CHARACTER) exactly as ``decode`` renders it. The output
  is decoded on its own, without the prompt as left context, and this plain
  ``decode`` of the output ids is the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["IncrementalDetokenizer", "OffsetDecodeStream", "REPLACEMENT_CHARACTER"]

REPLACEMENT_CHARACTER = "\ufffd"

try:
    from tokenizers.decoders import DecodeStream as _NativeDecodeStream
except ImportError:
    _NativeDecodeStream = None


class OffsetDecodeStream:
    """Pure-Python incremental decoder with the ``DecodeStream.step`` interface.

    Prefix / read-offset algorithm (vLLM ``detokenize_incrementally``, TGI
    ``decode_token``): decode the window ``ids[prefix_offset:]`` and compare it
    with the already-emitted window ``ids[prefix_offset:read_offset]``; emit the
    difference only when it is non-empty and does not end in U+FFFD (an
    incomplete UTF-8 sequence). Decoding a short window instead of the whole
    sequence keeps each step O(1) in the output length, and keeping one token of
    left context preserves decoder rules that depend on the previous token
    (e.g. SentencePiece's leading-space handling).
    """

    __slots__ = ("_ids", "_prefix_offset", "_read_offset", "_skip_special_tokens")

    def __init__(self, skip_special_tokens: bool = True) -> None:
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._skip_special_tokens = skip_special_tokens

    def step(self, tokenizer, token_id: int) -> str | None:
        """Add ``token_id``; return the newly completed text, or None if none yet."""
        self._ids.append(token_id)
        prefix_text = tokenizer.decode(
            self._ids[self._prefix_offset : self._read_offset],
            skip_special_tokens=self._skip_special_tokens,
        )
        new_text = tokenizer.decode(
            self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special_tokens
        )
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHARACTER):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text) :]
        return None


def _new_stream():
    if _NativeDecodeStream is not None:
        return _NativeDecodeStream(skip_special_tokens=True)
    return OffsetDecodeStream(skip_special_tokens=True)


class IncrementalDetokenizer:
    """Per-request streaming detokenizer with stop strings.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        stop: stop strings; empty strings are ignored.
        prior_token_ids: output tokens generated before this detokenizer was
            created (a resumed request). Their text counts as already sent:
            the state is rebuilt to exactly what it was after those tokens,
            including a partial character and a held-back stop-string prefix,
            so resuming repeats no text and loses none.

    After ``add_token`` returns, ``stop_string`` is the stop string that
    matched, or None. Once a stop string matched, the detokenizer is finished
    and further calls return ``""``.
    """

    __slots__ = (
        "_tokenizer",
        "_stream",
        "_stops",
        "_max_stop_len",
        "_held",
        "_emitted",
        "_ids",
        "stop_string",
    )

    def __init__(self, tokenizer, stop: Sequence[str] = (), prior_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = _new_stream()
        self._stops = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self._emitted: list[str] = []
        self._ids: list[int] = []
        self.stop_string: str | None = None
        for token_id in prior_token_ids:
            self.add_token(token_id)

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        return "".join(self._emitted)

    def add_token(self, token_id: int) -> str:
        """Feed one output token and return the text delta to send now (may be "").

        An id the tokenizer does not know decodes to nothing (``tokenizers``
        skips it).
        """
        if self.stop_string is not None:
            return ""
        self._ids.append(token_id)
        chunk = self._stream.step(self._tokenizer, token_id)
        if not chunk:
            return ""
        if not self._stops:
            self._emitted.append(chunk)
            return chunk
        return self._scan_stops(chunk)

    def _scan_stops(self, chunk: str) -> str:
        """Append ``chunk`` to the held-back text, cut at a stop string or hold a possible prefix."""
        pending = self._held + chunk
        # A match must end inside the new chunk, so it starts at most
        # max_stop_len - 1 characters before it.
        search_from = max(0, len(self._held) - self._max_stop_len + 1)
        best_start = -1
        best_stop = None
        for stop in self._stops:
            start = pending.find(stop, search_from)
            if start != -1 and (best_start == -1 or start < best_start):
                best_start, best_stop = start, stop
        if best_stop is not None:
            self.stop_string = best_stop
            self._held = ""
            delta = pending[:best_start]
            self._emitted.append(delta)
            return delta
        hold = self._longest_stop_prefix_suffix(pending)
        delta = pending[: len(pending) - hold]
        self._held = pending[len(pending) - hold :]
        self._emitted.append(delta)
        return delta

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        limit = min(len(text), self._max_stop_len - 1)
        for length in range(limit, 0, -1):
            suffix = text[-length:]
            for stop in self._stops:
                if stop.startswith(suffix):
                    return length
        return 0

    def flush(self) -> str:
        """Return the final delta for a request ending without a stop string.

        Afterwards the concatenation of all deltas equals
        ``tokenizer.decode(fed_ids, skip_special_tokens=True)``; see the module
        docstring for the rule and the U+FFFD case. Returns ``""`` after a stop
        string matched.
        """
        if self.stop_string is not None:
            return ""
        reference = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        emitted = self.text
        held, self._held = self._held, ""
        if reference.startswith(emitted):
            delta = reference[len(emitted) :]
        else:
            # The streamed text already diverged from the whole-sequence
            # decode (a decoder whose output depends on later tokens); sent
            # text cannot be retracted, so only the held-back text is released.
            delta = held
        self._emitted.append(delta)
        return delta
