"""The one finish rule of both engines (daemon.common.finish): its cases one by one, then the same requests through
the synthetic engine and through the paged engine's step scheduler, which must end every one alike."""

from __future__ import annotations

import pytest

from ringstream.daemon.common.finish import FINISH_LENGTH, FINISH_STOP, finish_after_token
from ringstream.daemon.common.stops import StopScanner
from ringstream.daemon.engine import interface
from ringstream.daemon.engine.block_manager import BlockManager
from ringstream.daemon.engine.interface import EngineRequest, SamplingParams, check_request
from ringstream.daemon.engine.scheduler import SequenceState, StepScheduler
from ringstream.daemon.engine.synthetic import SyntheticEngine, SyntheticText, synthetic_text, synthetic_token_id

VOCAB = 4096
EOS = 34
"""The synthetic token of request 1 at ``seq`` 3 (``1 * 31 + 3``)."""
MAX_MODEL_LEN = 64
PROMPT = [10, 11, 12]


class FakeText:
    """Text ``<id>`` per token through a real :class:`StopScanner`; records the calls the rule makes."""

    def __init__(self, stops=()) -> None:
        self.scanner = StopScanner(stops)
        self.calls: list = []

    @property
    def stop_string(self):
        return self.scanner.stop_string

    def add_token(self, token_id: int, *check) -> str:
        self.calls.append(("add", token_id, *check))
        return self.scanner.add(f"<{token_id}>", *check)

    def flush(self) -> str:
        self.calls.append(("flush",))
        return self.scanner.flush()


def apply(text, token_id, num_output, *, stop_ids=(), user_stop_ids=(), min_tokens=0, max_output=16):
    return finish_after_token(text, token_id, num_output, frozenset(stop_ids), frozenset(user_stop_ids), min_tokens,
                              max_output)


def test_reasons_are_the_engine_interface_values():
    assert (FINISH_STOP, FINISH_LENGTH) == (interface.FINISH_STOP, interface.FINISH_LENGTH) == ("stop", "length")
    assert type(FINISH_STOP) is str and type(FINISH_LENGTH) is str


def test_a_plain_token_is_fed_and_the_request_goes_on():
    text = FakeText()
    assert apply(text, 5, 1) == ("<5>", None, None)
    assert text.calls == [("add", 5)]


def test_eos_ends_without_text_or_stop_reason_and_a_user_stop_token_reports_itself():
    assert apply(FakeText(), 8, 1, stop_ids=(9,)) == ("<8>", None, None)
    text = FakeText(["x"])
    text.scanner.add("ab")
    assert apply(text, 2, 2, stop_ids=(2, 7), user_stop_ids=(7,)) == ("", FINISH_STOP, None)
    assert text.calls == [("flush",)]
    text = FakeText()
    assert apply(text, 7, 1, stop_ids=(2, 7), user_stop_ids=(7,)) == ("", FINISH_STOP, 7)


def test_a_stop_token_flushes_the_held_text():
    text = FakeText(["<1>!"])
    assert apply(text, 1, 1) == ("", None, None)  # "<1>" could start the stop string: held
    assert apply(text, 2, 2, stop_ids=(2,)) == ("<1>", FINISH_STOP, None)


def test_stop_token_beats_length_and_stop_string_beats_length():
    assert apply(FakeText(["<2>"]), 2, 4, stop_ids=(2,), user_stop_ids=(2,), max_output=4) == ("", FINISH_STOP, 2)
    assert apply(FakeText(["2>"]), 2, 4, max_output=4) == ("<", FINISH_STOP, "2>")


def test_stop_string_ends_with_the_text_before_it():
    text = FakeText(["3><4"])
    assert apply(text, 3, 1) == ("<", None, None)
    assert apply(text, 4, 2) == ("", FINISH_STOP, "3><4")


def test_length_flushes_the_held_text():
    text = FakeText(["<5>?"])
    assert apply(text, 5, 3, max_output=3) == ("<5>", FINISH_LENGTH, None)
    assert text.calls == [("add", 5), ("flush",)]


