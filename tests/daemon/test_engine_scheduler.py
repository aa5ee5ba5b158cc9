"""The engine's step scheduler (daemon.engine_scheduler) driven without a model: token budget split between
decodes and chunked prefill, admission by free blocks and watermark, recompute-preemption victims, prefix-cache
hits, stop conditions and block release. The model runner is played by hand: each test says which token each
scheduled sequence sampled."""

import itertools

from ringstream.daemon.engine.block_manager import BlockManager
from ringstream.daemon.engine.interface import FINISH_LENGTH, FINISH_STOP, EngineRequest, SamplingParams, TokenOutput
from ringstream.daemon.engine.scheduler import SequenceState, StepScheduler

BS = 4  # block size of every case

_seq_ids = itertools.count(1)


class FakeDetokenizer:
    """Text ``<id>`` per token; ``stop_on`` sets ``stop_string`` when that token arrives."""

    def __init__(self, stop_on: int | None = None) -> None:
        self.stop_on = stop_on
        self.stop_string = None

    def add_token(self, token_id: int) -> str:
        if token_id == self.stop_on:
            self.stop_string = "STOP"
            return ""
        return f"<{token_id}>"

    def flush(self) -> str:
        return ""


def make_seq(prompt, *, handle, priority=0, max_output_tokens=16, stop_token_ids=(), user_stop_token_ids=(),
             detokenizer=None) -> SequenceState:
    prompt = list(prompt)
    request = EngineRequest(handle=handle, prompt_token_ids=prompt, params=SamplingParams(), priority=priority)
    return SequenceState(
        seq_id=next(_seq_ids), handle=handle, request=request, token_ids=list(prompt), num_prompt_tokens=len(prompt),
        max_output_tokens=max_output_tokens, stop_token_ids=frozenset(stop_token_ids),
        user_stop_token_ids=frozenset(user_stop_token_ids), detokenizer=detokenizer or FakeDetokenizer(),
        generator=None, greedy=True, temperature=1.0, top_k=0, top_p=1.0, priority=priority,
    )


def make_scheduler(num_blocks=65, *, caching=False, max_num_seqs=4, budget=64) -> StepScheduler:
    return StepScheduler(BlockManager(num_blocks, BS, caching), max_num_seqs, budget)


def step(sched: StepScheduler, sampled: dict | None = None) -> tuple[dict, list]:
    """Schedule, then account it as the runner would: each sequence that completes its known tokens samples
    ``sampled.get(handle, 100 + handle)``."""
    scheduled = sched.schedule()
    chosen = {seq.handle: n for seq, n in scheduled.items()}
    items = list(scheduled.items())
    tokens = [(sampled or {}).get(seq.handle, 100 + seq.handle) if seq.num_computed + n == len(seq.token_ids)
              else None for seq, n in items]
    outputs = []
    sched.advance(items, tokens, outputs)
    return chosen, outputs




def test_decodes_first_then_running_chunk_then_admissions_within_budget():
    sched = make_scheduler(budget=8)
    sched.add(make_seq(range(2), handle=1))
    assert step(sched)[0] == {1: 2}
    sched.add(make_seq(range(20), handle=2))
    # The decode takes its token, the long prompt the rest of the budget (chunked prefill).
    assert step(sched)[0] == {1: 1, 2: 7}
    sched.add(make_seq(range(2), handle=3))
    # Prefill of a running prompt goes before any admission: nothing is left for request 3.
    chosen, _ = step(sched)
    assert chosen == {1: 1, 2: 7} and [seq.handle for seq in sched.waiting] == [3]
    # The prompt's last 6 tokens, then request 3 is admitted with the one token left.
    chosen, outputs = step(sched)
    assert chosen == {1: 1, 2: 6, 3: 1} and sum(chosen.values()) == 8
    assert [out.handle for out in outputs] == [1, 2]
    # Every sequence now needs one token: one each, in admission order.
    chosen, outputs = step(sched)
    assert list(chosen.items()) == [(1, 1), (2, 1), (3, 1)]
    assert [out.handle for out in outputs] == [1, 2, 3]


def test_the_time_budget_is_asked_for_the_chunk_where_the_running_prompt_stands():
    sched = make_scheduler(budget=64)
    asked = []

    def limit(decodes: int, start: int) -> int:
        asked.append((decodes, start))
        return 5

    sched.chunk_limit = limit
    sched.add(make_seq(range(2), handle=1))
    step(sched)  # no decodes: 0, and a waiting prompt starts at 0
    sched.add(make_seq(range(20), handle=2))
    assert step(sched)[0] == {1: 1, 2: 5}
    assert step(sched)[0] == {1: 1, 2: 5}  # the prompt's second chunk, asked for from position 5
    assert asked == [(0, 0), (1, 0), (1, 5)]


