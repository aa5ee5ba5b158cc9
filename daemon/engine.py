"""Paged continuous-batching engine over a Hugging Face causal LM.

Requests join the running batch at the next step and leave the moment they
finish (continuous batching: Orca, Yu et al., OSDI 2022; vLLM). Their keys and
values live in a paged pool (:mod:`ringstream.daemon.kv_cache`) of fixed-size blocks that
:class:`ringstream.daemon.block_manager.BlockManager` hands out as sequences grow, shares
between sequences with a common prefix, and keeps cached after they end.

One ``step()`` (vLLM v1's scheduler, ``vllm/v1/core/sched/scheduler.py``):

1. **Budget.** At most ``max_num_batched_tokens`` new tokens. Running decodes
   come first (one token each), then prompt chunks of running sequences still
   in prefill, then waiting requests, FIFO, each taking what is left of the
   budget (chunked prefill): a long prompt is prefilled over several steps
   while every other stream keeps getting one token per step.
2. **Blocks.** A waiting request is admitted when the blocks for the part of
   its tokens not in the prefix cache are free (minus a small watermark); its
   cached prefix is shared, not recomputed. A decode that needs a new block
   and finds none preempts the least urgent, most recently started running
   request (recompute preemption: its blocks are freed and it goes back to the
   head of the waiting queue with its prompt and tokens so far, to resume
   where it stopped; its stream is unbroken).
3. **Forward.** One forward over the packed new tokens of every scheduled
   sequence, each at its own positions; attention reads each sequence's own
   context through its block table (:mod:`ringstream.daemon.attention`), so no row pays
   for the longest row and no step builds an ``L x L`` mask.
4. **Sample** the next token of every sequence whose known tokens are now all
   computed; detokenise, check stop conditions, free finished sequences.

If a step's forward or sampling raises, each of its sequences is run again
alone; those that fail alone end with a :class:`RequestError`, the others go
on (one bad request never fails its companions).

Numerics: each sequence attends exactly its own keys, at its own positions, so
its logits depend on its companions only through float rounding of batched
kernels. In float32, greedy outputs equal ``model.generate`` on the prompt
alone token for token (tested, with and without prefix-cache hits and chunked
prefill). In bfloat16 / float16 rounding can flip near-tied tokens, as with any
batched inference.

The model must be a transformers architecture that calls
``cache.update(key_states, value_states, layer_idx, ...)`` from its attention
layers and looks its attention function up by ``config._attn_implementation``
(Llama-family models in transformers 5.x do). Not thread-safe.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections import deque
from dataclasses import dataclass, field

import torch

from ringstream.daemon.attention import use_paged_attention
from ringstream.daemon.block_manager import DEFAULT_BLOCK_SIZE, BlockManager, block_hashes
from ringstream.daemon.detokenizer import IncrementalDetokenizer
from ringstream.daemon.engine_api import (
    FINISH_LENGTH,
    FINISH_STOP,
    GREEDY_TEMPERATURE_EPS,
    BaseEngine,
    CapacityError,
    EngineError,
    EngineRequest,
    PromptTooLong,
    RequestError,
    SamplingParams,
    TokenOutput,
    check_request,
)
from ringstream.daemon.families import configured_window, kv_shape, sliding_window, unsupported_feature
from ringstream.daemon.model import ModelError
from ringstream.daemon.rope import check_batch_independent, fix_rope_frequencies
from ringstream.daemon.kv_cache import PagedKVCache, build_metadata
from ringstream.daemon.memory import kv_cache_budget
from ringstream.daemon.sampler import SamplingTensors, sample, token_seed

__all__ = [
    "BaseEngine",
    "CapacityError",
    "Engine",
    "EngineError",
    "EngineRequest",
    "PromptTooLong",
    "RequestError",
    "SamplingParams",
    "TokenOutput",
]

log = logging.getLogger("ringstream.engine")

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
WATERMARK_FRACTION = 0.01
"""Admission leaves this fraction of the blocks free for running decodes (vLLM v0's watermark)."""
_WARMUP_PROMPT_LEN = 4
_WARMUP_MAX_TOKENS = 2
CHECK_TOKENS = 4
"""Decode steps of the start-up check against the model's own forward (:meth:`Engine._check_against_model`)."""
CHECK_FIRST_TOKEN = 3
CHECK_TOLERANCE = {True: 1e-3, False: 1e-1}
"""Largest logit difference allowed by that check, relative to the logits' scale: float32, then bf16/fp16
(reduced-precision kernels of different batch shapes round apart by up to a few 1e-2)."""


@dataclass(slots=True, eq=False)
class _Sequence:
    """Engine-side state of one unfinished request.

    ``token_ids`` are the prompt and the output so far; the first
    ``num_computed`` of them have KV in the pool. A running sequence in decode
    has ``num_computed == len(token_ids) - 1`` (its last sampled token is fed
    at the next step). ``handle`` is None for the internal warmup request.
    """

    seq_id: int
    handle: int | None
    request: EngineRequest
    token_ids: list[int]
    num_prompt_tokens: int
    max_output_tokens: int
    stop_token_ids: frozenset[int]
    user_stop_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    priority: int
    num_computed: int = 0
    started: int = 0
    running: bool = False
    hashes: list[bytes] = field(default_factory=list)


class Engine(BaseEngine):
    """Paged continuous-batching engine for one Hugging Face causal LM (see module docstring).

    Args:
        model: a ``transformers`` causal LM in eval mode, already on ``device``.
            It is switched to the engine's paged attention.
        tokenizer: the model's ``tokenizers.Tokenizer``.
        max_num_seqs: most requests running at once (batch rows), and the
            most requests waiting + running.
        max_model_len: most tokens (prompt + output) per request; defaults to
            ``config.max_position_embeddings`` and may not exceed it.
        max_num_batched_tokens: most new tokens (decodes plus prompt chunks)
            in one step's forward.
        block_size: token positions per KV-cache block.
        num_blocks: KV pool size in blocks, the null block included; default
            from ``kv_cache_bytes``, else from memory (:func:`ringstream.daemon.memory.kv_cache_budget`).
        kv_cache_bytes: KV pool size in bytes (all layers, keys and values).
        memory_utilization: fraction of the memory available after the
            weights and a profiling forward that the pool may take, when
            neither ``num_blocks`` nor ``kv_cache_bytes`` is given.
        enable_prefix_caching: share and keep KV blocks by prefix.
        eos_token_ids: EOS ids; default: the model's generation config, else its config.
        device: where the pool and index tensors live.
        seed: seed of the generator used by requests without their own seed.

    Raises:
        ModelError: the model has a feature the engine cannot serve exactly
            (named in the message; :func:`ringstream.daemon.families.unsupported_feature`).
        ValueError: a size out of range, or a pool that cannot hold one
            sequence of ``max_model_len`` tokens (the message gives the
            largest that fits).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        memory_utilization: float = 0.85,
        enable_prefix_caching: bool = True,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        config = model.config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        name = type(model).__name__
        max_positions = getattr(config, "max_position_embeddings", None)
        if max_model_len is None:
            max_model_len = max_positions
        problem = unsupported_feature(config, max_model_len or sys.maxsize, max_num_batched_tokens)
        if problem is None and not getattr(type(model), "_supports_attention_backend", False):
            problem = ("it does not route its attention through transformers' AttentionInterface (its layers run "
                       "their own attention and cache code)")
        if problem is None and not isinstance(max_positions, int):
            problem = "its config has no max_position_embeddings"
        if problem is not None:
            raise ModelError(f"{name} cannot be served exactly: {problem}")
        if not 2 <= max_model_len <= max_positions:
            raise ValueError(f"max_model_len must be in [2, {max_positions}], got {max_model_len}")
        for setting, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{setting} must be >= 1, got {value}")
        if max_num_batched_tokens < max_num_seqs:
            # Decodes go first: a budget below the batch would let the same rows take it every step.
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running request needs its token each step")

        self._model = model
        self._tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.vocab_size = config.vocab_size
        self.eos_token_ids = tuple(eos_token_ids) or _model_eos_token_ids(model, config)
        self.dtype = next(model.parameters()).dtype

        num_layers = config.num_hidden_layers
        try:
            num_kv_heads, head_dim, value_head_dim = kv_shape(config)
        except Exception as exc:  # e.g. transformers' AmbiguousGlobalPerLayerAttributeError
            raise ModelError(f"{name} cannot be served exactly: its key/value shape is not one per model "
                             f"(per-layer head_dim or kv heads: {exc})") from exc
        block_bytes = PagedKVCache.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim,
                                                   self.dtype.itemsize, value_head_dim)
        if num_blocks is None:
            if kv_cache_bytes is None:
                kv_cache_bytes = kv_cache_budget(model, self.device, max_num_batched_tokens, memory_utilization)
                # More blocks than every running sequence at full length only feed the prefix cache.
                most = -(-max_num_seqs * max_model_len // block_size) + 1
                num_blocks = min(most, kv_cache_bytes // block_bytes)
            else:
                num_blocks = kv_cache_bytes // block_bytes
        largest = max(num_blocks - 1, 0) * block_size
        if largest < max_model_len:
            needed = (-(-max_model_len // block_size) + 1) * block_bytes
            raise ValueError(
                f"the KV cache ({max(num_blocks - 1, 0)} usable blocks of {block_size} tokens, {block_bytes} bytes "
                f"each, plus the null block) cannot hold one sequence of max_model_len={max_model_len} tokens; the "
                f"largest that fits is {largest}: lower max_model_len, or give the KV cache at least {needed} bytes "
                f"(kv_cache_bytes, or more memory_utilization)"
            )
        try:
            for line in fix_rope_frequencies(model, max_model_len):
                log.info("%s", line)
            check_batch_independent(model, max_model_len)
        except ValueError as exc:
            raise ModelError(f"{name}: {exc}") from exc
        ignored = _ignored_generation_defaults(model)
        if ignored:
            log.warning("%s: generation_config.json asks generate() for %s; the engine applies only each "
                        "request's own sampling parameters, so its tokens differ from generate() with those "
                        "defaults", name, ", ".join(ignored))
        use_paged_attention(model)
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

        with torch.inference_mode():
            self._cache = PagedKVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, self.dtype,
                                       self.device, value_head_dim)
        self._blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._watermark = max(1, int(self._blocks.num_usable_blocks * WATERMARK_FRACTION))
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)

        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._by_handle: dict[int, _Sequence] = {}
        self._next_seq_id = 0
        self._next_start = 0
        self._num_random = 0
        self.num_preemptions = 0
        self._warmup_failure = ""
        self._captured: list[torch.Tensor] | None = None
        self._seen_windows: set = set()
        self._config = config

    # ------------------------------------------------------------ figures

    @property
    def kv_cache_tokens(self) -> int:
        """Token positions of the pool's usable blocks."""
        return self._blocks.num_usable_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes allocated for the KV pool (all layers, keys and values, the null block included)."""
        return self._cache.nbytes

    @property
    def num_blocks(self) -> int:
        return self._blocks.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1."""
        return self._blocks.usage

    @property
    def prefix_queries(self) -> int:
        return self._blocks.prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self._blocks.prefix_hits

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    # ------------------------------------------------------------ interface

    def add(self, req: EngineRequest) -> None:
        """Queue ``req``; it is admitted at a following ``step`` once its blocks are free.

        Raises:
            PromptTooLong: ``len(prompt) + len(output) >= max_model_len``.
            ValueError: empty prompt, token id outside ``[0, vocab_size)``,
                invalid sampling parameters, a handle already in use, or
                ``output_token_ids`` that already finish the request.
            CapacityError: ``max_num_seqs`` requests are already waiting or running.
        """
        if req.handle in self._by_handle:
            raise ValueError(f"handle {req.handle} is already in use")
        if len(self._waiting) + len(self._running) >= self.max_num_seqs:
            raise CapacityError(f"engine is full: {self.max_num_seqs} unfinished requests")
        seq = self._make_sequence(req.handle, req)
        self._by_handle[req.handle] = seq
        self._waiting.append(seq)

    def abort(self, handle: int) -> bool:
        """Drop request ``handle``, freeing its blocks at once; True if it was unfinished.

        No further output is produced for it.
        """
        seq = self._by_handle.get(handle)
        if seq is None:
            return False
        if seq.running:
            self._release(seq)
        else:
            self._waiting.remove(seq)
            del self._by_handle[handle]
        return True

    def step(self) -> list[TokenOutput | RequestError]:
        """Schedule within the token budget, run one forward, sample; see the module docstring.

        Returns the step's outputs: one ``TokenOutput`` per sequence that got a
        token, one ``RequestError`` per sequence that failed; [] when idle or
        when the step only prefilled prompt chunks.
        """
        outputs: list[TokenOutput | RequestError] = []
        with torch.inference_mode():
            scheduled = self._schedule()
            if scheduled:
                self._run(scheduled, outputs)
        return outputs

    def warmup(self) -> None:
        """Prefill and decode a tiny request (random sampling with top-k/top-p) and discard it.

        Raises:
            EngineError: the engine is not idle.
            ModelError: the warmup request failed, or the engine's logits differ
                from the model's own forward (:meth:`_check_against_model`).
        """
        if self.has_unfinished():
            raise EngineError("warmup needs an idle engine")
        params = SamplingParams(
            max_tokens=_WARMUP_MAX_TOKENS, temperature=1.0, top_p=0.9, top_k=2, seed=0, ignore_eos=True
        )
        prompt = [0] * max(1, min(_WARMUP_PROMPT_LEN, self.max_model_len - _WARMUP_MAX_TOKENS))
        seq = self._make_sequence(None, EngineRequest(handle=-1, prompt_token_ids=prompt, params=params))
        self._waiting.append(seq)
        produced = 0
        while self.has_unfinished():
            produced += len(self.step())
        if produced != seq.max_output_tokens:
            raise ModelError(f"{type(self._model).__name__} failed its warmup request ({self._warmup_failure}); "
                              "its layers do not work with the engine's cache and attention")
        self._check_against_model()
        self._blocks.reset_prefix_cache()
        self._blocks.prefix_queries = self._blocks.prefix_hits = 0

    def _check_against_model(self) -> None:
        """Refuse an architecture whose logits through the engine differ from its own forward.

        A prompt of a few blocks is prefilled in chunks and decoded for
        :data:`CHECK_TOKENS` tokens through the engine; the model's own eager
        forward (no cache) over the same tokens must give the same logits at
        every sampled position, within :data:`CHECK_TOLERANCE` of the logits'
        scale. This catches layers that bypass the engine's cache or attention
        (recurrent, stateful or custom attention code) before they serve wrong
        tokens.

        Raises:
            ModelError: the logits differ (naming by how much), or a configured
                sliding window never reaches the attention.
        """
        want = 2 * self.block_size + 3
        window = configured_window(self._config, self.max_model_len)
        if window is not None:  # past any window the config carries: its mask and its attention must agree
            want = max(want, window + 2 * self.block_size + 3)
        length = max(1, min(want, self.max_model_len - CHECK_TOKENS - 1))
        prompt = [(CHECK_FIRST_TOKEN + 7 * i) % self.vocab_size for i in range(length)]
        params = SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0, ignore_eos=True)
        seq = self._make_sequence(None, EngineRequest(handle=-1, prompt_token_ids=prompt, params=params))
        budget, self.max_num_batched_tokens = self.max_num_batched_tokens, max(1, length // 2)
        self._captured = []
        self._seen_windows = set()
        try:
            self._waiting.append(seq)
            while self.has_unfinished():
                self.step()
            got = torch.cat(self._captured).float()
        finally:
            self._captured = None
            self.max_num_batched_tokens = budget
        window = sliding_window(self._config, self.max_model_len)
        if window is not None and window not in self._seen_windows:
            raise ModelError(
                f"{type(self._model).__name__}: its config has sliding_window={window} but no layer passes it to the "
                "attention function (the window would be applied by a mask the engine does not build); serve it with "
                f"max_model_len <= {window}"
            )
        tokens = prompt + seq.request.output_token_ids[:-1]
        try:
            self._model.set_attn_implementation("eager")
            with torch.inference_mode():
                out = self._model(input_ids=torch.tensor([tokens], device=self.device), use_cache=False)
            want = out.logits[0, length - 1:].float()
        finally:
            use_paged_attention(self._model)
        tolerance = CHECK_TOLERANCE[self.dtype == torch.float32]
        diff = float((got - want).abs().max())
        scale = max(1.0, float(want.abs().max()))
        if got.shape != want.shape or not diff <= tolerance * scale:
            raise ModelError(
                f"{type(self._model).__name__}: logits through the engine differ from the model's own forward "
                f"(max |difference| {diff:.3g} at logit scale {scale:.3g}); its layers do not use the engine's "
                "cache and attention as it needs, so it cannot be served exactly"
            )

    # ------------------------------------------------------------ requests

    def _make_sequence(self, handle: int | None, req: EngineRequest) -> _Sequence:
        """Validate ``req`` and build its engine-side state."""
        params = req.params
        prompt = req.prompt_token_ids
        output = req.output_token_ids
        stop_ids, user_stop_ids = check_request(req, self.max_model_len, self.vocab_size, self.eos_token_ids)
        detokenizer = IncrementalDetokenizer(self._tokenizer, params.stop, prior_token_ids=output)
        if detokenizer.stop_string is not None:
            raise ValueError("output_token_ids already contain a stop string")
        greedy = params.temperature <= GREEDY_TEMPERATURE_EPS
        seeded = params.seed is not None and not greedy
        self._next_seq_id += 1
        return _Sequence(
            seq_id=self._next_seq_id,
            handle=handle,
            request=req,
            token_ids=list(prompt) + list(output),
            num_prompt_tokens=len(prompt),
            max_output_tokens=min(params.max_tokens, self.max_model_len - len(prompt)),
            stop_token_ids=stop_ids,
            user_stop_token_ids=user_stop_ids,
            detokenizer=detokenizer,
            generator=torch.Generator(device=self.device) if seeded else None,
            greedy=greedy,
            temperature=1.0 if greedy else float(params.temperature),
            top_k=params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size,
            top_p=float(params.top_p),
            priority=req.priority,
        )

    def _release(self, seq: _Sequence) -> None:
        """Free a running sequence's blocks and forget the request."""
        self._stop_running(seq)
        if seq.handle is not None:
            del self._by_handle[seq.handle]

    def _stop_running(self, seq: _Sequence) -> None:
        self._blocks.free(seq.seq_id)
        self._running.remove(seq)
        seq.running = False
        self._num_random -= not seq.greedy

    def _preempt(self, seq: _Sequence) -> None:
        """Recompute preemption: drop ``seq``'s KV and put it first in the waiting queue."""
        self._stop_running(seq)
        seq.num_computed = 0
        self._waiting.appendleft(seq)
        self.num_preemptions += 1
        log.debug("request %s preempted after %d tokens: KV cache full", seq.handle, len(seq.token_ids))

    # ------------------------------------------------------------ scheduling

    def _schedule(self) -> dict[_Sequence, int]:
        """Choose this step's sequences and their new-token counts (decodes, running chunks, then admissions)."""
        scheduled: dict[_Sequence, int] = {}
        budget = self.max_num_batched_tokens
        for decode in (True, False):
            for seq in list(self._running):
                if budget == 0:
                    return scheduled
                remaining = len(seq.token_ids) - seq.num_computed
                if not seq.running or (remaining == 1) != decode:
                    continue
                num_new = min(remaining, budget)
                refund = self._reserve(seq, seq.num_computed + num_new, scheduled)
                budget += refund
                if seq.running:
                    scheduled[seq] = num_new
                    budget -= num_new
        blocks = self._blocks
        while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            num_tokens = len(seq.token_ids)
            hashes = self._block_hashes(seq)
            reserve = self._watermark if self._running else 0
            if not blocks.can_allocate(num_tokens + reserve * self.block_size, hashes, num_tokens - 1):
                break
            seq.num_computed = blocks.allocate(seq.seq_id, num_tokens, hashes, num_tokens - 1)
            self._waiting.popleft()
            seq.running = True
            seq.started = self._next_start
            self._next_start += 1
            self._running.append(seq)
            self._num_random += not seq.greedy
            num_new = min(num_tokens - seq.num_computed, budget)
            scheduled[seq] = num_new
            budget -= num_new
        return scheduled

    def _reserve(self, seq: _Sequence, num_tokens: int, scheduled: dict[_Sequence, int]) -> int:
        """Make ``seq`` hold ``num_tokens`` positions, preempting others while blocks run out.

        Victims: the least urgent (highest ``priority``), most recently started
        running sequence, possibly ``seq`` itself. Returns the budget freed by
        victims that were already scheduled this step.
        """
        refund = 0
        while not self._blocks.append_slots(seq.seq_id, num_tokens):
            victim = max(self._running, key=lambda s: (s.priority, s.started))
            self._preempt(victim)
            refund += scheduled.pop(victim, 0)
            if victim is seq:
                break
        return refund

    def _block_hashes(self, seq: _Sequence) -> list[bytes]:
        """Prefix keys of ``seq``'s full blocks (extended as a resumed sequence grows)."""
        if not self.enable_prefix_caching:
            return []
        full = len(seq.token_ids) // self.block_size
        if len(seq.hashes) < full:
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes += block_hashes(seq.token_ids[:full * self.block_size], self.block_size, len(seq.hashes),
                                       parent)
        return seq.hashes

    # ------------------------------------------------------------ execution

    def _run(self, scheduled: dict[_Sequence, int], outputs: list) -> None:
        """Execute the step; on failure run each sequence alone and end those that still fail."""
        items = list(scheduled.items())
        try:
            tokens = self._execute(items)
        except Exception as exc:
            if len(items) == 1:
                self._fail(items[0][0], exc, outputs)
                return
            log.warning("a step of %d sequences failed (%s: %s); running each alone", len(items),
                        type(exc).__name__, exc)
            for item in items:
                try:
                    token = self._execute([item])
                except Exception as alone_exc:
                    self._fail(item[0], alone_exc, outputs)
                    continue
                self._advance([item], token, outputs)
            return
        self._advance(items, tokens, outputs)

    def _execute(self, items: list[tuple[_Sequence, int]]) -> list[int]:
        """One forward over the packed new tokens of ``items``; the sampled token of each completing sequence."""
        decodes, prefills, input_ids, positions, rows, sampled = [], [], [], [], [], []
        for seq, num_new in items:
            if num_new == 1:
                pos = seq.num_computed
                decodes.append((self._blocks.block_table(seq.seq_id), pos))
                input_ids.append(seq.token_ids[pos])
                positions.append(pos)
                if pos + 1 == len(seq.token_ids):
                    rows.append(len(decodes) - 1)
                    sampled.append(seq)
        row = len(decodes)
        for seq, num_new in items:
            if num_new > 1:
                start = seq.num_computed
                prefills.append((self._blocks.block_table(seq.seq_id), start, num_new))
                input_ids += seq.token_ids[start:start + num_new]
                positions += range(start, start + num_new)
                row += num_new
                if start + num_new == len(seq.token_ids):
                    rows.append(row - 1)
                    sampled.append(seq)
        device = self.device
        meta = build_metadata(decodes, prefills, self.block_size, device)
        meta.scratch = self._cache.scratch(meta.max_gather_blocks)
        if self._captured is not None:
            meta.seen_windows = self._seen_windows
        self._cache.slot_mapping = meta.slot_mapping
        out = self._model(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            use_cache=True,
            logits_to_keep=torch.tensor(rows, dtype=torch.long, device=device),
            paged=meta,
            **{self._cache_kwarg: self._cache},
        )
        if not sampled:
            return []
        logits = out.logits[0]
        if self._captured is not None:
            self._captured.append(logits.detach().clone())
        if any(not seq.greedy for seq in sampled):
            tokens = sample(logits, self._sampling_tensors(sampled))
        else:
            tokens = logits.argmax(dim=-1)
        # Keep order with ``items``: map each sampled sequence to its token.
        by_seq = dict(zip(sampled, tokens.tolist()))
        return [by_seq.get(seq) for seq, _ in items]

    def _advance(self, items: list[tuple[_Sequence, int]], tokens: list, outputs: list) -> None:
        """Account the computed tokens, register full blocks in the prefix cache, emit sampled tokens."""
        caching = self.enable_prefix_caching
        for (seq, num_new), token in zip(items, tokens or [None] * len(items)):
            seq.num_computed += num_new
            if caching:
                self._blocks.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed)
            if token is not None:
                self._append_token(seq, token, outputs)

    def _fail(self, seq: _Sequence, exc: Exception, outputs: list) -> None:
        log.error("request %s failed in a step: %s: %s", seq.handle, type(exc).__name__, exc, exc_info=exc)
        handle = seq.handle
        self._release(seq)
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        if handle is None:
            self._warmup_failure = message
        else:
            outputs.append(RequestError(handle, message))

    def _sampling_tensors(self, batch: list[_Sequence]) -> SamplingTensors:
        device = self.device
        top_k = [seq.top_k for seq in batch]
        top_p = [seq.top_p for seq in batch]
        return SamplingTensors(
            temperature=torch.tensor([seq.temperature for seq in batch], dtype=torch.float32, device=device),
            greedy=torch.tensor([seq.greedy for seq in batch], dtype=torch.bool, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            all_greedy=False,
            any_greedy=any(seq.greedy for seq in batch),
            use_top_k=any(k < self.vocab_size for k in top_k),
            use_top_p=any(p < 1.0 for p in top_p),
            seeded_rows=[(i, self._seed_generator(seq)) for i, seq in enumerate(batch) if seq.generator is not None],
            generator=self._generator,
        )

    @staticmethod
    def _seed_generator(seq: _Sequence) -> torch.Generator:
        """Seed ``seq``'s generator for its next output token and return it."""
        seq.generator.manual_seed(token_seed(seq.request.params.seed, len(seq.request.output_token_ids)))
        return seq.generator

    def _append_token(self, seq: _Sequence, token_id: int, outputs: list) -> None:
        """Record a sampled token, apply the stop conditions, emit its ``TokenOutput``.

        Order of checks (vLLM's): EOS / stop token, then stop string, then
        length (``max_tokens`` or the context limit).
        """
        output_ids = seq.request.output_token_ids
        output_ids.append(token_id)
        seq.token_ids.append(token_id)
        num_output = len(output_ids)
        detokenizer = seq.detokenizer
        finish_reason = None
        stop_reason = None
        if token_id in seq.stop_token_ids:
            finish_reason = FINISH_STOP
            if token_id in seq.user_stop_token_ids:
                stop_reason = token_id
            text = detokenizer.flush()
        else:
            text = detokenizer.add_token(token_id)
            if detokenizer.stop_string is not None:
                finish_reason = FINISH_STOP
                stop_reason = detokenizer.stop_string
            elif num_output >= seq.max_output_tokens:
                finish_reason = FINISH_LENGTH
                text += detokenizer.flush()
        if finish_reason is None:
            outputs.append(TokenOutput(seq.handle, num_output - 1, token_id, text))
            return
        outputs.append(TokenOutput(seq.handle, num_output - 1, token_id, text, finish_reason, stop_reason,
                                   seq.num_prompt_tokens, num_output))
        self._release(seq)


GENERATION_DEFAULTS_IGNORED = {
    "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
    "suppress_tokens": None, "begin_suppress_tokens": None, "bad_words_ids": None, "min_length": 0,
    "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None,
}
"""Logits processors a checkpoint's ``generation_config.json`` may switch on for ``generate()`` (with their
neutral values); the engine does not apply them, and says so at start."""


def _ignored_generation_defaults(model) -> list[str]:
    config = getattr(model, "generation_config", None)
    if config is None:
        return []
    return [f"{key}={getattr(config, key)!r}" for key, neutral in GENERATION_DEFAULTS_IGNORED.items()
            if getattr(config, key, neutral) not in (neutral, None)]


def _model_eos_token_ids(model, config) -> tuple[int, ...]:
    """EOS ids from the model's generation config, else its config; () if neither has one."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(eos)
