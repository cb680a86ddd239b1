"""The ``train`` keys (``conf/config.yaml`` and ``conf/recipe/``): the loss's settings
(:class:`LossSettings`, its weights and their schedule) and the trainer's (:class:`TrainConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from dspark.config.checks import _at_least, _check, _choice, _compute_dtype, _dir_name

AUTOCAST_CHOICES = ("auto", "bfloat16", "off")
"""``train.autocast`` (:mod:`dspark.precision` resolves ``auto`` on the device)."""
OPTIMIZERS = ("adamw", "muon")
"""``train.optimizer`` (:mod:`dspark.optim` builds them)."""
SUPERVISE = ("answer", "all")
"""``train.supervise``: the tokens the loss supervises, and the positions :mod:`dspark.data.target_topk` caches."""
FINAL_NORM_INITS = ("target", "ones")
MARKOV_INITS = ("zeros", "speculators")


@dataclass
class LossSettings:
    """The loss (dspark/loss.py), declared once: these are ``train.<field>`` in the config
    (:class:`TrainConfig` is a LossSettings) and the loss reads them from here, no field copied;
    the trainer hands the loss each step's (:meth:`weights_at`).

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
    ce_weight_start: Optional[float] = None
    """A loss schedule: the CE weight starts here and moves linearly to ``ce_weight`` over the
    first ``ce_anneal_frac`` of ``max_steps`` (TV's gradient is weak while the draft is spread
    over the vocabulary; CE's is not). None: ``ce_weight`` throughout (:meth:`weights_at`)."""
    ce_anneal_frac: float = 0.5

    def __post_init__(self) -> None:
        if self.ce_weight_start is not None:
            _at_least("train.ce_weight_start", self.ce_weight_start, 0)
        _check(
            0 < self.ce_anneal_frac <= 1, "train.ce_anneal_frac", self.ce_anneal_frac, "expected a fraction in (0, 1]"
        )
        for key in ("ce_weight", "tv_weight", "lk_weight", "kl_weight", "confidence_weight"):
            _at_least(f"train.{key}", getattr(self, key), 0)
        _check(self.position_decay > 0, "train.position_decay", self.position_decay, "expected a number > 0")
        _check(
            self.ce_weight + self.tv_weight + self.lk_weight + self.kl_weight > 0,
            "train.ce_weight",
            self.ce_weight,
            "ce_weight, tv_weight, lk_weight and kl_weight cannot all be 0 (nothing would train the drafter)",
        )

    def weights_at(self, step: int, max_steps: int) -> LossSettings:
        """What the loss reads at optimizer step ``step`` (0-based) of ``max_steps``: ``ce_weight``
        under the ``ce_weight_start`` schedule (from ``ce_weight_start`` linearly to ``ce_weight``
        over the first ``ce_anneal_frac`` of the steps, then ``ce_weight``), the schedule itself
        applied (``ce_weight_start`` None). Without a schedule: these settings."""
        if self.ce_weight_start is None:
            return self
        span = max(1, round(self.ce_anneal_frac * max_steps))
        frac = min(1.0, step / span)
        ce_weight = self.ce_weight_start + (self.ce_weight - self.ce_weight_start) * frac
        return replace(self, ce_weight=ce_weight, ce_weight_start=None)


@dataclass
class TrainConfig(LossSettings):
    """Trainer cadence, optimisation and loss (the loss's fields: :class:`LossSettings`). DeepSpeed
    gets micro batch, accumulation, clipping and precision from here; ZeRO settings come from the
    deepspeed group."""

    dtype: str = "float32"
    """The weights' dtype: bfloat16 on GPUs, float32 on CPU (where ``autocast`` gives bf16 products)."""
    autocast: str = "off"
    """Mixed precision over fp32 weights (:mod:`dspark.precision`): ``auto`` (bf16 products where the
    CPU has ``avx512_bf16`` or ``amx_bf16``, or the GPU supports bf16; fp32 elsewhere: an AVX2-only
    CPU emulates bf16 about 50x slower), ``bfloat16`` (always) or ``off``. Weights, optimizer state,
    checkpoints, exports and validation stay fp32; the first training log line says what was chosen."""
    optimizer: str = "adamw"
    """``adamw``, or ``muon``: torch's Muon over the hidden matrices and AdamW over the rest, as
    speculators 0.9 splits them (:mod:`dspark.optim`)."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (speculators' default; ``match_rms_adamw`` scaling), on the same
    warmup-cosine schedule as ``lr``."""
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    compile: bool = False
    """``torch.compile`` the drafter's forward (inductor; on CPU it compiles C++ with the machine's
    compiler on the first steps)."""
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
        _choice("train.autocast", self.autocast, AUTOCAST_CHOICES)
        _choice("train.optimizer", self.optimizer, OPTIMIZERS)
        _choice("train.supervise", self.supervise, SUPERVISE)
        _choice("train.final_norm_init", self.final_norm_init, FINAL_NORM_INITS)
        _choice("train.markov_init", self.markov_init, MARKOV_INITS)
        _at_least("train.target_topk", self.target_topk, 0)
        _at_least("train.copy_anchor_boost", self.copy_anchor_boost, 0)
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
        for key in ("lr", "weight_decay", "warmup_steps", "grad_clip", "muon_lr", "muon_weight_decay"):
            _at_least(f"train.{key}", getattr(self, key), 0)
        _check(0 <= self.muon_momentum < 1, "train.muon_momentum", self.muon_momentum, "expected a number in [0, 1)")
        _check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "expected a fraction in [0, 1]")
        _dir_name("train.run_name", self.run_name, "the run's directories under checkpoints/, exports/ and eval/")
