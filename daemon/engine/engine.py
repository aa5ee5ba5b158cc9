"""Paged continuous-batching engine over a Hugging Face causal LM.

Requests join the running batch at the next step and leave the moment they
finish (continuous batching: Orca, Yu et al., OSDI 2022; vLLM). Their keys and
values live in a paged pool (:mod:`ringstream.daemon.engine.kv_cache`) of fixed-size blocks that
:class:`ringstream.daemon.engine.block_manager.BlockManager` hands out as sequences grow, shares
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
   context through its block table (:mod:`ringstream.daemon.engine.attention`), so no row pays
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

Parts: :mod:`ringstream.daemon.engine.scheduler` chooses each step's
sequences and their token counts and applies the step's results (steps 1 and
2, the stop checks of 4); :mod:`ringstream.daemon.engine.model_runner` builds the
input tensors, runs the forward and samples (3, 4);
:mod:`ringstream.daemon.engine.checks` holds what is refused at start. This
module validates requests, owns the parts and runs a failed step's sequences
alone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

import torch

from ringstream.daemon.engine.attention import use_paged_attention
from ringstream.daemon.engine.block_manager import BlockManager
from ringstream.daemon.engine.structured import GrammarCompiler
from ringstream.daemon.engine.detokenizer import IncrementalDetokenizer
from ringstream.daemon.engine.interface import (ENGINE_DEFAULTS, GREEDY_TEMPERATURE_EPS, BaseEngine, CapacityError,
                                                EngineConfig, EngineError, EngineRequest, EngineStats, PromptTooLong,
                                                RequestError, SamplingParams, TokenOutput, check_request)
from ringstream.daemon.engine.checks import check_against_model, check_model, ignored_generation_defaults, kv_layout
from ringstream.daemon.engine.scheduler import SequenceState, StepScheduler
from ringstream.daemon.engine.step_budget import (StepBudget, default_max_step_ms, default_min_chunk_tokens,
                                                  default_prefill_burst_ratio)
from ringstream.daemon.common.model_dir import ModelRefused
from ringstream.daemon.engine.rope import check_batch_independent, fix_rope_frequencies
from ringstream.daemon.engine.kernels import native_ops
from ringstream.daemon.engine.kv_cache import PagedKVCache
from ringstream.daemon.engine.fused import fuse_attention, fuse_elementwise
from ringstream.daemon.engine.linear import pack_linears
from ringstream.daemon.engine.memory import pool_blocks
from ringstream.daemon.engine.model_runner import ModelRunner

__all__ = ["ENGINE_DEFAULTS", "BaseEngine", "EngineConfig", "CapacityError", "Engine", "EngineError", "EngineRequest",
           "PromptTooLong", "RequestError", "SamplingParams", "TokenOutput"]

log = logging.getLogger("ringstream.engine")

COMPILE_POLL_S = 0.002
"""How long an idle step waits for a matcher being built, seconds (then the worker reads its commands again)."""
_WARMUP_PROMPT_LEN = 4
_WARMUP_MAX_TOKENS = 2
CALIBRATION_TOKENS = 256
"""Prompt tokens of each start-up step that measures a prompt token's cost (the step budget's first estimate)."""
CALIBRATION_DEPTH = 1024
"""Where the start-up calibration's last prompt chunk starts in its prompt, at most (positions)."""
CALIBRATION_RUNS = 2
"""Times the start-up calibration runs; the step budget starts from the fastest time of each step."""