def test_within_min_tokens_neither_stop_tokens_nor_stop_strings_end_the_request():
    text = FakeText(["<2>"])
    assert apply(text, 2, 2, stop_ids=(2,), user_stop_ids=(2,), min_tokens=2) == ("<2>", None, None)
    assert text.calls == [("add", 2, False)]  # fed like any token, and no stop string may end in it
    assert apply(text, 2, 3, stop_ids=(2,), user_stop_ids=(2,), min_tokens=2) == ("", FINISH_STOP, 2)
    text = FakeText(["<1><2>"])
    assert apply(text, 1, 1, min_tokens=1) == ("", None, None)  # held: a later token may complete it
    assert apply(text, 2, 2, min_tokens=1) == ("", FINISH_STOP, "<1><2>")


def test_length_still_applies_within_min_tokens():
    assert apply(FakeText(), 5, 2, min_tokens=4, max_output=2) == ("<5>", FINISH_LENGTH, None)


# ---------------------------------------------------------------- both engines

CASES = {
    "length_by_max_tokens": dict(max_tokens=5, ignore_eos=True),
    "length_by_context": dict(max_tokens=500, ignore_eos=True),
    "eos": dict(max_tokens=10),
    "ignore_eos": dict(max_tokens=6, ignore_eos=True),
    "user_stop_token": dict(max_tokens=10, stop_token_ids=[33]),
    "user_stop_token_that_is_eos": dict(max_tokens=10, stop_token_ids=[EOS]),
    "stop_token_at_max_tokens": dict(max_tokens=3, stop_token_ids=[33]),
    "stop_string": dict(max_tokens=10, ignore_eos=True, stop=[" t2"]),
    "stop_string_across_tokens": dict(max_tokens=10, ignore_eos=True, stop=["1 t2"]),
    "stop_string_at_max_tokens": dict(max_tokens=3, ignore_eos=True, stop=[" t2"]),
    "stop_string_and_stop_token_on_one_token": dict(max_tokens=10, stop=[" t2"], stop_token_ids=[33]),
    "held_prefix_flushed_by_length": dict(max_tokens=3, ignore_eos=True, stop=[" t2!"]),
    "held_prefix_flushed_by_eos": dict(max_tokens=10, stop=[" t2!"]),
    "min_tokens_past_eos": dict(max_tokens=8, min_tokens=5),
    "min_tokens_past_stop_string": dict(max_tokens=8, min_tokens=3, ignore_eos=True, stop=[" t1", " t4"]),
    "stop_string_begun_within_min_tokens": dict(max_tokens=8, min_tokens=2, ignore_eos=True, stop=["1 t2"]),
    "min_tokens_past_user_stop_token": dict(max_tokens=8, min_tokens=3, ignore_eos=True, stop_token_ids=[32, 35]),
}
RESUMED = {"resumed": (dict(max_tokens=8, stop=[" t5"], ignore_eos=True), 2),
           "resumed_within_min_tokens": (dict(max_tokens=8, min_tokens=4, stop_token_ids=[36]), 3)}


def synthetic_outputs(params: SamplingParams, output: list[int]) -> list:
    eng = SyntheticEngine(max_model_len=MAX_MODEL_LEN, step_time_s=0.0, vocab_size=VOCAB, eos_token_ids=(EOS,))
    eng.add(EngineRequest(1, list(PROMPT), params, list(output)))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


def scheduler_outputs(params: SamplingParams, output: list[int]) -> list:
    """The same request through :class:`StepScheduler`, built as the paged engine builds its sequences, with the
    synthetic engine's tokens (sampled by hand) and text (:class:`SyntheticText`)."""
    req = EngineRequest(1, list(PROMPT), params, list(output))
    stop_ids, user_stop_ids = check_request(req, MAX_MODEL_LEN, VOCAB, (EOS,))
    scanner = StopScanner(params.stop)
    for seq_no in range(len(output)):
        scanner.add(synthetic_text(seq_no), seq_no >= params.min_tokens)
    seq = SequenceState(
        seq_id=1, handle=1, request=req, token_ids=PROMPT + list(output), num_prompt_tokens=len(PROMPT),
        max_output_tokens=min(params.max_tokens, MAX_MODEL_LEN - len(PROMPT)), stop_token_ids=stop_ids,
        user_stop_token_ids=user_stop_ids, detokenizer=SyntheticText(req.output_token_ids, scanner),
        generator=None, greedy=True, temperature=1.0, top_k=VOCAB, top_p=1.0, priority=0,
    )
    sched = StepScheduler(BlockManager(64, 4, False), 4, 64)
    sched.add(seq)
    outs: list = []
    while sched.has_unfinished():
        items = list(sched.schedule().items())
        tokens = [synthetic_token_id(1, len(s.request.output_token_ids), VOCAB)
                  if s.num_computed + n == len(s.token_ids) else None for s, n in items]
        sched.advance(items, tokens, outs)
    return outs


