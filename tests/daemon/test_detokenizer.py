"""Tests of daemon.detokenizer: UTF-8-safe deltas, stop strings, flush rule, resume."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers.decoders import DecodeStream

from ringstream.daemon.engine.detokenizer import REPLACEMENT_CHARACTER, IncrementalDetokenizer, OffsetDecodeStream
from tests.factories import EOS_TOKEN, make_tokenizer

MULTILINGUAL = [
    "Hello, world!",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "你好，世界！快速的棕色狐狸跳过了懒狗。",
    "Emoji 🙂🚀 then 👍🏽 flags 🇩🇪 and ✨ sparkles",
    "mixed: naïve café — ёлка 木 🙂 end",
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def stream(tokenizer, ids, stop=(), prior=()):
    detokenizer = IncrementalDetokenizer(tokenizer, stop, prior_token_ids=prior)
    deltas = [detokenizer.add_token(i) for i in ids]
    return detokenizer, deltas


def assert_whole_characters(delta: str) -> None:
    delta.encode("utf-8")  # raises on lone surrogates
    assert REPLACEMENT_CHARACTER not in delta


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_joined_deltas_equal_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    detokenizer, deltas = stream(tokenizer, ids)
    deltas.append(detokenizer.flush())
    for delta in deltas:
        assert_whole_characters(delta)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_partial_character_is_held_back(tokenizer):
    ids = encode(tokenizer, "🙂")
    assert len(ids) > 1, "the test tokenizer must split the emoji across tokens"
    detokenizer, deltas = stream(tokenizer, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🙂"


@pytest.mark.parametrize("text", MULTILINGUAL[1:])
def test_cut_mid_character_flushes_as_decode_renders(tokenizer, text):
    ids = encode(tokenizer, text)
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT_CHARACTER)]
    assert cuts, "expected a token boundary inside a character"
    for k in cuts:
        detokenizer, deltas = stream(tokenizer, ids[:k])
        for delta in deltas:
            assert_whole_characters(delta)
        final = detokenizer.flush()
        assert final.endswith(REPLACEMENT_CHARACTER)
        assert "".join(deltas) + final == tokenizer.decode(ids[:k], skip_special_tokens=True)


def test_special_tokens_contribute_no_text(tokenizer):
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids = encode(tokenizer, "abc") + [eos]
    detokenizer, deltas = stream(tokenizer, ids)
    assert deltas[-1] == ""
    assert "".join(deltas) + detokenizer.flush() == "abc"


def test_stop_string_across_tokens_does_not_leak(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids = encode(tokenizer, text)
    stop = "n fox j"
    detokenizer, deltas = stream(tokenizer, ids, stop=(stop, "zzz"))
    assert detokenizer.stop_string == stop
    assert "".join(deltas) == "The quick brow"
    assert detokenizer.flush() == ""
    assert detokenizer.add_token(ids[0]) == ""


def test_stop_prefix_is_held_then_released(tokenizer):
    ids = encode(tokenizer, "abcab")
    detokenizer, deltas = stream(tokenizer, ids, stop=("abx",))
    joined = "".join(deltas)
    assert not joined.endswith("ab")
    assert detokenizer.stop_string is None
    assert joined + detokenizer.flush() == "abcab"


def test_earliest_stop_string_wins(tokenizer):
    ids = encode(tokenizer, "one two three four")
    detokenizer, deltas = stream(tokenizer, ids, stop=("four", "two", "e t"))
    assert detokenizer.stop_string == "e t"
    assert "".join(deltas) == "on"


def test_stop_string_with_multibyte_characters(tokenizer):
    text = "Привет 🙂 мир, 你好"
    ids = encode(tokenizer, text)
    detokenizer, deltas = stream(tokenizer, ids, stop=("🙂 м",))
    assert "".join(deltas) == "Привет "
    for delta in deltas:
        assert_whole_characters(delta)


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_resume_rebuilds_state(tokenizer, text):
    ids = encode(tokenizer, text)
    stops = ("zq", "ь ж")
    full, full_deltas = stream(tokenizer, ids, stop=stops)
    for k in range(len(ids)):
        resumed, deltas = stream(tokenizer, ids[k:], stop=stops, prior=ids[:k])
        assert "".join(full_deltas[:k]) + "".join(deltas) == "".join(full_deltas)
        assert resumed.stop_string == full.stop_string


def test_resume_flush_covers_whole_output(tokenizer):
    ids = encode(tokenizer, MULTILINGUAL[3])
    k = len(ids) // 2
    first, first_deltas = stream(tokenizer, ids[:k])
    resumed, deltas = stream(tokenizer, ids[k:], prior=ids[:k])
    assert "".join(first_deltas) + "".join(deltas) + resumed.flush() == tokenizer.decode(ids)


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_offset_fallback_matches_decode_stream(tokenizer, text):
    ids = encode(tokenizer, text)
    native = DecodeStream(skip_special_tokens=True)
    fallback = OffsetDecodeStream(skip_special_tokens=True)
    assert [fallback.step(tokenizer, i) for i in ids] == [native.step(tokenizer, i) for i in ids]


TEXT_ALPHABET = st.sampled_from(list("abc xyz,.") + list("ёжПр") + list("你好木") + ["🙂", "🚀", "é"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(TEXT_ALPHABET, min_size=1, max_size=40), stop=st.text(TEXT_ALPHABET, min_size=1, max_size=4))
def test_stop_property(tokenizer, text, stop):
    ids = encode(tokenizer, text)
    assert tokenizer.decode(ids) == text
    detokenizer, deltas = stream(tokenizer, ids, stop=(stop,))
    final = detokenizer.flush()
    for delta in deltas + [final]:
        assert_whole_characters(delta)
    position = text.find(stop)
    if position == -1:
        assert detokenizer.stop_string is None
        assert "".join(deltas) + final == text
    else:
        assert detokenizer.stop_string == stop
        assert "".join(deltas) == text[:position]
        assert final == ""
