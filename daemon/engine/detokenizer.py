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
* Stop strings (:class:`ringstream.daemon.common.stops.StopScanner`, the synthetic
  engine's scanner too): any suffix of the text that could be the start of a
  stop string is held back. When a stop string appears, possibly spread over
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

from ringstream.daemon.common.stops import StopScanner

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

    __slots__ = ("_tokenizer", "_stream", "_scanner", "_emitted", "_ids")

    def __init__(self, tokenizer, stop: Sequence[str] = (), prior_token_ids: Sequence[int] = (),
                 min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._stream = _new_stream()
        self._scanner = StopScanner(stop)
        self._emitted: list[str] = []
        self._ids: list[int] = []
        for index, token_id in enumerate(prior_token_ids):
            self.add_token(token_id, index >= min_tokens)

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched, or None."""
        return self._scanner.stop_string

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        return "".join(self._emitted)

    def add_token(self, token_id: int, check_stops: bool = True) -> str:
        """Feed one output token and return the text delta to send now (may be "").

        An id the tokenizer does not know decodes to nothing (``tokenizers``
        skips it). ``check_stops=False`` (a token within ``min_tokens``): no
        stop string may end in this token's text, though a later one may
        start in it (:meth:`ringstream.daemon.common.stops.StopScanner.add`).
        """
        if self._scanner.stop_string is not None:
            return ""
        self._ids.append(token_id)
        chunk = self._stream.step(self._tokenizer, token_id)
        if not chunk:
            return ""
        delta = self._scanner.add(chunk, check_stops)
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """Return the final delta for a request ending without a stop string.

        Afterwards the concatenation of all deltas equals
        ``tokenizer.decode(fed_ids, skip_special_tokens=True)``; see the module
        docstring for the rule and the U+FFFD case. Returns ``""`` after a stop
        string matched.
        """
        if self._scanner.stop_string is not None:
            return ""
        reference = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        emitted = self.text
        held = self._scanner.flush()
        if reference.startswith(emitted):
            delta = reference[len(emitted) :]
        else:
            # The streamed text already diverged from the whole-sequence
            # decode (a decoder whose output depends on later tokens); sent
            # text cannot be retracted, so only the held-back text is released.
            delta = held
        self._emitted.append(delta)
        return delta
