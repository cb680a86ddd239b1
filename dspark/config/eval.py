"""The ``eval`` group (``conf/eval/``): acceptance on long-context prompts per
context length, from the reference loop, vLLM and llama.cpp. Each field says which of the eval's
results depend on it (:func:`eval_fields`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from omegaconf import II

from dspark.config.checks import _at_least, _check, _choice
from dspark.serving.methods import BASELINES, LLAMA_CPP_BY_NAME

EVAL_SOURCES = ("offline", "aa_lcr", "fixed_passage")
SERVE_EXPORT = ("auto", "never")
LLAMA_CPP_USE = ("auto", "always", "never")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
"""What the converter writes (``--outtype``) that llama.cpp's CPU backend serves here: the drafter
GGUF's types (``eval.llama_cpp_draft_type``, :mod:`dspark.export.gguf`) and a converted target's."""
LLAMA_CPP_TARGETS = ("auto", "embedded", *GGUF_TYPES)
REFERENCE_PROPOSERS = ("dspark", "ngram-then-dspark", "ngram")

# Which of the eval's results a field feeds (``field(metadata=...)``, read by :func:`eval_fields`);
# a field without a part feeds every result. eval/run.py's fingerprints are built from these.
EVAL_PARTS = ("run_control", "llama_cpp", "not_llama_cpp")
_RUN_CONTROL = {"part": "run_control"}
"""How an eval is run or where it writes, not what it measures: in no fingerprint."""
_LLAMA_CPP = {"part": "llama_cpp"}
"""Only llama.cpp's rows depend on it: the reference loop's and vLLM's parts are kept across it."""
_NOT_LLAMA_CPP = {"part": "not_llama_cpp"}
"""llama.cpp's rows do not depend on it (the other parts' rows, the checks' lines): turning the
reference loop on for a parity table keeps llama.cpp's measured rows."""