def test_a_prompt_admitted_past_a_prefix_cache_hit_is_budgeted_from_where_its_chunk_starts():
    # a multi-turn chat: the cached prefix is not computed again, but the chunk after it attends it
    sched = make_scheduler(caching=True, budget=64)
    sched.add(make_seq(range(10), handle=1, max_output_tokens=1))
    step(sched)  # two full blocks in the prefix cache; the request ends
    asked = []

    def limit(decodes: int, start: int) -> int:
        asked.append((decodes, start))
        return 2 if start else 64

    sched.chunk_limit = limit
    sched.add(make_seq(range(20), handle=2))
    assert step(sched)[0] == {2: 2}  # from position 8 (the hit) on, the budget for that depth: 2 tokens
    assert asked == [(0, 0), (0, 8)]


def test_a_prefill_burst_takes_the_token_budget_when_prompts_outnumber_decodes():
    sched = make_scheduler(budget=64, max_num_seqs=4)
    sched.chunk_limit = lambda decodes, start: 3
    sched.burst_ratio = 1.0
    sched.add(make_seq(range(2), handle=1))
    assert step(sched)[0] == {1: 2}  # no decodes yet: one prompt is a burst, the token budget bounds it
    sched.add(make_seq(range(20), handle=2))
    assert step(sched)[0] == {1: 1, 2: 3}  # a lone prompt beside a decode is no burst (1 >= 1.0 x 1 but < 2)
    for handle in (3, 4):
        sched.add(make_seq(range(20), handle=handle))
    assert step(sched)[0] == {1: 1, 2: 17, 3: 20, 4: 20}  # three prompts beside one decode: a burst
    sched.burst_ratio = 2.0
    sched.add(make_seq(range(20), handle=5))  # waits: the batch is full (max_num_seqs 4), so it is not counted
    assert step(sched)[0] == {1: 1, 2: 1, 3: 1, 4: 1}
    sched.release(sched.by_handle[4])
    chosen, _ = step(sched)  # one prompt the batch can take beside three decodes: 1 < 2.0 x 3, the time budget
    assert chosen == {1: 1, 2: 1, 3: 1, 5: 3}


def test_a_waiting_request_the_kv_cache_cannot_take_makes_no_burst():
    sched = make_scheduler(num_blocks=40, budget=64, max_num_seqs=4)  # 39 usable blocks of 4 positions
    sched.chunk_limit = lambda decodes, start: 3
    sched.burst_ratio = 0.5
    sched.add(make_seq(range(2), handle=1, max_output_tokens=100))
    step(sched)  # a decoding stream
    sched.add(make_seq(range(120), handle=2))  # 30 blocks: running, in prefill
    assert step(sched)[0] == {1: 1, 2: 3}
    sched.add(make_seq(range(150), handle=3))  # 38 blocks: it waits, admission cannot take it
    for _ in range(3):  # so a lone prompt beside the decode still: the time budget
        assert step(sched)[0] == {1: 1, 2: 3}
    assert [seq.handle for seq in sched.waiting] == [3]


def test_without_a_burst_ratio_every_prompt_chunk_keeps_the_time_budget():
    sched = make_scheduler(budget=64, max_num_seqs=4)
    sched.chunk_limit = lambda decodes, start: 3
    for handle in (1, 2, 3):
        sched.add(make_seq(range(20), handle=handle))
    assert step(sched)[0] == {1: 3}
    assert sched.burst_ratio == 0


def test_admission_stops_at_max_num_seqs_and_keeps_a_watermark_while_others_run():
    sched = make_scheduler(num_blocks=5, max_num_seqs=2)  # 4 usable blocks, watermark 1
    for handle in (1, 2, 3):
        sched.add(make_seq(range(4), handle=handle))
    assert step(sched)[0] == {1: 4, 2: 4}
    assert [seq.handle for seq in sched.waiting] == [3]

    sched = make_scheduler(num_blocks=5)
    sched.add(make_seq(range(8), handle=1))  # 2 blocks with nothing running: no watermark
    sched.add(make_seq(range(8), handle=2))  # 2 blocks + 1 reserved > 2 free: waits
    assert step(sched)[0] == {1: 8}
    assert sched.blocks.num_free_blocks == 2 and [seq.handle for seq in sched.waiting] == [2]