class Engine(BaseEngine):
    """Paged continuous-batching engine for one Hugging Face causal LM (see module docstring).

    Args:
        model: a ``transformers`` causal LM in eval mode, already on ``config.device``.
            It is switched to the engine's paged attention.
        tokenizer: the model's ``tokenizers.Tokenizer``.
        config: the engine settings (:class:`EngineConfig`: batch rows, token budget, KV pool size, block size,
            prefix caching, device, seed); ``max_model_len`` None means ``max_position_embeddings``, which it
            may not exceed; the pool is sized from ``num_blocks``, else ``kv_cache_bytes``, else memory
            (:func:`ringstream.daemon.engine.memory.kv_cache_budget`).
        eos_token_ids: EOS ids; default: the model's generation config, else its config.

    Raises:
        ModelRefused: the model has a feature the engine cannot serve exactly
            (named in the message; :func:`ringstream.daemon.engine.families.unsupported_feature`).
        ValueError: a setting out of range, or a pool that cannot hold one
            sequence of ``max_model_len`` tokens (the message gives the
            largest that fits).
    """

    def __init__(self, model, tokenizer, config: EngineConfig = ENGINE_DEFAULTS, *,
                 eos_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        config.check()
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.max_model_len = check_model(model, text_config, config)
        self._model = model
        self._tokenizer = tokenizer
        self._config = text_config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.vocab_size = text_config.vocab_size
        self.eos_token_ids = tuple(eos_token_ids) or _model_eos_token_ids(model, text_config)
        self.dtype = next(model.parameters()).dtype
        self.enable_prefix_caching = config.enable_prefix_caching
        native = None
        if config.native_kernels and self.device.type == "cpu":
            native = native_ops()
            pack_linears(model, native)  # before the memory profile: the packed weights replace the stored ones
            if native is not None:
                fuse_elementwise(model, native)
                fuse_attention(model, native)
        kv_heads, head_dim, value_head_dim = kv_layout(model, text_config)
        if native is not None:  # prompt chunks' kernel: AVX-512 and head sizes that are multiples of 16
            prefill = "native" if native.paged_prefill_supported(head_dim, value_head_dim) else "PyTorch SDPA"
            log.info("native CPU kernels in use (prompt-chunk attention: %s)", prefill)
        num_blocks = pool_blocks(model, config, self.max_model_len, self.device,
                                 PagedKVCache.bytes_per_block(text_config.num_hidden_layers, config.block_size,
                                                              kv_heads, head_dim, self.dtype.itemsize, value_head_dim))
        self._prepare_model(model)
        with torch.inference_mode():
            self._cache = PagedKVCache(text_config.num_hidden_layers, num_blocks, config.block_size, kv_heads,
                                       head_dim, self.dtype, self.device, value_head_dim)
        self._blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self._scheduler = StepScheduler(self._blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self._runner = ModelRunner(model, self._cache, self._blocks, vocab_size=self.vocab_size, device=self.device,
                                   seed=config.seed, native=native)
        max_step_ms = config.max_step_ms if config.max_step_ms is not None else default_max_step_ms(self.device.type)
        self._budget = (StepBudget(max_step_ms, config.max_num_batched_tokens,
                                   default_min_chunk_tokens(self.device.type)) if max_step_ms > 0 else None)
        self._scheduler.chunk_limit = self._budget.chunk_tokens if self._budget is not None else None
        burst_ratio = config.prefill_burst_ratio
        if burst_ratio is None:
            burst_ratio = default_prefill_burst_ratio(self.device.type) if self._budget is not None else 0.0
        self._scheduler.burst_ratio = burst_ratio
        if burst_ratio and self._budget is None:
            log.warning("prefill_burst_ratio has no effect with max_step_ms = 0: no time bound to lift")
        self._next_seq_id = 0
        self._warmup_failure = ""
        self._grammars = GrammarCompiler(tokenizer, self.vocab_size,
                                         self.eos_token_ids[0] if self.eos_token_ids else None)
        self._compiling: dict[int, tuple[SequenceState, concurrent.futures.Future]] = {}
        """Constrained requests whose matchers are being built, by handle (not yet in the scheduler)."""

    def _prepare_model(self, model) -> None:
        """Fix RoPE for ``max_model_len``, check batch independence, switch to paged attention."""
        name = type(model).__name__
        try:
            for line in fix_rope_frequencies(model, self.max_model_len):
                log.info("%s", line)
            check_batch_independent(model, self.max_model_len)
        except ValueError as exc:
            raise ModelRefused(f"{name}: {exc}") from exc
        ignored = ignored_generation_defaults(model)
        if ignored:
            log.warning("%s: generation_config.json asks generate() for %s; the engine applies only each "
                        "request's own sampling parameters, so its tokens differ from generate() with those "
                        "defaults", name, ", ".join(ignored))
        use_paged_attention(model)

    # ------------------------------------------------------------ figures

    @property
    def max_num_seqs(self) -> int:
        """Most requests running at once, and most waiting + running."""
        return self._scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        """Most new tokens (decodes plus prompt chunks) in one step's forward."""
        return self._scheduler.max_num_batched_tokens

    @property
    def kv_cache_tokens(self) -> int:
        """Token positions of the pool's usable blocks."""
        return self._blocks.num_usable_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes allocated for the KV pool (all layers, keys and values, the null block included)."""
        return self._cache.nbytes

    def stats(self) -> EngineStats:
        """A snapshot of the running/waiting requests, the KV blocks and the preemption and prefix-cache counters."""
        blocks, scheduler = self._blocks, self._scheduler
        return EngineStats(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting) + len(self._compiling),
                           num_blocks=blocks.num_usable_blocks, num_free_blocks=blocks.num_free_blocks,
                           num_preemptions=scheduler.num_preemptions, prefix_queries=blocks.prefix_queries,
                           prefix_hits=blocks.prefix_hits)

    def has_unfinished(self) -> bool:
        return self._scheduler.has_unfinished() or bool(self._compiling)

    # ------------------------------------------------------------ interface

    def add(self, req: EngineRequest) -> None:
        """Queue ``req``; it is admitted at a following ``step`` once its blocks are free.

        Raises:
            PromptTooLong: ``len(prompt) + len(output) >= max_model_len``.
            ValueError: empty prompt, token id outside ``[0, vocab_size)``,
                invalid sampling parameters, a handle already in use, or
                ``output_token_ids`` that already finish the request.
            CapacityError: ``max_num_seqs`` requests are already waiting or running.

        A request with an output constraint waits for its matcher, built on the compile thread
        (:meth:`GrammarCompiler.submit`); a constraint that does not compile ends it at a following ``step``
        with a :class:`RequestError` marked ``invalid``.
        """
        scheduler = self._scheduler
        if req.handle in scheduler.by_handle or req.handle in self._compiling:
            raise ValueError(f"handle {req.handle} is already in use")
        if len(scheduler.waiting) + len(scheduler.running) + len(self._compiling) >= scheduler.max_num_seqs:
            raise CapacityError(f"engine is full: {scheduler.max_num_seqs} unfinished requests")
        seq = self._make_sequence(req.handle, req, defer_matcher=True)
        constraint = req.params.structured_outputs
        if constraint is None:
            scheduler.add(seq)
        else:
            self._grammars.precheck(constraint)
            self._compiling[req.handle] = (seq, self._grammars.submit(constraint, req.output_token_ids))

    def abort(self, handle: int) -> bool:
        """Drop request ``handle``, freeing its blocks at once; True if it was unfinished.

        No further output is produced for it.
        """
        compiling = self._compiling.pop(handle, None)
        if compiling is not None:
            compiling[1].cancel()
            return True
        return self._scheduler.abort(handle)

    def _admit_compiled(self, outputs: list) -> None:
        """Queue the constrained requests whose matchers are ready; end those whose constraint failed. When
        nothing else can run, wait a little for a compile (instead of spinning the step loop)."""
        compiling = self._compiling
        if not self._scheduler.has_unfinished() and not any(f.done() for _, f in compiling.values()):
            concurrent.futures.wait([f for _, f in compiling.values()], COMPILE_POLL_S,
                                    concurrent.futures.FIRST_COMPLETED)
        for handle, (seq, future) in list(compiling.items()):
            if not future.done():
                continue
            del compiling[handle]
            try:
                seq.matcher = future.result()
            except ValueError as exc:
                outputs.append(RequestError(handle, str(exc), invalid=True))
            except Exception as exc:
                outputs.append(RequestError(handle, f"structured_outputs: {type(exc).__name__}: {exc}"))
            else:
                self._scheduler.add(seq)

    def step(self) -> list[TokenOutput | RequestError]:
        """Schedule within the token budget, run one forward, sample; see the module docstring.

        Returns the step's outputs: one ``TokenOutput`` per sequence that got a
        token, one ``RequestError`` per sequence that failed; [] when idle or
        when the step only prefilled prompt chunks.
        """
        outputs: list[TokenOutput | RequestError] = []
        if self._compiling:
            self._admit_compiled(outputs)
        with torch.inference_mode():
            scheduled = self._scheduler.schedule()
            if scheduled:
                started = time.perf_counter()
                self._run(scheduled, outputs)
                if self._budget is not None:
                    self._budget.observe_step(scheduled, time.perf_counter() - started)
        return outputs

    def record_kv_events(self) -> None:
        if self.enable_prefix_caching:
            self._blocks.record_events()

    def take_kv_events(self) -> list:
        return self._blocks.take_events()

    def warmup(self) -> None:
        """Prefill and decode a tiny request (random sampling with top-k/top-p) and discard it.

        Raises:
            EngineError: the engine is not idle.
            ModelRefused: the warmup request failed, or the engine's logits differ
                from the model's own forward
                (:func:`ringstream.daemon.engine.checks.check_against_model`).
        """
        if self.has_unfinished():
            raise EngineError("warmup needs an idle engine")
        params = SamplingParams(
            max_tokens=_WARMUP_MAX_TOKENS, temperature=1.0, top_p=0.9, top_k=2, seed=0, ignore_eos=True
        )
        prompt = [0] * max(1, min(_WARMUP_PROMPT_LEN, self.max_model_len - _WARMUP_MAX_TOKENS))
        seq = self._make_sequence(None, EngineRequest(handle=-1, prompt_token_ids=prompt, params=params))
        self._scheduler.add(seq)
        produced = 0
        while self.has_unfinished():
            produced += len(self.step())
        if produced != seq.max_output_tokens:
            raise ModelRefused(f"{type(self._model).__name__} failed its warmup request ({self._warmup_failure}); "
                              "its layers do not work with the engine's cache and attention")
        check_against_model(self._model, self._config, self._traced_run, block_size=self.block_size,
                            max_model_len=self.max_model_len, vocab_size=self.vocab_size, device=self.device,
                            dtype=self.dtype)
        if self._budget is not None:
            self._calibrate_step_budget()
        self._blocks.reset_prefix_cache()
        self._blocks.prefix_queries = self._blocks.prefix_hits = 0

    def _calibrate_step_budget(self) -> None:
        """Time the first and the last prompt chunk and one decode step of an internal request, twice (other
        prompts, so no prefix hit), and give the step budget the faster of each as its start values. The last
        chunk starts :data:`CALIBRATION_DEPTH` positions in where the context allows (its attention pairs, less
        the first chunk's, give a pair's cost: measured over 256 positions, the native prefill attention's
        cost per pair came out a quarter to a third of its cost over 1,024-3,840); the faster of two keeps a hiccup of the host out of the start values."""
        scheduler = self._scheduler
        chunks = 2 if self.max_model_len >= 5 else 1  # two chunks of a token and two output tokens fit in 4 + 1
        length = max(1, min(CALIBRATION_TOKENS, scheduler.max_num_batched_tokens, (self.max_model_len - 3) // chunks))
        chunks = max(chunks, min(CALIBRATION_DEPTH // length + 1, (self.max_model_len - 3) // length))
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        limit, scheduler.chunk_limit = scheduler.chunk_limit, None
        budget, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, length
        best: list[float] = []
        try:
            for run in range(CALIBRATION_RUNS):
                prompt = [3 + (i + run) % max(self.vocab_size - 3, 1) for i in range(chunks * length)]
                scheduler.add(self._make_sequence(None, EngineRequest(handle=-1, prompt_token_ids=prompt,
                                                                      params=params)))
                times = []
                while self.has_unfinished():
                    started = time.perf_counter()
                    self.step()
                    times.append(time.perf_counter() - started)
                if len(times) != chunks + 1:  # not the prompt in its chunks, then one decode step
                    return
                best = [min(pair) for pair in zip(best, times)] if best else times
        finally:
            scheduler.chunk_limit = limit
            scheduler.max_num_batched_tokens = budget
        step_budget = self._budget
        step_budget.calibrate(decode_step_s=best[-1], prompt_tokens=length, prompt_step_s=best[0],
                              second_chunk_s=best[-2] if chunks > 1 else None, second_start=(chunks - 1) * length)
        burst = self._scheduler.burst_ratio
        log.info("step budget: %s%s", step_budget.describe(),
                 f"; prefill bursts when prompts >= {burst:g} x decodes (prefill_burst_ratio)" if burst else "")

    def _traced_run(self, prompt: list[int], params: SamplingParams,
                    max_num_batched_tokens: int) -> tuple[list[int], torch.Tensor, set]:
        """Serve one internal request alone with a step budget of ``max_num_batched_tokens`` (idle engine).

        Returns its output token ids, the logits of every position it sampled
        (float32, ``[sampled positions, vocab]``) and the sliding windows its
        attention calls were given.
        """
        seq = self._make_sequence(None, EngineRequest(handle=-1, prompt_token_ids=prompt, params=params))
        scheduler, runner = self._scheduler, self._runner
        budget, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, max_num_batched_tokens
        limit, scheduler.chunk_limit = scheduler.chunk_limit, None
        runner.captured = []
        runner.seen_windows = set()
        try:
            scheduler.add(seq)
            while self.has_unfinished():
                self.step()
            got = torch.cat(runner.captured).float()
        finally:
            runner.captured = None
            scheduler.max_num_batched_tokens = budget
            scheduler.chunk_limit = limit
        return seq.request.output_token_ids, got, runner.seen_windows

    # ------------------------------------------------------------ requests

    def _make_sequence(self, handle: int | None, req: EngineRequest, defer_matcher: bool = False) -> SequenceState:
        """Validate ``req`` and build its engine-side state (its matcher too, unless ``defer_matcher``: the
        caller builds it off the step loop)."""
        params = req.params
        prompt = req.prompt_token_ids
        output = req.output_token_ids
        stop_ids, user_stop_ids = check_request(req, self.max_model_len, self.vocab_size, self.eos_token_ids)
        detokenizer = IncrementalDetokenizer(self._tokenizer, params.stop, prior_token_ids=output,
                                             min_tokens=params.min_tokens)
        if detokenizer.stop_string is not None:
            raise ValueError("output_token_ids already contain a stop string")
        greedy = params.temperature <= GREEDY_TEMPERATURE_EPS
        seeded = params.seed is not None and not greedy
        constraint = params.structured_outputs
        matcher = self._grammars.matcher(constraint, output) if constraint is not None and not defer_matcher \
            else None
        self._next_seq_id += 1
        return SequenceState(
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
            processed=(params.penalized or params.min_p > 0.0 or params.min_tokens > len(output)
                       or params.logprobs is not None or params.prompt_logprobs is not None
                       or constraint is not None),
            want_prompt_logprobs=params.prompt_logprobs is not None and not output,
            matcher=matcher,
        )

    # ------------------------------------------------------------ execution

    def _run(self, scheduled: dict[SequenceState, int], outputs: list) -> None:
        """Execute the step; on failure run each sequence alone and end those that still fail."""
        items = list(scheduled.items())
        try:
            tokens = self._runner.execute(items)
        except Exception as exc:
            if len(items) == 1:
                self._fail(items[0][0], exc, outputs)
                return
            log.warning("a step of %d sequences failed (%s: %s); running each alone", len(items),
                        type(exc).__name__, exc)
            for item in items:
                try:
                    token = self._runner.execute([item])
                except Exception as alone_exc:
                    self._fail(item[0], alone_exc, outputs)
                    continue
                self._scheduler.advance([item], token, outputs)
            return
        self._scheduler.advance(items, tokens, outputs)

    def _fail(self, seq: SequenceState, exc: Exception, outputs: list) -> None:
        log.error("request %s failed in a step: %s: %s", seq.handle, type(exc).__name__, exc, exc_info=exc)
        handle = seq.handle
        self._scheduler.release(seq)
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        if handle is None:
            self._warmup_failure = message
        else:
            outputs.append(RequestError(handle, message))


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
