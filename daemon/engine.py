"""Slot-based continuous-batching generation engine over a static KV cache.

The engine owns one Hugging Face causal LM and a preallocated KV cache with
``max_num_seqs`` rows ("slots"). A request is admitted into a free slot, its
prompt is prefilled, and from then on it decodes one token per engine step in a
batch with every other running request. It leaves the batch the step it
finishes and its slot is free for the next waiting request at once, so the
batch composition changes every step (continuous batching, as in Orca, Yu et
al., OSDI 2022, and vLLM) instead of waiting for a whole batch to end, which
is what ``model.generate`` on a padded batch does.

One ``step()``:

1. Decode: one forward of ``input_ids [m, 1]`` over the slot rows
   ``[lo, hi)`` between the lowest and the highest occupied slot, for every
   running request (each has one sampled token whose KV is not yet cached: the
   "pending" token). Row ``r`` writes its key/value at cache column
   ``length[r]`` and attends columns ``[0, length[r]]``. Free rows inside the
   range are computed too (cheaper than gathering the batch, and the cache
   views stay copy-free): they write to a trash column and attend column 0
   only. Slots are always taken lowest-first, so the range stays compact.
2. Admit + prefill: waiting requests (FIFO) take free slots, including the
   slots that requests finishing in step 1 just released, and are prefilled
   in one left-padded batch, bounded by ``max_num_batched_tokens`` padded
   tokens. Their first token is sampled in this step; they join the decode
   batch at the next step.

Decode runs before admission (rather than after) so that a slot freed by a
request finishing this step is reused in the same step, and so that each
request gets exactly one token per step.

Every request therefore yields exactly one ``TokenOutput`` per step while it
runs; the output with a non-None ``finish_reason`` is its last.

Numerics: each row of a batch sees exactly its own keys (other rows and padding
are masked with ``-inf`` and contribute exact zeros) and positions are per
row, so a row's logits depend on its batch companions only through float
rounding of the batched kernels (measured: at most 4e-6 on float32 logits,
against top-1/top-2 gaps above 1e-4). In float32, greedy outputs equal
``model.generate`` on the prompt alone token for token. In bfloat16 / float16
that rounding is large enough to flip near-tied tokens, as with any batched
inference.

The model must call ``cache.update(key_states, value_states, layer_idx, ...)``
from its attention layers and accept a 4-D additive ``attention_mask`` as-is
(Llama-family models in transformers 5.x do). The engine is not thread-safe:
call all methods from one thread.
"""

from __future__ import annotations

import abc
import heapq
from collections import deque
from dataclasses import dataclass, field

import torch

from daemon.attention import use_decode_attention
from daemon.detokenizer import IncrementalDetokenizer
from daemon.sampler import SamplingTensors, sample, token_seed

__all__ = [
    "BaseEngine",
    "CapacityError",
    "Engine",
    "EngineError",
    "EngineRequest",
    "SamplingParams",
    "SlotKVCache",
    "TokenOutput",
]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Temperatures at or below this are treated as greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5
# Token id fed at padding positions and in free decode rows. Any in-vocabulary
# id works: those positions are masked out and their KV goes to the trash column.
_FILLER_TOKEN_ID = 0
_WARMUP_PROMPT_LEN = 4
_WARMUP_MAX_TOKENS = 2