def _three_full_blocks(priorities):
    """Three running 1-block sequences in a pool of 4 usable blocks, each with a sampled token (all decoding)."""
    sched = make_scheduler(num_blocks=5)
    for handle, priority in zip((1, 2, 3), priorities):
        sched.add(make_seq(range(4), handle=handle, priority=priority))
    assert step(sched)[0] == {1: 4, 2: 4, 3: 4}
    assert sched.blocks.num_free_blocks == 1
    return sched


def test_preemption_takes_the_least_urgent_most_recently_started():
    sched = _three_full_blocks([0, 5, 5])
    # 1 takes the last free block; 2 finds none: of the priority-5 pair, 3 started last and is preempted.
    chosen, _ = step(sched)
    assert chosen == {1: 1, 2: 1}
    assert sched.num_preemptions == 1
    victim = sched.waiting[0]
    assert victim.handle == 3 and not victim.running and victim.num_computed == 0
    assert victim.token_ids == [0, 1, 2, 3, 103]  # resumes with its prompt and output so far
    assert [seq.handle for seq in sched.running] == [1, 2]


def test_preemption_of_an_already_scheduled_victim_unschedules_it():
    sched = _three_full_blocks([5, 0, 0])
    # 1 is scheduled first (last free block); 2 then needs one and the least urgent is 1.
    chosen, _ = step(sched)
    assert chosen == {2: 1, 3: 1}
    assert [seq.handle for seq in sched.waiting] == [1] and sched.num_preemptions == 1


def test_a_sequence_that_is_its_own_victim_is_preempted_and_the_others_go_on():
    sched = _three_full_blocks([0, 1, 0])
    # 1 takes the free block; 2 finds none and is itself the least urgent; 3 gets the block 2 freed.
    chosen, _ = step(sched)
    assert chosen == {1: 1, 3: 1}
    assert [seq.handle for seq in sched.waiting] == [2] and sched.num_preemptions == 1


def test_prefix_cache_hit_skips_the_shared_blocks():
    sched = make_scheduler(caching=True)
    sched.add(make_seq(range(10), handle=1))
    assert step(sched)[0] == {1: 10}  # two full blocks registered in the prefix cache
    b = make_seq([*range(8), 50, 51], handle=2)
    sched.add(b)
    assert step(sched)[0] == {1: 1, 2: 2}
    assert sched.blocks.prefix_hits == 8
    a = sched.by_handle[1]
    assert sched.blocks.block_table(b.seq_id)[:2] == sched.blocks.block_table(a.seq_id)[:2]
    # A prompt that is all cached still computes its last token: the hit stops a block short.
    c = make_seq(range(8), handle=3)
    sched.add(c)
    assert step(sched)[0] == {1: 1, 2: 1, 3: 4}


def test_no_prefix_hits_without_prefix_caching():
    sched = make_scheduler(caching=False)
    sched.add(make_seq(range(10), handle=1))
    step(sched)
    sched.add(make_seq([*range(8), 50, 51], handle=2))
    assert step(sched)[0] == {1: 1, 2: 10}
    assert sched.blocks.prefix_hits == 0 and sched.block_hashes(sched.by_handle[2]) == []


def test_stop_conditions_emit_the_last_token_and_free_the_blocks():
    sched = make_scheduler()
    free = sched.blocks.num_free_blocks
    sched.add(make_seq(range(3), handle=1, max_output_tokens=2))
    sched.add(make_seq(range(3), handle=2, stop_token_ids=(7, 9), user_stop_token_ids=(7,)))
    sched.add(make_seq(range(3), handle=3, detokenizer=FakeDetokenizer(stop_on=5)))
    _, outputs = step(sched, {1: 11, 2: 12, 3: 13})
    assert outputs == [TokenOutput(1, 0, 11, "<11>"), TokenOutput(2, 0, 12, "<12>"), TokenOutput(3, 0, 13, "<13>")]
    _, outputs = step(sched, {1: 21, 2: 7, 3: 5})
    assert outputs == [
        TokenOutput(1, 1, 21, "<21>", FINISH_LENGTH, None, 3, 2),
        TokenOutput(2, 1, 7, "", FINISH_STOP, 7, 3, 2),
        TokenOutput(3, 1, 5, "", FINISH_STOP, "STOP", 3, 2),
    ]
    assert not sched.has_unfinished() and not sched.by_handle
    assert sched.blocks.num_free_blocks == free


def test_abort_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    free = sched.blocks.num_free_blocks
    sched.add(make_seq(range(5), handle=1))
    sched.add(make_seq(range(5), handle=2))
    step(sched)
    assert sched.abort(2) and [seq.handle for seq in sched.waiting] == []
    assert sched.abort(1) and not sched.running and sched.blocks.num_free_blocks == free
    assert not sched.abort(1) and not sched.by_handle