def engine_cases():
    for name, fields in CASES.items():
        yield pytest.param(fields, 0, id=name)
    for name, (fields, done) in RESUMED.items():
        yield pytest.param(fields, done, id=name)


@pytest.mark.parametrize(("fields", "done"), list(engine_cases()))
def test_both_engines_end_every_request_alike(fields, done):
    params = SamplingParams(**fields)
    output = [synthetic_token_id(1, s, VOCAB) for s in range(done)]
    synthetic = synthetic_outputs(params, output)
    assert synthetic and synthetic[-1].finish_reason is not None
    assert all(out.finish_reason is None for out in synthetic[:-1])
    assert scheduler_outputs(params, output) == synthetic


def last(fields, done=0):
    output = [synthetic_token_id(1, s, VOCAB) for s in range(done)]
    outs = synthetic_outputs(SamplingParams(**fields), output)
    return outs[-1].seq, outs[-1].finish_reason, outs[-1].stop_reason, "".join(out.text for out in outs)


@pytest.mark.parametrize(("name", "expected"), [
    ("length_by_max_tokens", (4, FINISH_LENGTH, None, " t0 t1 t2 t3 t4")),
    ("length_by_context", (MAX_MODEL_LEN - len(PROMPT) - 1, FINISH_LENGTH, None, None)),
    ("eos", (3, FINISH_STOP, None, " t0 t1 t2")),
    ("ignore_eos", (5, FINISH_LENGTH, None, " t0 t1 t2 t3 t4 t5")),
    ("user_stop_token", (2, FINISH_STOP, 33, " t0 t1")),
    ("user_stop_token_that_is_eos", (3, FINISH_STOP, EOS, " t0 t1 t2")),
    ("stop_token_at_max_tokens", (2, FINISH_STOP, 33, " t0 t1")),
    ("stop_string", (2, FINISH_STOP, " t2", " t0 t1")),
    ("stop_string_across_tokens", (2, FINISH_STOP, "1 t2", " t0 t")),
    ("stop_string_at_max_tokens", (2, FINISH_STOP, " t2", " t0 t1")),
    ("stop_string_and_stop_token_on_one_token", (2, FINISH_STOP, 33, " t0 t1")),
    ("held_prefix_flushed_by_length", (2, FINISH_LENGTH, None, " t0 t1 t2")),
    ("held_prefix_flushed_by_eos", (3, FINISH_STOP, None, " t0 t1 t2")),
    ("min_tokens_past_eos", (7, FINISH_LENGTH, None, " t0 t1 t2 t3 t4 t5 t6 t7")),
    ("min_tokens_past_stop_string", (4, FINISH_STOP, " t4", " t0 t1 t2 t3")),
    ("stop_string_begun_within_min_tokens", (2, FINISH_STOP, "1 t2", " t0 t")),
    ("min_tokens_past_user_stop_token", (4, FINISH_STOP, 35, " t0 t1 t2 t3")),
])
def test_what_each_case_ends_with(name, expected):
    got = last(CASES[name])
    if expected[3] is None:
        got = got[:3] + (None,)
    assert got == expected


def test_resumed_requests_end_as_if_never_interrupted():
    for fields, done in RESUMED.values():
        whole = synthetic_outputs(SamplingParams(**fields), [])
        resumed = synthetic_outputs(SamplingParams(**fields), [synthetic_token_id(1, s, VOCAB) for s in range(done)])
        assert resumed == whole[done:]
