"""Model and tokenizer loading shared by the daemon's processes.

A model directory is a standard Hugging Face directory with ``config.json`` and
a fast-tokenizer ``tokenizer.json`` (``generation_config.json`` is optional).
:func:`resolve_model_dir` validates such a directory and reads the facts every
process needs (context length, end-of-sequence ids, ...) into a
:class:`ModelInfo`.  :func:`load_tokenizer` gives the ``tokenizers`` tokenizer
used for encoding and incremental decoding. No torch, no transformers: the
engine's :mod:`ringstream.daemon.engine.loader` loads the weights. A model may
also be named as users name it on the Hugging Face hub, ``org/name`` (optionally
``@revision``): :func:`hub_snapshot` finds it in the local hub cache, or fetches
it there when the host is online.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

log = logging.getLogger("ringstream.model")

DEFAULT_MODEL_DIR: Path = Path(__file__).parent.parent / "default_model"

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# config.json keys holding the context length, in order of preference.
MAX_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


class ModelError(Exception):
    """A model directory is missing, incomplete, malformed or fails to load."""


class ModelRefused(ModelError):
    """The engine cannot serve this model exactly (found by the worker's start check, after the weights load), or
    not with these settings (a KV cache of ``kv_cache_bytes`` too small for one sequence): the start exits 2,
    like a refusal by :func:`resolve_model_dir`, since no retry changes it."""


class ModelNotFound(ModelError):
    """The model is not there (yet): no such directory, or a hub model neither cached nor downloadable. A start
    that meets it exits 1 (retried under systemd: a mount or the network may come back); every other
    ``ModelError`` is a refusal of the model itself, exit 2, like a bad setting."""


@dataclass(frozen=True)
class ModelInfo:
    """Facts about a validated model directory.

    Attributes:
        path: absolute path of the model directory.
        max_model_len: context length in tokens (prompt plus generated).
        eos_token_ids: token ids that end generation; never empty.
        bos_token_id: beginning-of-sequence id, or ``None`` when the model has none.
        vocab_size: number of rows of the embedding matrix.
        model_type: the ``model_type`` of ``config.json`` (e.g. ``"llama"``).
    """

    path: Path
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    vocab_size: int
    model_type: str


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Return the language-model part of a config (nested for multimodal models)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_positive_int(value: Any) -> bool:
    return _is_token_id(value) and value > 0


def _eos_ids(value: Any, source: Path) -> tuple[int, ...]:
    ids = [value] if not isinstance(value, list) else value
    if not all(_is_token_id(i) for i in ids):
        raise ModelError(
            f"{source}: eos_token_id must be a token id or a list of them, got {value!r}"
        )
    return tuple(dict.fromkeys(ids))


ENCODER_ONLY_TYPES = frozenset(("bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
                                "deberta-v2", "camembert", "mpnet", "modernbert", "ernie", "nomic_bert", "xlm",
                                "funnel", "layoutlm", "esm", "megatron-bert", "mobilebert", "squeezebert"))
"""``model_type`` values of encoder-only models (masked LMs, embedders): refused as such even when their config
names no architecture."""
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
"""Architecture names of causal LMs (``...ForConditionalGeneration``: a multimodal model, served by its text
model) as transformers names them; a config naming none of them (``BertForMaskedLM``) is another kind."""
UNSUPPORTED_FAMILIES = {
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "bamba", "nemotron_h",
                     "falcon_h1"), "state-space or recurrent layers (only attention layers are served)"),
    **dict.fromkeys(("bloom", "mpt"), "ALiBi position biases in its own attention code (outside transformers' "
                                      "AttentionInterface)"),
    **dict.fromkeys(("falcon", "openai-gpt"), "its own attention code (outside transformers' AttentionInterface)"),
}
"""Model families refused from their config alone, before anything else about them is read (the worker's start
check, :mod:`ringstream.daemon.engine.checks`, would refuse them later for the same reason)."""


def _refuse_kind(config: dict[str, Any], text: dict[str, Any], root: Path) -> None:
    """ModelError when the config is not a decoder-only causal LM, or its family has a feature the engine does
    not serve; the first thing said of such a model, before its context length or tokenizer."""
    if config.get("is_encoder_decoder") or text.get("is_encoder_decoder"):
        raise ModelError(f"model directory {root}: {config.get('model_type', 'the model')} is an encoder-decoder "
                         "model; ringstream serves decoder-only causal LMs")
    architectures = config.get("architectures") or []
    if architectures and isinstance(architectures, list) and not any(
            isinstance(name, str) and name.endswith(CAUSAL_LM_SUFFIXES) for name in architectures):
        raise ModelError(f"model directory {root}: {', '.join(map(str, architectures))} is not a causal LM "
                         "(ringstream serves models whose architecture ends in ForCausalLM or LMHeadModel)")
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    if model_type in ENCODER_ONLY_TYPES:
        raise ModelError(f"model directory {root}: {model_type} is an encoder-only model (not a causal LM); "
                         "ringstream serves decoder-only causal LMs")
    reason = UNSUPPORTED_FAMILIES.get(model_type)
    layer_types = text.get("layer_types")
    if reason is None and isinstance(layer_types, list):
        others = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention",
                                                              "chunked_attention")}, key=str)
        if others:
            reason = f"layers of type {', '.join(map(str, others))} (only attention layers are served)"
    if reason is None and text.get("kv_lora_rank"):
        reason = "multi-head latent attention (kv_lora_rank)"
    if reason is not None:
        raise ModelError(f"model directory {root}: {model_type or 'the model'} cannot be served exactly: {reason}")


def resolve_model_dir(path: str | Path | None, max_model_len: int | None = None) -> ModelInfo:
    """Validate a model directory and read its :class:`ModelInfo`.

    Args:
        path: model directory, or a Hugging Face model id (``org/name[@revision]``, :func:`hub_snapshot`) where
            no such directory exists; ``None`` selects :data:`DEFAULT_MODEL_DIR`.
        max_model_len: the context length to serve when the config gives none (``--max-model-len``).

    Returns:
        The directory's :class:`ModelInfo`, with ``path`` made absolute.

    Raises:
        ModelNotFound: no such directory, or a hub id neither cached nor downloadable.
        ModelError, in this order: the directory does not exist or lacks ``config.json``; the model is not a
            decoder-only causal LM, or of a family the engine does not serve (:data:`UNSUPPORTED_FAMILIES`);
            it lacks ``tokenizer.json``; its config has no context length (and ``max_model_len`` is None), no
            vocabulary size or no end-of-sequence id; malformed JSON.
    """
    if path is not None and not str(path).strip():
        raise ModelError("model: empty; give a model directory or a Hugging Face id org/name")
    try:
        root = Path(DEFAULT_MODEL_DIR if path is None else path).expanduser().resolve()
        hub = not root.is_dir() and path is not None and hub_id(str(path)) is not None and not Path(path).exists()
        if hub:
            root = hub_snapshot(str(path))
        if not root.is_dir():
            raise ModelNotFound(f"model directory {root} does not exist or is not a directory (a Hugging Face model "
                                "is named org/name, optionally @revision)")
        config_path = root / CONFIG_FILE
        has_config = config_path.is_file()
    except OSError as exc:  # a name too long, a loop of links, a directory this user may not read
        raise ModelError(f"model {str(path)[:200]!r}: {exc.strerror or exc}") from None
    if not has_config:
        raise ModelError(f"model directory {root} has no {CONFIG_FILE}")
    full_config = _read_json(config_path)
    config = _text_config(full_config)
    _refuse_kind(full_config, config, root)
    if not (root / TOKENIZER_FILE).is_file():
        if hub:  # never write into the hub cache: convert into a copy of the user's own
            copy = f"./{model_name(root).split('/')[-1]}"
            advice = (f"its repo publishes none; make a local copy with one: cp -rL {root} {copy} && python -c "
                      f"'from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(\"{copy}\")"
                      f".save_pretrained(\"{copy}\")' (where transformers can convert the model's own), then "
                      f"serve --model {copy}")
        else:
            advice = (f"python -c 'from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(\"{root}\")"
                      f".save_pretrained(\"{root}\")' writes one where transformers can convert the model's own")
        raise ModelError(f"model directory {root} has no {TOKENIZER_FILE}; ringstream needs a fast (tokenizers) "
                         f"tokenizer: {advice}")

    max_len = next((config[k] for k in MAX_LENGTH_KEYS if k in config), None)
    if not _is_positive_int(max_len):
        if max_model_len is None:
            raise ModelError(
                f"{config_path} gives no positive context length "
                f"(looked for {', '.join(MAX_LENGTH_KEYS)}, got {max_len!r}); give one with --max-model-len"
            )
        max_len = max_model_len
    vocab_size = config.get("vocab_size")
    if not _is_positive_int(vocab_size):
        raise ModelError(f"{config_path} gives no positive vocab_size (got {vocab_size!r})")

    generation_path = root / GENERATION_CONFIG_FILE
    generation = _read_json(generation_path) if generation_path.is_file() else {}
    if generation.get("eos_token_id") is not None:
        eos_source, eos_value = generation_path, generation["eos_token_id"]
    else:
        eos_source, eos_value = config_path, config.get("eos_token_id")
    if eos_value is None:
        raise ModelError(f"model directory {root} defines no eos_token_id")
    eos_token_ids = _eos_ids(eos_value, eos_source)
    if not eos_token_ids:
        raise ModelError(f"{eos_source}: eos_token_id is an empty list")

    bos = generation.get("bos_token_id")
    if bos is None:
        bos = config.get("bos_token_id")
    if bos is not None and not _is_token_id(bos):
        raise ModelError(f"model directory {root}: bos_token_id must be a token id, got {bos!r}")

    return ModelInfo(
        path=root,
        max_model_len=max_len,
        eos_token_ids=eos_token_ids,
        bos_token_id=bos,
        vocab_size=vocab_size,
        model_type=str(config.get("model_type", "")),
    )


def load_tokenizer(info: ModelInfo) -> Tokenizer:
    """Load the fast tokenizer of a resolved model directory.

    Args:
        info: from :func:`resolve_model_dir`.

    Returns:
        The ``tokenizers.Tokenizer`` of ``info.path / "tokenizer.json"``; its
        ``encode`` applies the model's post-processor (e.g. a leading BOS).

    Raises:
        ModelError: the file cannot be read or parsed.
    """
    path = info.path / TOKENIZER_FILE
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise ModelError(f"cannot load tokenizer {path}: {exc}") from exc


def check_tokenizer_vocab(tokenizer: Tokenizer, info: ModelInfo) -> None:
    """ModelError when the tokenizer can produce ids the model has no embedding for (``vocab_size`` of its
    config), in its vocabulary or from its post-processor (a BOS id), or the config's end or start id is one:
    every prompt holding one would fail, so the model is refused at start, both sizes named. A tokenizer
    smaller than the embedding (a padded vocabulary) is fine."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    top = max(vocab.values(), default=-1)  # ids need not be dense: the largest one counts, not how many
    if top >= info.vocab_size:
        raise ModelError(f"model directory {info.path}: its tokenizer has {len(vocab)} tokens with ids up to {top} "
                         f"but the model's vocab_size is {info.vocab_size}; the tokenizer and the weights belong "
                         "to different models")
    # ids no vocabulary entry names: those its post-processor adds (a BOS), the config's end and start ids
    added = max(tokenizer.encode("a").ids, default=-1)
    for what, token_id in (("its tokenizer's post-processor adds the id", added),
                           *(("its eos_token_id is", i) for i in info.eos_token_ids),
                           ("its bos_token_id is", info.bos_token_id if info.bos_token_id is not None else -1)):
        if token_id >= info.vocab_size:
            raise ModelError(f"model directory {info.path}: {what} {token_id}, outside the model's vocab_size of "
                             f"{info.vocab_size}; every request would fail")


HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+)(?:@(?P<revision>[A-Za-z0-9_./-]+))?")
"""A Hugging Face model id as users type it: ``org/name``, optionally ``@revision`` (a branch, tag or commit);
:func:`hub_id` also refuses ``.`` and ``..`` parts."""


