"""Batched next-token sampling for the generation engine.

One call turns a batch of logits into one token per row, each row with its own
sampling parameters (greedy, temperature, min-p, top-k, top-p, seed). The
engine keeps the per-request parameters and hands the rows of the current
batch to ``sample``; nothing here loops over the vocabulary in Python.
:func:`apply_penalties`, :func:`mask_tokens` and :func:`gather_logprobs` are
the steps the model runner applies around it for the rows that ask, in vLLM's
order (``Sampler.forward`` in ``vllm/v1/sample/sampler.py``): raw logprobs
first, then the ``min_tokens`` mask and the penalties, then ``sample``
(greedy argmax, or temperature, min-p, top-k / top-p and the draw).

Methods:

* Penalties (:func:`apply_penalties`), vLLM's ``apply_penalties``
  (``vllm/model_executor/layers/utils.py``, called from
  ``vllm/v1/sample/ops/penalties.py``): token counts are built by one
  ``scatter_add_`` over the rows' padded token ids; the repetition penalty
  (CTRL, Keskar et al., 2019; Hugging Face's
  ``RepetitionPenaltyLogitsProcessor``) divides the positive logits and
  multiplies the others of every token seen in the prompt or the output; the
  frequency penalty subtracts ``penalty * count`` and the presence penalty
  ``penalty * (count > 0)``, both over the output only.
* Min-p (vLLM's ``MinPLogitsProcessor``): after temperature, tokens with
  probability below ``min_p * max probability`` are dropped, before top-k /
  top-p.

* Top-k then top-p, with vLLM's semantics (``apply_top_k_top_p`` in
  ``vllm/v1/sample/ops/topk_topp_sampler.py``; the top-p rule is Hugging Face's
  ``TopPLogitsWarper``, from Holtzman et al., 2019, "The Curious Case of Neural
  Text Degeneration"): keep the ``top_k`` largest logits, renormalise, then
  keep the smallest set of most likely tokens whose probability reaches
  ``top_p`` (the most likely token always stays). vLLM sorts the whole
  vocabulary; here each row's rule is reduced to one threshold logit found
  with ``torch.topk`` over a short candidate list, as vLLM's
  ``apply_top_k_only`` does for top-k; only rows whose nucleus does not fit
  in the candidates are redone with a longer list, up to the full vocabulary.
  On CPU a full sort of a ``[64, 4096]`` batch costs about as much as a decode
  forward of a small model; the candidate path costs a tenth of that. Tokens
  tied with the threshold logit are kept (as in vLLM).
* Drawing from the filtered distribution uses the exponential-race form of the
  Gumbel-max trick, as vLLM's ``random_sample`` does:
  ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` i.i.d. selects token ``i`` with
  probability ``p_i``. It needs no cumulative sum and no per-row
  ``torch.multinomial`` call, and a row's draw reads only that row's noise, so
  a seeded row gives the same token whatever else is in the batch. The noise is
  ``E = -log(1 - U)`` from ``U ~ Uniform[0, 1)`` (inverse CDF), several times
  cheaper on CPU than ``Tensor.exponential_``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ringstream.daemon.engine.device_io import to_device
from ringstream.ipc.wire import TokenLogprob

__all__ = ["TOP_P_CANDIDATES", "SamplingTensors", "apply_penalties", "build_logprobs", "gather_logprobs",
           "greedy_tokens", "logprob_tensors", "mask_tokens", "sample", "token_seed", "top_k_top_p_threshold"]

_MASK_64 = (1 << 64) - 1
# SplitMix64 constants (Steele, Lea and Flood, "Fast Splittable Pseudorandom
# Number Generators", OOPSLA 2014).
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_MUL_1 = 0xBF58476D1CE4E5B9
_SPLITMIX_MUL_2 = 0x94D049BB133111EB
# Smallest exponential noise value: guards the division ``p / E`` against an
# exact 0 draw, which would turn a masked (p = 0) token into NaN.
_MIN_EXPONENTIAL = 1e-10
# Largest logits examined per top-p row (without top-k) before falling back to
# a pass over the whole vocabulary.
TOP_P_CANDIDATES = 128
# Factor by which the candidate list grows for rows whose nucleus it misses.
CANDIDATE_GROWTH = 8


def token_seed(seed: int, seq: int) -> int:
    """Return the generator seed for output token ``seq`` of a request seeded with ``seed``.

    The two integers are mixed with the SplitMix64 finaliser, so every
    (request seed, token index) pair gets an independent stream. Reseeding per
    token makes a seeded request reproducible regardless of batch companions
    and also across a resume: token ``seq`` draws the same noise whether or not
    the request was interrupted before it. Returns an int in ``[0, 2**64)``.
    """
    z = (seed * _SPLITMIX_GAMMA + seq + 1) & _MASK_64
    z = ((z ^ (z >> 30)) * _SPLITMIX_MUL_1) & _MASK_64
    z = ((z ^ (z >> 27)) * _SPLITMIX_MUL_2) & _MASK_64
    return z ^ (z >> 31)


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one batch of ``n`` rows.

    Attributes:
        temperature: ``[n]`` float32, the logit divisor; 1.0 on greedy rows.
        greedy: ``[n]`` bool, True where the row takes the argmax.
        top_k: ``[n]`` int64, number of tokens kept; the vocabulary size means off.
        top_p: ``[n]`` float32, nucleus mass kept; 1.0 means off.
        all_greedy: every row is greedy (fast path: one argmax, other fields unused).
        any_greedy: at least one row is greedy.
        use_top_k: at least one row has top-k filtering on.
        use_top_p: at least one row has top-p filtering on.
        min_p: ``[n]`` float32 in ``[0, 1]`` (0 = off), or None when no row has it.
        seeded_rows: ``(row, generator)`` for rows with a per-request seed; each
            generator is already seeded for this token (see ``token_seed``).
        generator: generator for the remaining random rows; None uses torch's
            global generator.
        max_top_k: the largest ``top_k`` of the rows with top-k on (0: none), and
        top_p_without_k: whether some row has top-p without top-k; both known on the host
            from the requests, so that choosing the candidate count reads nothing back from the
            device. None: derived from the tensors (a device-to-host read).
    """

    temperature: torch.Tensor
    greedy: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    use_top_k: bool
    use_top_p: bool
    seeded_rows: list[tuple[int, torch.Generator]] = field(default_factory=list)
    generator: torch.Generator | None = None
    min_p: torch.Tensor | None = None
    max_top_k: int | None = None
    top_p_without_k: bool | None = None