@dataclass
class EvalConfig:
    """Acceptance on AA-LCR-style long-context prompts, binned by context length (tokens)."""

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
    reference_outputs: Optional[str] = field(default=None, metadata=_NOT_LLAMA_CPP)
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
    target_tau: Optional[float] = field(default=None, metadata=_NOT_LLAMA_CPP)
    """A preset's goal for tokens per target step on the eval set (our drafter drafts every step, so
    it is its tau), reported by the main job's checks (not enforced)."""
    target_pos1: Optional[float] = field(default=None, metadata=_NOT_LLAMA_CPP)
    """A preset's goal for first-position acceptance on the eval set, reported likewise."""
    ablation_checkpoint: Optional[str] = "auto"
    """The Markov-off run beside ours: auto = this config's run with drafter.markov_rank=0, if it
    was trained; a path; None = none."""
    out_dir: str = field(default="${paths.output_dir}/eval/${target.name}/${train.run_name}", metadata=_RUN_CONTROL)
    reference: bool = field(default=True, metadata=_NOT_LLAMA_CPP)
    """The PyTorch reference loop (tau, calibration, r, wall clock)."""
    reference_proposers: list[str] = field(
        default_factory=lambda: ["dspark", "ngram-then-dspark"], metadata=_NOT_LLAMA_CPP
    )
    """What the reference loop runs, each a row of the report: dspark (our drafter, and its
    Markov-off ablation when there is one); ngram-then-dspark (vLLM's prompt lookup where it finds
    a match, our drafter's block otherwise: a chain vLLM 0.32 cannot serve); ngram (the lookup
    alone, the served ngram baseline's twin: its counts should equal vLLM's on the same tokens)."""
    measure_plain: bool = field(default=True, metadata=_NOT_LLAMA_CPP)
    """Time plain decoding of the same target for the wall-clock speedup."""
    plain_tokens: Optional[int] = field(default=None, metadata=_NOT_LLAMA_CPP)
    """Time plain decoding over the first N new tokens of each answer (None: ``max_new_tokens``): a
    token's cost is set by the prompt's length, which an answer barely moves, so fewer tokens time
    the same cost in less of the eval's minutes."""
    baselines: list[str] = field(default_factory=lambda: ["ngram"], metadata=_NOT_LLAMA_CPP)
    """vLLM methods served on the same prompts."""
    serve_export: str = field(default="auto", metadata=_NOT_LLAMA_CPP)
    """auto: dspark on a GPU, the dflash export on CPU when the drafter has that layout; never."""
    vllm_max_model_len: Optional[int] = field(default=None, metadata=_NOT_LLAMA_CPP)
    """None = the largest bin + max_new_tokens + a draft block."""
    vllm_timeout_s: int = field(default=7200, metadata=_RUN_CONTROL)
    """Bound on each vLLM child (engine start and serving); past it the child and its processes
    are killed and the eval ends naming it and its log."""
    vllm_cpu_kvcache_gib: int = field(default=II("data.vllm.cpu_kvcache_gib"), metadata=_NOT_LLAMA_CPP)
    """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) for the served engines, on CPU."""
    force: bool = field(default=False, metadata=_RUN_CONTROL)
    """Rerun even when results.json matches the checkpoint and these settings."""
    vllm_engine_kwargs: dict[str, Any] = field(default_factory=dict, metadata=_NOT_LLAMA_CPP)
    """Extra vllm.LLM arguments, e.g. multi-node {nnodes, node_rank, master_addr, master_port}."""
    llama_cpp: str = field(default="auto", metadata=_LLAMA_CPP)
    """llama.cpp's ``llama-server`` serving this run's drafter on CPU (``draft-dspark``, Markov head
    on), beside the chain with its n-gram proposer and no speculation: auto = on a machine without a
    GPU where llama.cpp is built (``scripts/setup.sh`` builds it); always = build it first if it is
    not; never."""
    llama_cpp_methods: list[str] = field(
        default_factory=lambda: ["none", "dspark", "ngram-then-dspark"], metadata=_LLAMA_CPP
    )
    """The llama.cpp rows (``dspark.serving.methods.LLAMA_CPP_METHODS``); dflash is served where the
    export has that layout, and a Markov-off ablation beside ours as dspark. The default is what a
    CPU user chooses between: no speculation (every speedup is over it), our drafter and the chain.
    ``ngram`` and ``dflash`` are opt-in (issue #49: each row is one more server over every prompt,
    and vLLM's rows already measure both methods on the same prompts)."""
    llama_cpp_target: str = field(default="auto", metadata=_LLAMA_CPP)
    """The target GGUF: auto = the embedded target's own Q4_1 file (what a user runs), else the
    target converted at f16; embedded; or f32/f16/bf16/q8_0, converted once from the target's
    directory (f32: the reference loop's numerics, for parity)."""
    llama_cpp_draft_type: str = field(default="f32", metadata=_LLAMA_CPP)
    """The drafter GGUF's weights (``dspark.export --gguf-type``): f32, f16, bf16 or q8_0."""
    llama_cpp_threads: int = field(default=0, metadata=_LLAMA_CPP)
    """``llama-server -t``; 0: every core."""
    llama_cpp_timeout_s: int = field(default=3600, metadata=_RUN_CONTROL)
    """Bound on a llama.cpp server's start and on each of its requests."""
    llama_cpp_share_prefill: bool = field(default=True, metadata=_RUN_CONTROL)
    """Prefill each prompt once for all llama.cpp rows: ``none`` (the first row) saves the target's
    cache of the prompt's first tokens (llama-server's slot save) and the other rows restore it,
    processing only the rest (the drafter's window + 1 tokens at least, from a multiple of 512):
    the same outputs and counts as a whole prefill, which no row's timing counts. False: every row
    prefills every prompt."""

    def __post_init__(self) -> None:
        _choice("eval.source", self.source, EVAL_SOURCES)
        _choice("eval.llama_cpp", self.llama_cpp, LLAMA_CPP_USE)
        _choice("eval.llama_cpp_target", self.llama_cpp_target, LLAMA_CPP_TARGETS)
        _choice("eval.llama_cpp_draft_type", self.llama_cpp_draft_type, GGUF_TYPES)
        for m in self.llama_cpp_methods:
            _choice("eval.llama_cpp_methods[]", m, tuple(LLAMA_CPP_BY_NAME))
        _choice("eval.serve_export", self.serve_export, SERVE_EXPORT)
        for b in self.baselines:
            _choice("eval.baselines[]", b, BASELINES)
        for r in self.reference_proposers:
            _choice("eval.reference_proposers[]", r, REFERENCE_PROPOSERS)
        _check(
            bool(self.context_bins) and all(b >= 16 for b in self.context_bins),
            "eval.context_bins",
            self.context_bins,
            "expected a non-empty list of token counts >= 16",
        )
        for key in ("prompts_per_bin", "max_new_tokens", "gamma", "vllm_timeout_s"):
            _at_least(f"eval.{key}", getattr(self, key), 1)
        _at_least("eval.temperature", self.temperature, 0)
        if self.plain_tokens is not None:
            _at_least("eval.plain_tokens", self.plain_tokens, 1)
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


def eval_fields(part: Optional[str]) -> tuple[str, ...]:
    """The :class:`EvalConfig` fields of ``part`` (one of :data:`EVAL_PARTS`, their
    ``metadata["part"]``), in declaration order; None: the fields of no part, which every result
    depends on."""
    if part is not None and part not in EVAL_PARTS:
        raise ValueError(f"eval field part {part!r}: expected one of {list(EVAL_PARTS)} or None")
    return tuple(f.name for f in fields(EvalConfig) if f.metadata.get("part") == part)