def hub_id(name: str) -> re.Match | None:
    """The :data:`HUB_ID` match of ``name``, or None when it is none or has a ``.`` or ``..`` part (``org/..``,
    ``org/name@../..``: a path, never a hub id)."""
    match = HUB_ID.fullmatch(name)
    if match is None or any(part in (".", "..") for part in re.split(r"[/@]", name)):
        return None
    return match


def _snapshot_gaps(snapshot: Path, tokenizer: bool = True) -> list[str]:
    """What a hub cache snapshot lacks of a servable model: ``config.json``, the safetensors weights (every
    shard its index names) and, with ``tokenizer``, ``tokenizer.json``. A file whose blob is missing (a dangling
    link of an interrupted download) is missing; an unreadable index is named as such."""
    def named(path: Path) -> str:  # a link whose blob is gone is there to ls: say so
        return f"{path.name} (a link to a missing blob)" if path.is_symlink() else path.name

    gaps = [] if (snapshot / CONFIG_FILE).is_file() else [named(snapshot / CONFIG_FILE)]
    if tokenizer and not (snapshot / TOKENIZER_FILE).is_file():
        gaps.append(named(snapshot / TOKENIZER_FILE))
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return [*gaps, f"readable {index.name}"]
        gaps += [named(snapshot / shard) for shard in shards if not (snapshot / shard).is_file()]
    elif not any(p.is_file() for p in snapshot.glob("*.safetensors")):
        dangling = [named(p) for p in sorted(snapshot.glob("*.safetensors"))]
        gaps += dangling or ["*.safetensors"]
    return gaps
