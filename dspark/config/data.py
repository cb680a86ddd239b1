"""The ``data`` group (``conf/data/``): prompts -> the target's answers -> hidden-state shards
(``data.*``), with its extraction engine's settings (``data.vllm.*``) and the online stream's
(``data.online.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import II

from dspark.config.checks import STORE_DTYPES, _at_least, _check, _choice

COMPRESSIONS = ("none", "zstd")
ON_OVERLONG = ("skip", "truncate")
DATA_MODES = ("offline", "online", "colocated")
DATA_ENGINES = ("vllm", "transformers")
"""``data.engine``: what makes the sequences at extraction (:class:`DataConfig`)."""


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
    ones (``dspark/data/online.py``, ``data_tools/online.py``). Host memory for states is bounded by
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
