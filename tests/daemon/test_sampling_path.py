"""Sampling parameters: one struct from the client's Generate through the front's Assign to the engine, one check."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringstream.daemon.engine.interface import EngineRequest, check_request
from ringstream.daemon.common.model_dir import ModelInfo
from ringstream.daemon.front.request import Request
from ringstream.daemon.engine.synthetic import SyntheticEngine
from ringstream.daemon.front.validate import RequestRejected, Validator
from ringstream.daemon.worker.loop import Worker
from ringstream.ipc import protocol as P
from ringstream.ipc.client_base import _generate_frame
from tests.daemon.fake_ports import make_core, worker_ready
from tests.factories import make_tokenizer

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def validator() -> Validator:
    tokenizer = make_tokenizer()
    info = ModelInfo(path=Path("."), max_model_len=MAX_MODEL_LEN, eos_token_ids=(1,), bos_token_id=0,
                     vocab_size=tokenizer.get_vocab_size(), model_type="llama")
    return Validator(tokenizer, info)


class _Capture:
    """An engine stand-in that keeps what it is given."""

    def __init__(self) -> None:
        self.added: list[EngineRequest] = []

    def add(self, req: EngineRequest) -> None:
        self.added.append(req)


def _front_assign(req: Request) -> P.Assign:
    """What the front's core sends to a worker for ``req``."""
    core, ports = make_core()
    worker_ready(core)
    core.admit(req, connection=None)
    [assign] = [command for _, command in ports.commands if isinstance(command, P.Assign)]
    return assign


def _worker_receives(assign: P.Assign) -> EngineRequest:
    """What a worker hands its engine for the encoded ``assign``."""
    worker = object.__new__(Worker)
    worker.engine, worker.handles = _Capture(), set()
    worker._apply(P.COMMAND_DECODER.decode(P.encode(assign)))
    [engine_request] = worker.engine.added
    return engine_request


def test_sampling_params_reach_the_engine_unchanged(validator):
    flat = dict(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, seed=42, stop=["\n", "END"],
                stop_token_ids=[3, 4], ignore_eos=True)
    msg = P.CLIENT_DECODER.decode(_generate_frame("r1", "Return the", None, dict(flat, priority=-2)))
    assert msg.sampling == P.SamplingParams(**flat)
    ids = validator.check(msg)
    req = Request(b"client", "r1", 7, msg, ids, arrival=0.0, output_token_ids=[5])
    assign = _front_assign(req)
    assert (assign.handle, assign.sampling, assign.priority) == (7, msg.sampling, -2)
    engine_request = _worker_receives(assign)
    assert engine_request.params == P.SamplingParams(**flat)
    assert (engine_request.handle, engine_request.prompt_token_ids, engine_request.output_token_ids) == (7, ids, [5])
    SyntheticEngine(vocab_size=validator.vocab_size, step_time_s=0.0).add(engine_request)  # the engine takes it as is


def test_a_stop_token_outside_the_vocabulary_is_refused_by_the_one_check(validator):
    vocab = validator.vocab_size
    msg = P.make_generate("r", prompt="x", stop_token_ids=[vocab + 3])
    with pytest.raises(RequestRejected) as refused:
        validator.check(msg)
    assert refused.value.code == P.ErrorCode.INVALID_REQUEST
    assert str(refused.value) == f"stop_token_ids: token id {vocab + 3} is outside the vocabulary of {vocab}"
    with pytest.raises(ValueError) as engine_refused:
        check_request(EngineRequest(1, [5], msg.sampling), MAX_MODEL_LEN, vocab, (1,))
    assert str(engine_refused.value) == str(refused.value)


def test_the_front_applies_the_wire_limits_to_a_message_built_in_python(validator):
    with pytest.raises(RequestRejected, match="top_p") as refused:
        validator.check(P.make_generate("r", prompt="x", top_p=1.5))
    assert refused.value.code == P.ErrorCode.INVALID_REQUEST