HUB_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "chat_template.json")
"""The files of a causal LM the daemon reads: config, weights (safetensors only), tokenizer, chat template."""


HUB_TIMEOUT_S = 10.0
"""Seconds the hub has to answer a request (huggingface_hub's own default for its metadata requests)."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``
    (huggingface_hub's own order, read at each call)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(name: str) -> Path:
    """The local snapshot directory of the Hugging Face model ``name`` (``org/name[@revision]``).

    Looked up in the hub cache (:func:`hub_cache_dir`, the layout ``huggingface_hub`` writes:
    ``models--org--name/snapshots/<commit>``); when it is not there and the host is not offline
    (``HF_HUB_OFFLINE``), downloaded into it with ``huggingface_hub`` from ``HF_ENDPOINT`` (default: the
    Hugging Face hub; the files of :data:`HUB_FILES` only, with its progress bars).

    A snapshot that lacks the config, weights or tokenizer (:func:`_snapshot_gaps`: an interrupted download,
    or one of the tokenizer alone) is not taken for the model: the download completes it.

    Raises:
        ModelNotFound: not cached (or cached incomplete) and offline, the hub unreachable or silent to the
            first request for about :data:`HUB_TIMEOUT_S`, the repo or revision unknown, or the download cut
            off; the message gives the command that fetches it (exit 1: a retry may find it). A transfer that
            stalls after that is huggingface_hub's to retry, for as long as it takes (a model may be large): a
            stop signal ends such a start (:meth:`ringstream.daemon.front.shell.Front.run`).
        ModelError: the repo on the hub has no config or no safetensors weights (exit 2).
    """
    from huggingface_hub import HfApi, snapshot_download

    match = hub_id(name)
    repo, revision = match["repo"], match["revision"]
    cache = hub_cache_dir()
    fetch = (f"hf download {repo}{f' --revision {revision}' if revision else ''} --include "
             + " ".join(f"'{pattern}'" for pattern in HUB_FILES))
    gaps = None
    try:
        snapshot = Path(snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=list(HUB_FILES),
                                          local_files_only=True))
    except Exception:  # huggingface_hub's LocalEntryNotFoundError: not cached
        pass
    else:
        gaps = _snapshot_gaps(snapshot)
        if not gaps:
            return snapshot
        log.info("%s is in the Hugging Face cache %s without %s", name, snapshot, ", ".join(gaps))
    where = (f"not in the Hugging Face cache {cache}" if gaps is None
             else f"incomplete in the Hugging Face cache {cache} (no {', '.join(gaps)})")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelNotFound(f"{name} is {where} and HF_HUB_OFFLINE is set; fetch it "
                         f"on a host with network with: {fetch} (then copy that host's {cache} to this one's, or "
                         "set HF_HUB_CACHE to where the copy is; a gated model also needs hf auth login or "
                         "HF_TOKEN there)")
    endpoint = os.environ.get("HF_ENDPOINT") or None

    def unreachable(exc: Exception) -> ModelNotFound:  # network, unknown repo or revision, gated: a retry may do
        return ModelNotFound(f"{name} is {where} and cannot be downloaded ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}); fetch it with: {fetch}")

    # Ask the hub what the repo holds first (huggingface_hub's snapshot_download falls back to the cached
    # snapshot, silently, when the hub cannot be reached): a repo without the files is refused for what it lacks,
    # an unreachable hub is a ModelNotFound, and a silent endpoint fails within HUB_TIMEOUT_S.
    log.info("%s is %s: asking the hub (%s) for it", name, where, endpoint or "huggingface.co")
    try:
        files = {sibling.rfilename for sibling in
                 HfApi(endpoint=endpoint).model_info(repo, revision=revision or "main", timeout=HUB_TIMEOUT_S).siblings
                 or []}
    except Exception as exc:
        raise unreachable(exc) from None
    lacks = ([] if CONFIG_FILE in files else [CONFIG_FILE]) + (
        [] if any(f.endswith(".safetensors") for f in files) else ["*.safetensors"])
    if lacks:
        raise ModelError(f"{name}: its repo on the hub has no {', '.join(lacks)} (ringstream loads a config.json "
                         "and safetensors weights; convert other weight formats with transformers' save_pretrained "
                         "into a directory of yours)")
    log.info("%s is %s: downloading it", name, where)
    try:
        snapshot = Path(snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=list(HUB_FILES),
                                          endpoint=endpoint, etag_timeout=HUB_TIMEOUT_S))
    except Exception as exc:
        raise unreachable(exc) from None
    gaps = _snapshot_gaps(snapshot, tokenizer=TOKENIZER_FILE in files)
    if gaps:  # the hub has them, the download did not bring them: it was cut off
        raise ModelNotFound(f"{name}: the download left it incomplete in the Hugging Face cache {cache} (no "
                            f"{', '.join(gaps)}); fetch it with: {fetch}")
    return snapshot


def model_name(path: str | Path) -> str:
    """The name a model directory is served under by default: ``org/name`` for a Hugging Face cache snapshot
    (``.../models--org--name/snapshots/<commit>``, as vLLM names a model by its hub id), else the directory's
    own name."""
    path = Path(path)
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--") and "--" in repo[len("models--"):]:
        return repo[len("models--"):].replace("--", "/", 1)
    return path.name