def top_k_top_p_threshold(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    candidates: int | None = None,
    *,
    limits: tuple[int, bool] | None = None,
) -> torch.Tensor:
    """Smallest logit each row keeps under top-k then top-p (see module docstring).

    Args:
        logits: ``[n, vocab]`` float logits (already temperature-scaled).
        top_k: ``[n]`` int64 in ``[1, vocab]`` (``vocab`` = off), or None (off).
        top_p: ``[n]`` float in ``(0, 1]`` (1.0 = off), or None (off).
        candidates: how many of the largest logits are examined first for a
            top-p row without top-k; rows whose nucleus is larger are redone
            with ``CANDIDATE_GROWTH`` times more, up to the whole vocabulary.
            Default ``TOP_P_CANDIDATES``.
        limits: ``(largest top_k of the rows with top-k on or 0, whether a row has top-p
            without top-k)``, known on the host: then nothing is read back from the device, and
            off the CPU a top-p row without top-k examines the whole vocabulary at once (one sort
            instead of a data-dependent retry). ``top_p`` must then be None when no row uses it.

    Returns:
        ``[n]`` float thresholds; a row keeps the tokens whose logit is
        ``>= threshold``, at least its most likely token. ``-inf`` keeps all.
    """
    n, vocab = logits.shape
    if candidates is None:
        candidates = TOP_P_CANDIDATES
    k_on = top_k < vocab if top_k is not None else torch.zeros(n, dtype=torch.bool, device=logits.device)
    p_on = top_p < 1.0 if top_p is not None else torch.zeros(n, dtype=torch.bool, device=logits.device)
    if top_k is None:
        top_k = torch.full((n,), vocab, dtype=torch.long, device=logits.device)
    if limits is None:
        num_candidates = int(top_k.masked_fill(~k_on, 1).max())
        p_without_k = bool((p_on & ~k_on).any())
    else:
        num_candidates, p_without_k = max(limits[0], 1), limits[1]
        if logits.device.type != "cpu":
            candidates = vocab
    if p_without_k:
        num_candidates = max(num_candidates, candidates)
    num_candidates = min(num_candidates, vocab)
    values = logits.topk(num_candidates, dim=-1).values  # [n, K], descending
    threshold = torch.full((n,), float("-inf"), dtype=logits.dtype, device=logits.device)
    k_index = top_k.clamp(max=num_candidates).sub(1).unsqueeze(1)
    threshold = torch.where(k_on, values.gather(1, k_index).squeeze(1), threshold)
    if top_p is None or (limits is None and not bool(p_on.any())):
        return threshold

    positions = torch.arange(num_candidates, device=logits.device)
    kept = values.masked_fill(positions >= top_k.unsqueeze(1), float("-inf"))
    # Rows with top-k hold their whole renormalised mass in the candidates;
    # the others are normalised over the full vocabulary.
    log_norm = torch.where(k_on, kept.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (kept - log_norm.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    in_nucleus = (cumulative - probs) < top_p.unsqueeze(1)
    last = (in_nucleus.sum(dim=-1, keepdim=True) - 1).clamp(min=0)  # a top_p below float32's range: top token
    threshold = torch.where(p_on, torch.maximum(threshold, values.gather(1, last).squeeze(1)), threshold)
    uncovered = p_on & ~k_on & (cumulative[:, -1] < top_p)
    # p_without_k is known on the host: without such a row nothing is uncovered, and nothing is read back
    if num_candidates < vocab and p_without_k and bool(uncovered.any()):
        rows = uncovered.nonzero().squeeze(1)
        threshold[rows] = top_k_top_p_threshold(
            logits[rows], top_k[rows], top_p[rows], candidates=num_candidates * CANDIDATE_GROWTH
        )
    return threshold


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (``[..., vocab]`` -> ``[...]`` int64, the lowest index on ties, NaN above all).

    bfloat16 and float16 logits on CPU are widened to float32 first: every value widens exactly, so the order,
    the ties and the NaNs are the same, and PyTorch's CPU argmax over the reduced type is the slow part (16 x
    4,096 bfloat16: ~290 us against ~56 us widened, 2 threads on this project's reference host).
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[n, vocab]`` next-token logits, any float dtype.
        params: the rows' parameters, each tensor of length ``n`` on the
            logits' device.

    Returns:
        ``[n]`` int64 token ids.

    Greedy rows take ``argmax`` (lowest index on ties, as ``torch.argmax`` and
    Hugging Face ``generate`` do). Random rows divide by their temperature,
    apply min-p, then top-k / top-p, softmax, and draw with the exponential race.
    """
    if params.all_greedy:
        return greedy_tokens(logits)
    scaled = logits.float() / params.temperature.unsqueeze(1)
    if params.min_p is not None:
        probs = scaled.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * params.min_p.unsqueeze(1)
        scaled.masked_fill_(probs < floor, float("-inf"))
    if params.use_top_k or params.use_top_p:
        threshold = top_k_top_p_threshold(
            scaled,
            params.top_k if params.use_top_k else None,
            params.top_p if params.use_top_p else None,
            limits=None if params.max_top_k is None else (params.max_top_k, bool(params.top_p_without_k)),
        )
        scaled.masked_fill_(scaled < threshold.unsqueeze(1), float("-inf"))
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    noise.uniform_(generator=params.generator)
    for row, generator in params.seeded_rows:
        noise[row].uniform_(generator=generator)
    # Exp(1) by inversion: E = -log(1 - U).
    noise.neg_().log1p_().neg_().clamp_min_(_MIN_EXPONENTIAL)
    sampled = probs.div_(noise).argmax(dim=-1)
    if params.any_greedy:
        sampled = torch.where(params.greedy, greedy_tokens(logits), sampled)
    return sampled


def _token_counts(token_ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(token_ids), vocab]`` int32 occurrence counts of each row's ids (one ``scatter_add_``)."""
    width = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros((len(token_ids), vocab + 1), dtype=torch.int32, device=device)
    if width:
        padded = to_device([ids + [vocab] * (width - len(ids)) for ids in token_ids], torch.long, device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
                    any_repetition: bool | None = None) -> torch.Tensor:
    """Apply the repetition, frequency and presence penalties (module docstring) to every row of ``logits``.

    Args:
        logits: ``[n, vocab]`` float32 logits, modified in place.
        prompt_ids: each row's prompt token ids (only the repetition penalty reads them).
        output_ids: each row's output token ids so far.
        presence, frequency: ``[n]`` float32 penalties (0 = off).
        repetition: ``[n]`` float32 in ``(0, inf)`` (1 = off).
        any_repetition: whether some row's repetition penalty is on, known on the host
            (None: read from ``repetition``, a device-to-host read).

    Returns:
        ``logits``.
    """
    n, vocab = logits.shape
    device = logits.device
    output_counts = _token_counts(output_ids, vocab, device)
    output_seen = output_counts > 0
    if any_repetition is None:
        any_repetition = bool((repetition != 1.0).any())
    if any_repetition:
        seen = output_seen | (_token_counts(prompt_ids, vocab, device) > 0)
        factor = torch.where(seen, repetition.unsqueeze(1), torch.ones((), device=device))
        logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    logits.sub_(frequency.unsqueeze(1) * output_counts)
    logits.sub_(presence.unsqueeze(1) * output_seen)
    return logits


def mask_tokens(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    """Set ``logits[rows[i], token_ids[i]]`` to ``-inf`` for every ``i`` (in place; the ``min_tokens`` mask)."""
    if rows:
        index = (to_device(rows, torch.long, logits.device), to_device(token_ids, torch.long, logits.device))
        logits.index_put_(index, logits.new_full((), float("-inf")))


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprob]:
    """Each row's token logprob and its ``num_top[row]`` most likely ``(token id, logprob)`` pairs.

    Args:
        logprobs: ``[n, vocab]`` float32 log-probabilities (``log_softmax`` of the raw logits).
        token_ids: ``[n]`` int64, the token of each row (sampled, or the prompt's next).
        num_top: ``n`` counts in ``[0, vocab]``.

    Returns:
        ``n`` :class:`ringstream.ipc.wire.TokenLogprob`, ``top`` most likely first
        (ties: lower index first, as ``torch.topk`` on CPU gives them).
    """
    found = [t.tolist() for t in logprob_tensors(logprobs, token_ids, num_top)]
    return build_logprobs(token_ids.tolist(), found, num_top)


def logprob_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[torch.Tensor]:
    """The device half of :func:`gather_logprobs`: ``[chosen [n]]``, plus ``values, indices [n, max(num_top)]``
    when some row asks for top logprobs."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    most = max(num_top, default=0)
    if not most:
        return [chosen]
    values, indices = logprobs.topk(most, dim=-1)
    return [chosen, values, indices]


def build_logprobs(ids: list[int], found: list[list], num_top: list[int]) -> list[TokenLogprob]:
    """The host half of :func:`gather_logprobs`: ``found`` is :func:`logprob_tensors`' result as lists."""
    chosen = found[0]
    if len(found) == 1:
        return [TokenLogprob(token_id, value) for token_id, value in zip(ids, chosen)]
    values, indices = found[1], found[2]
    return [TokenLogprob(token_id, value, list(zip(indices[i][:k], values[i][:k])))
            for i, (token_id, value, k) in enumerate(zip(ids, chosen, num_top))]