@dataclass(slots=True)
class SamplingParams:
    """How to pick and when to stop generating tokens for one request.

    Attributes:
        max_tokens: maximum number of output tokens (>= 1), counting tokens of
            a resumed request generated before the resume.
        temperature: logit divisor; 0 means greedy (argmax).
        top_p: nucleus mass kept, in (0, 1]; 1.0 disables it.
        top_k: number of most likely tokens kept; 0 disables it.
        seed: per-request seed; the same seed and prompt give the same tokens
            whatever else is batched with the request, and a resumed request
            continues the same tokens (the generator is reseeded per output
            token from ``(seed, seq)``). None uses the engine's generator.
        stop: stop strings; the output text ends right before the first one to
            appear, which is not included.
        stop_token_ids: token ids that end the request (included in the output
            token ids, contributing no text).
        ignore_eos: keep generating past the model's EOS token(s).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(slots=True)
class EngineRequest:
    """One generation request.

    Attributes:
        handle: caller-chosen id, unique among the engine's unfinished requests.
        prompt_token_ids: the prompt, already tokenized (BOS included if the
            model expects one).
        params: sampling and stop parameters.
        output_token_ids: tokens already generated. On ``add`` they are
            prefilled together with the prompt and generation continues with
            ``seq = len(output_token_ids)``; the detokenizer state is rebuilt so
            no text is repeated. The engine appends each new token to this list.
    """

    handle: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class TokenOutput:
    """One generated token of one request (one per running request per step).

    Attributes:
        handle: the request's handle.
        seq: 0-based index of this token in the request's output.
        token_id: the token.
        text: text delta, whole UTF-8 characters only (may be "").
        finish_reason: "stop" or "length" on the request's last token, else None.
        stop_reason: the stop string or ``stop_token_ids`` entry that ended the
            request; None for EOS and for "length" (vLLM's convention).
        num_prompt_tokens: prompt length, on the last output only.
        num_output_tokens: output length, on the last output only.
    """

    handle: int
    seq: int
    token_id: int
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


class EngineError(Exception):
    """Base class of engine errors."""


class CapacityError(EngineError):
    """The engine already holds ``max_num_seqs`` unfinished requests."""


def check_request(req: EngineRequest, max_model_len: int, vocab_size: int,
                  eos_token_ids: tuple[int, ...]) -> tuple[frozenset[int], frozenset[int]]:
    """Check what every engine requires of a request; return ``(stop_token_ids, user_stop_token_ids)``.

    ``stop_token_ids`` adds ``eos_token_ids`` to the request's own unless it
    ignores EOS. Raises ValueError for an empty prompt, a token id outside
    ``[0, vocab_size)``, ``len(prompt) + len(output) >= max_model_len``,
    ``max_tokens < 1``, a temperature below 0 (or NaN), ``top_p`` outside
    ``(0, 1]``, ``top_k < 0``, or ``output_token_ids`` (a resumed request)
    that already hold ``max_tokens`` tokens or end with a stop token.
    """
    params = req.params
    prompt = req.prompt_token_ids
    output = req.output_token_ids
    if not prompt:
        raise ValueError("prompt_token_ids is empty")
    if len(prompt) + len(output) >= max_model_len:
        raise ValueError(
            f"prompt ({len(prompt)}) + output ({len(output)}) tokens leave no room within max_model_len={max_model_len}"
        )
    if min(min(prompt), min(output, default=0)) < 0 or max(max(prompt), max(output, default=0)) >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    if len(output) >= params.max_tokens:
        raise ValueError(f"output_token_ids already hold max_tokens={params.max_tokens} tokens")
    if not params.temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {params.top_k}")
    user_stop_ids = frozenset(params.stop_token_ids)
    stop_ids = user_stop_ids if params.ignore_eos else user_stop_ids | frozenset(eos_token_ids)
    if output and output[-1] in stop_ids:
        raise ValueError("output_token_ids already end with a stop token")
    return stop_ids, user_stop_ids


class BaseEngine(abc.ABC):
    """Interface of a generation backend driven by the worker loop.

    The worker calls ``add`` / ``abort`` between steps and ``step`` in a loop
    while ``has_unfinished()``; each ``step`` returns at most one
    ``TokenOutput`` per running request.
    """

    max_num_seqs: int
    max_model_len: int

    @abc.abstractmethod
    def add(self, req: EngineRequest) -> None:
        """Queue ``req``; it is admitted at a following ``step``."""

    @abc.abstractmethod
    def abort(self, handle: int) -> bool:
        """Drop the request ``handle``; return True if it was unfinished."""

    @abc.abstractmethod
    def step(self) -> list[TokenOutput]:
        """Run one engine step; return its outputs ([] when idle)."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""

    @property
    @abc.abstractmethod
    def num_running(self) -> int:
        """Requests holding a slot."""

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Requests queued for admission."""

    @abc.abstractmethod
    def warmup(self) -> None:
        """Run a tiny request through every code path so the first real one is not slow."""


class SlotKVCache:
    """Static per-slot KV cache, passed to the model as ``cache=``.

    Per layer, key and value buffers of shape
    ``[max_num_seqs, num_kv_heads, max_model_len + 1, head_dim]``; row = slot,
    column = token position. Column ``max_model_len`` is the trash column:
    writes that belong to no sequence (padding, free decode rows) go there and
    no mask ever lets a query read it.

    Before each forward the engine calls ``set_prefill`` or ``set_decode``,
    which turn the (slot, column) destinations into one flat index over
    ``head_dim``-sized vectors, shared by all layers. The model's attention
    layers then call ``update`` once per layer, which stores with one
    ``index_copy_`` per buffer (measured on CPU: about half the cost of the
    equivalent advanced-indexing assignment). Only ``update`` is part of the
    protocol the model uses (duck typing; this is not a ``transformers.Cache``
    subclass, so no cache-driven mask is built and the engine's explicit 4-D
    mask is used as-is).
    """

    def __init__(
        self,
        num_layers: int,
        max_num_seqs: int,
        num_kv_heads: int,
        max_model_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (max_num_seqs, num_kv_heads, max_model_len + 1, head_dim)
        # Zero-filled, so that a free decode row reading column 0 sees finite values.
        self.key_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._key_vectors = [buf.view(-1, head_dim) for buf in self.key_cache]
        self._value_vectors = [buf.view(-1, head_dim) for buf in self.value_cache]
        self.trash_column = max_model_len
        self._head_dim = head_dim
        # Flat vector index of (slot, head, column 0): [max_num_seqs, num_kv_heads].
        slots = torch.arange(max_num_seqs, device=device).unsqueeze(1)
        heads = torch.arange(num_kv_heads, device=device).unsqueeze(0)
        self._base_index = (slots * num_kv_heads + heads) * (max_model_len + 1)
        self._prefill = False
        self._index = self._base_index.new_empty(0)
        self._start = 0
        self._stop = 0
        self._kv_len = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by all key and value buffers."""
        return sum(t.numel() * t.element_size() for t in self.key_cache + self.value_cache)

    def set_prefill(self, slots: torch.Tensor, columns: torch.Tensor) -> None:
        """Route the next (prefill) forward: token ``j`` of row ``i`` goes to (``slots[i]``, ``columns[i, j]``).

        Args:
            slots: ``[n]`` int64 slot of each batch row.
            columns: ``[n, q]`` int64 cache column of each token (the trash
                column for padding).

        During prefill the attention sees only the batch's own new keys and
        values: a prefill always starts a sequence from an empty slot.
        """
        self._prefill = True
        # [n, q, heads], the order of key_states.transpose(1, 2).
        self._index = (self._base_index[slots].unsqueeze(1) + columns.unsqueeze(2)).reshape(-1)

    def set_decode(self, start: int, stop: int, columns: torch.Tensor, kv_len: int) -> None:
        """Route the next (decode) forward: the token of row ``r`` goes to (``start + r``, ``columns[r]``).

        Args:
            start, stop: the batch is slots ``[start, stop)``.
            columns: ``[stop - start]`` int64 write column per row.
            kv_len: ``T``; attention sees cache columns ``[0, T)`` of each row.
        """
        self._prefill = False
        self._start = start
        self._stop = stop
        self._kv_len = kv_len
        # [m, heads], the order of key_states [m, heads, 1, head_dim].
        self._index = (self._base_index[start:stop] + columns.unsqueeze(1)).reshape(-1)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys/values and return what its attention reads.

        Args:
            key_states, value_states: ``[n, num_kv_heads, q, head_dim]`` (after RoPE).
            layer_idx: decoder layer index.
            kwargs: the layer's extra arguments (unused).

        Returns:
            ``(keys, values)``. Prefill: the inputs themselves,
            ``[n, num_kv_heads, q, head_dim]``. Decode: views (no copy) of the
            buffers, ``[m, num_kv_heads, T, head_dim]``.
        """
        head_dim = self._head_dim
        if self._prefill:
            self._key_vectors[layer_idx].index_copy_(
                0, self._index, key_states.transpose(1, 2).reshape(-1, head_dim)
            )
            self._value_vectors[layer_idx].index_copy_(
                0, self._index, value_states.transpose(1, 2).reshape(-1, head_dim)
            )
            return key_states, value_states
        self._key_vectors[layer_idx].index_copy_(0, self._index, key_states.reshape(-1, head_dim))
        self._value_vectors[layer_idx].index_copy_(0, self._index, value_states.reshape(-1, head_dim))
        rows = slice(self._start, self._stop)
        kv_len = self._kv_len
        return self.key_cache[layer_idx][rows, :, :kv_len], self.value_cache[layer_idx][rows, :, :kv_len]


@dataclass(slots=True, eq=False)
class _Sequence:
    """Engine-side state of one unfinished request.

    ``handle`` is None for the internal warmup request. ``slot`` is None while
    the request waits. ``max_output_tokens`` folds ``max_tokens`` and the
    context limit together; ``temperature`` is the logit divisor (1.0 when
    greedy) and ``top_k`` is the vocabulary size when off.
    """

    handle: int | None
    request: EngineRequest
    input_ids: list[int]
    num_prompt_tokens: int
    max_output_tokens: int
    stop_token_ids: frozenset[int]
    user_stop_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    seed: int | None
    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    slot: int | None = None


class Engine(BaseEngine):
    """Continuous-batching engine for one Hugging Face causal LM (see module docstring).

    Args:
        model: a ``transformers`` causal LM in eval mode, already on ``device``,
            loaded with ``attn_implementation="sdpa"`` (or "eager").
        tokenizer: the model's ``tokenizers.Tokenizer``.
        max_num_seqs: KV cache slots = most requests running at once, and
            the most requests waiting + running.
        max_model_len: most tokens (prompt + output) per request; defaults to
            ``config.max_position_embeddings`` and may not exceed it.
        max_num_batched_tokens: most padded tokens in one prefill forward
            (``rows * longest input``). A single request longer than this is
            still prefilled, alone.
        eos_token_ids: EOS ids; default: the model's generation config, else
            its config.
        device: where the KV cache and index tensors live.
        seed: seed of the generator used by requests without their own seed.

    Raises:
        ValueError: a size argument out of range.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        config = model.config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        max_positions = config.max_position_embeddings
        if max_model_len is None:
            max_model_len = max_positions
        if not 2 <= max_model_len <= max_positions:
            raise ValueError(f"max_model_len must be in [2, {max_positions}], got {max_model_len}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")

        self._model = model
        use_decode_attention(model)  # bfloat16/float16 decode: two matmuls beat CPU SDPA (daemon.attention)
        self._tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = config.vocab_size
        self.eos_token_ids = tuple(eos_token_ids) or _model_eos_token_ids(model, config)

        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype = next(model.parameters()).dtype
        with torch.inference_mode():
            self._cache = SlotKVCache(
                config.num_hidden_layers,
                max_num_seqs,
                num_kv_heads,
                max_model_len,
                head_dim,
                self.dtype,
                self.device,
            )
            index_kwargs = {"dtype": torch.long, "device": self.device}
            self._arange = torch.arange(max_model_len + 1, **index_kwargs)
            self._trash = torch.tensor(self._cache.trash_column, **index_kwargs)
            # Per-slot state: tokens in the cache, pending input token, occupancy.
            self._lens = torch.zeros(max_num_seqs, **index_kwargs)
            self._pending = torch.full((max_num_seqs,), _FILLER_TOKEN_ID, **index_kwargs)
            self._active = torch.zeros(max_num_seqs, dtype=torch.bool, device=self.device)
            # Per-slot sampling parameters (see SamplingTensors).
            self._temperature = torch.ones(max_num_seqs, dtype=torch.float32, device=self.device)
            self._greedy = torch.ones(max_num_seqs, dtype=torch.bool, device=self.device)
            self._top_k = torch.full((max_num_seqs,), self.vocab_size, **index_kwargs)
            self._top_p = torch.ones(max_num_seqs, dtype=torch.float32, device=self.device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)

        self._lens_list = [0] * max_num_seqs
        self._slots: list[_Sequence | None] = [None] * max_num_seqs
        self._free_slots = list(range(max_num_seqs))
        self._high = 0
        self._waiting: deque[_Sequence] = deque()
        self._by_handle: dict[int, _Sequence] = {}
        self._num_running = 0
        self._num_random = 0
        self._num_top_k = 0
        self._num_top_p = 0
        self._seeded: dict[int, _Sequence] = {}

    @property
    def kv_cache_tokens(self) -> int:
        """Token capacity of the KV cache: ``max_num_seqs * max_model_len``."""
        return self.max_num_seqs * self.max_model_len

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes allocated for the KV cache (all layers, keys and values, trash column included)."""
        return self._cache.nbytes

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._num_running or self._waiting)

    def add(self, req: EngineRequest) -> None:
        """Queue ``req``; it is admitted at the next ``step`` with a free slot.

        Raises:
            ValueError: empty prompt, token id outside ``[0, vocab_size)``,
                ``len(prompt) + len(output) >= max_model_len``, invalid
                sampling parameters, a handle already in use, or
                ``output_token_ids`` that already finish the request.
            CapacityError: ``max_num_seqs`` requests are already waiting or running.
        """
        if req.handle in self._by_handle:
            raise ValueError(f"handle {req.handle} is already in use")
        if len(self._waiting) + self._num_running >= self.max_num_seqs:
            raise CapacityError(f"engine is full: {self.max_num_seqs} unfinished requests")
        seq = self._make_sequence(req.handle, req)
        self._by_handle[req.handle] = seq
        self._waiting.append(seq)

    def abort(self, handle: int) -> bool:
        """Drop request ``handle``, freeing its slot at once; True if it was unfinished.

        No further ``TokenOutput`` is produced for it.
        """
        seq = self._by_handle.get(handle)
        if seq is None:
            return False
        if seq.slot is None:
            self._waiting.remove(seq)
            del self._by_handle[handle]
        else:
            with torch.inference_mode():
                self._free(seq)
        return True

    def step(self) -> list[TokenOutput]:
        """Decode one token for each running request, then admit and prefill waiting ones.

        Returns the step's outputs, one per request that produced a token;
        [] when idle.
        """
        outputs: list[TokenOutput] = []
        with torch.inference_mode():
            if self._num_running:
                self._decode(outputs)
            if self._waiting and self._free_slots:
                self._admit_and_prefill(outputs)
        return outputs

    def warmup(self) -> None:
        """Prefill and decode a tiny request (random sampling with top-k/top-p) and discard it.

        Raises:
            EngineError: the engine is not idle.
        """
        if self.has_unfinished():
            raise EngineError("warmup needs an idle engine")
        params = SamplingParams(
            max_tokens=_WARMUP_MAX_TOKENS, temperature=1.0, top_p=0.9, top_k=2, seed=0, ignore_eos=True
        )
        prompt = [_FILLER_TOKEN_ID] * max(1, min(_WARMUP_PROMPT_LEN, self.max_model_len - _WARMUP_MAX_TOKENS))
        seq = self._make_sequence(None, EngineRequest(handle=-1, prompt_token_ids=prompt, params=params))
        discarded: list[TokenOutput] = []
        with torch.inference_mode():
            self._assign_slots([seq])
            self._prefill([seq], len(prompt), discarded)
            while seq.slot is not None:
                self._decode(discarded)

    def _make_sequence(self, handle: int | None, req: EngineRequest) -> _Sequence:
        """Validate ``req`` and build its engine-side state."""
        params = req.params
        prompt = req.prompt_token_ids
        output = req.output_token_ids
        stop_ids, user_stop_ids = check_request(req, self.max_model_len, self.vocab_size, self.eos_token_ids)
        input_ids = list(prompt) + list(output)
        detokenizer = IncrementalDetokenizer(self._tokenizer, params.stop, prior_token_ids=output)
        if detokenizer.stop_string is not None:
            raise ValueError("output_token_ids already contain a stop string")

        greedy = params.temperature <= GREEDY_TEMPERATURE_EPS
        top_k = params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        seeded = params.seed is not None and not greedy
        return _Sequence(
            handle=handle,
            request=req,
            input_ids=input_ids,
            num_prompt_tokens=len(prompt),
            max_output_tokens=min(params.max_tokens, self.max_model_len - len(prompt)),
            stop_token_ids=stop_ids,
            user_stop_token_ids=user_stop_ids,
            detokenizer=detokenizer,
            generator=torch.Generator(device=self.device) if seeded else None,
            seed=params.seed,
            greedy=greedy,
            temperature=1.0 if greedy else float(params.temperature),
            top_k=top_k,
            top_p=float(params.top_p),
        )

    def _assign_slots(self, batch: list[_Sequence]) -> None:
        """Give each sequence the lowest free slot and load its sampling parameters."""
        for seq in batch:
            slot = heapq.heappop(self._free_slots)
            seq.slot = slot
            self._slots[slot] = seq
            if slot >= self._high:
                self._high = slot + 1
            self._num_running += 1
            if not seq.greedy:
                self._num_random += 1
                self._num_top_k += seq.top_k < self.vocab_size
                self._num_top_p += seq.top_p < 1.0
            if seq.generator is not None:
                self._seeded[slot] = seq
        slots = torch.tensor([seq.slot for seq in batch], dtype=torch.long, device=self.device)
        self._temperature[slots] = torch.tensor(
            [seq.temperature for seq in batch], dtype=torch.float32, device=self.device
        )
        self._greedy[slots] = torch.tensor([seq.greedy for seq in batch], dtype=torch.bool, device=self.device)
        self._top_k[slots] = torch.tensor([seq.top_k for seq in batch], dtype=torch.long, device=self.device)
        self._top_p[slots] = torch.tensor([seq.top_p for seq in batch], dtype=torch.float32, device=self.device)

    def _free(self, seq: _Sequence) -> None:
        """Release ``seq``'s slot and forget the request."""
        slot = seq.slot
        seq.slot = None
        self._slots[slot] = None
        self._active[slot] = False
        self._lens[slot] = 0
        self._lens_list[slot] = 0
        heapq.heappush(self._free_slots, slot)
        while self._high and self._slots[self._high - 1] is None:
            self._high -= 1
        self._num_running -= 1
        if not seq.greedy:
            self._num_random -= 1
            self._num_top_k -= seq.top_k < self.vocab_size
            self._num_top_p -= seq.top_p < 1.0
        self._seeded.pop(slot, None)
        if seq.handle is not None:
            del self._by_handle[seq.handle]

    def _admit_and_prefill(self, outputs: list[TokenOutput]) -> None:
        """Move waiting requests into free slots within the token budget and prefill them."""
        batch: list[_Sequence] = []
        max_len = 0
        while self._waiting and len(batch) < len(self._free_slots):
            seq_len = len(self._waiting[0].input_ids)
            padded = max(max_len, seq_len)
            if batch and padded * (len(batch) + 1) > self.max_num_batched_tokens:
                break
            batch.append(self._waiting.popleft())
            max_len = padded
        self._assign_slots(batch)
        self._prefill(batch, max_len, outputs)

    def _prefill(self, batch: list[_Sequence], max_len: int, outputs: list[TokenOutput]) -> None:
        """One left-padded forward over ``batch`` (``n`` rows, ``max_len`` columns); sample first tokens.

        Row ``i`` has ``pad_i`` leading filler tokens. Its real token ``j``
        gets position ``j`` and cache column ``j``; padding gets position 0 and
        the trash column. Query ``q`` may read key ``k`` iff ``k <= q`` and
        ``k`` is a real token, except that a padding query reads only itself
        (so no query row is fully masked, which would give NaN).
        """
        device = self.device
        lengths = [len(seq.input_ids) for seq in batch]
        rows = [[_FILLER_TOKEN_ID] * (max_len - n) + seq.input_ids for seq, n in zip(batch, lengths)]
        input_ids = torch.tensor(rows, dtype=torch.long, device=device)
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        slots = torch.tensor([seq.slot for seq in batch], dtype=torch.long, device=device)

        arange = self._arange[:max_len]
        pads = (max_len - lengths_t).unsqueeze(1)
        rel = arange.unsqueeze(0) - pads
        is_token = rel >= 0
        position_ids = rel.clamp(min=0)
        columns = torch.where(is_token, rel, self._trash)
        query = arange.view(1, max_len, 1)
        key = arange.view(1, 1, max_len)
        allowed = (key <= query) & ((key >= pads.unsqueeze(2)) | (key == query))
        mask = torch.zeros((len(batch), 1, max_len, max_len), dtype=self.dtype, device=device)
        mask.masked_fill_(~allowed.unsqueeze(1), float("-inf"))

        self._cache.set_prefill(slots, columns)
        logits = self._forward(input_ids, position_ids, mask)

        if self._num_random:
            params = SamplingTensors(
                temperature=self._temperature[slots],
                greedy=self._greedy[slots],
                top_k=self._top_k[slots],
                top_p=self._top_p[slots],
                all_greedy=all(seq.greedy for seq in batch),
                any_greedy=any(seq.greedy for seq in batch),
                use_top_k=self._num_top_k > 0,
                use_top_p=self._num_top_p > 0,
                seeded_rows=[
                    (i, self._seed_generator(seq)) for i, seq in enumerate(batch) if seq.generator is not None
                ],
                generator=self._generator,
            )
            tokens = sample(logits, params)
        else:
            tokens = logits.argmax(dim=-1)

        self._lens[slots] = lengths_t
        self._pending[slots] = tokens
        self._active[slots] = True
        for seq, n in zip(batch, lengths):
            self._lens_list[seq.slot] = n
        for seq, token_id in zip(batch, tokens.tolist()):
            self._append_token(seq, token_id, outputs)

    def _decode(self, outputs: list[TokenOutput]) -> None:
        """One forward of the pending token of every running request over slot rows ``[lo, hi)``.

        ``lo`` / ``hi`` are the lowest / highest occupied slot (+1 for ``hi``).
        """
        slots = self._slots
        lo, hi = 0, self._high
        while slots[lo] is None:
            lo += 1
        m = hi - lo
        lens = self._lens[lo:hi]
        active = self._active[lo:hi]
        kv_len = max(self._lens_list[lo:hi]) + 1
        columns = torch.where(active, lens, self._trash)
        mask = torch.zeros((m, 1, 1, kv_len), dtype=self.dtype, device=self.device)
        mask.masked_fill_((self._arange[:kv_len] > lens.unsqueeze(1)).view(m, 1, 1, kv_len), float("-inf"))

        self._cache.set_decode(lo, hi, columns, kv_len)
        logits = self._forward(self._pending[lo:hi].unsqueeze(1), lens.unsqueeze(1), mask)

        if self._num_random:
            params = SamplingTensors(
                temperature=self._temperature[lo:hi],
                greedy=self._greedy[lo:hi],
                top_k=self._top_k[lo:hi],
                top_p=self._top_p[lo:hi],
                all_greedy=False,
                any_greedy=self._num_random < self._num_running,
                use_top_k=self._num_top_k > 0,
                use_top_p=self._num_top_p > 0,
                seeded_rows=[(slot - lo, self._seed_generator(seq)) for slot, seq in self._seeded.items()],
                generator=self._generator,
            )
            tokens = sample(logits, params)
        else:
            tokens = logits.argmax(dim=-1)

        self._pending[lo:hi] = tokens
        lens.add_(active)
        lens_list = self._lens_list
        for slot, seq, token_id in zip(range(lo, hi), slots[lo:hi], tokens.tolist()):
            if seq is not None:
                lens_list[slot] += 1
                self._append_token(seq, token_id, outputs)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run the model on ``[n, q]`` tokens; return the last position's logits ``[n, vocab]``."""
        out = self._model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    @staticmethod
    def _seed_generator(seq: _Sequence) -> torch.Generator:
        """Seed ``seq``'s generator for its next output token and return it."""
        seq.generator.manual_seed(token_seed(seq.seed, len(seq.request.output_token_ids)))
        return seq.generator

    def _append_token(self, seq: _Sequence, token_id: int, outputs: list[TokenOutput]) -> None:
        """Record a sampled token, apply the stop conditions, emit its ``TokenOutput``.

        Order of checks (vLLM's): EOS / stop token, then stop string, then
        length (``max_tokens`` or the context limit).
        """
        output_ids = seq.request.output_token_ids
        output_ids.append(token_id)
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
        outputs.append(
            TokenOutput(
                seq.handle,
                num_output - 1,
                token_id,
                text,
                finish_reason,
                stop_reason,
                seq.num_prompt_tokens,
                num_output,
            )
        )
        self._free(seq)


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
