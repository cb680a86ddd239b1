"""The FLOPs of a training step, counted once: what the drafter's matmuls cost at a batch shape,
and the device peaks that turn a step's FLOP/s into MFU.

Pure arithmetic on the drafter's sizes (:class:`~dspark.model.DrafterDims`, :class:`DSparkConfig`;
each drafter family counts its own layers, :meth:`dspark.families.base.DrafterFamily.layer_flops`)
and the batch shape; no torch. A matmul [m, k] x [k, n] is 2mkn FLOPs (a multiply and an add),
as ``torch.utils.flop_counter`` counts it; norms, RoPE, softmaxes, the loss's elementwise terms,
gathers and embedding lookups are not counted (tests/dspark/test_flops.py checks the total
against ``FlopCounterMode`` on a tiny drafter).

**Model FLOPs** (:attr:`StepFlops.model`, what MFU divides): the forward, and the backward that
training needs, matmul by matmul: a trainable matmul whose input needs a gradient costs 3x its
forward (the 6N convention), one whose input needs none costs 2x (``fc``: the target's states
need no gradient; only its weight's), the frozen LM head on the draft distribution 2x (its
input's gradient only), the target's distribution and a colocated target 1x (forward only,
no grad). Attention is counted dense, every query against every context key and every block,
as the masked kernel computes it (a block sees only the context before its anchor and its own
block, so part of that is masked work: little where the anchors sit in an answer at the end of
a long prompt); its backward as 2x its forward (a fused kernel's recomputation of the scores in
backward is not model FLOPs).

**Executed FLOPs** (:attr:`StepFlops.executed`): model FLOPs plus the vocabulary chunks that
``train.recompute_vocab_chunks`` recomputes in backward (draft LM head, Markov W2 and the
target's LM head, one more forward each). MFU uses model FLOPs (PaLM's definition), so turning
recomputation on or off changes the step time, not the count.

Shape symbols (as :mod:`dspark.model`): B sequences, T window tokens (the padded batch length),
S = T-1 context positions, A anchors per sequence, Q block queries (gamma, or 1+gamma in the
DFlash layout), K = gamma predictions, P supervised predictions (<= B*A*K), H hidden, C =
n_ctx_layers x target hidden, N/Nkv heads, D head dim, I intermediate, V vocab, R Markov rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from dspark.families import get_family
from dspark.families.base import linear_flops as _linear

if TYPE_CHECKING:
    from dspark.config import DSparkConfig
    from dspark.model import DrafterDims

#: The parts of a step, in report order (keys of :attr:`StepFlops.parts`).
PARTS = (
    "context projection (fc)",
    "context K/V (every layer)",  # the latents and their expansion for MLA
    "draft layers: projections + MLP",
    "draft layers: attention",
    "draft LM head",
    "target LM head (no grad)",
    "Markov head",
    "confidence head",
    "colocated target (no grad)",
)


@dataclass(frozen=True)
class TargetShape:
    """The sizes of a dense decoder-only target whose forward a colocated run pays for
    (``data.mode=colocated``): Llama/Qwen-style attention and a gated MLP (gate, up, down)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> TargetShape:
        """From a transformers text config (``config.json``'s fields). A mixture-of-experts
        target's active MLP is not modelled: its ``intermediate_size`` is taken as it stands."""
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
        )


@dataclass(frozen=True)
class StepFlops:
    """One micro batch's FLOPs: per part (forward, backward), the recomputed share, and how many
    predictions the loss supervised."""

    parts: dict[str, tuple[int, int]]
    """Part (:data:`PARTS`) -> (forward, backward) model FLOPs; parts absent from the step are 0."""
    recomputed: dict[str, int]
    """Part -> forward FLOPs run again in backward (``recompute_vocab_chunks``): executed, not
    model FLOPs."""
    predictions: int
    tokens: int = field(default=0)
    """Window tokens (B x T) the step read."""

    @property
    def model(self) -> int:
        return sum(f + b for f, b in self.parts.values())

    @property
    def recompute(self) -> int:
        return sum(self.recomputed.values())

    @property
    def executed(self) -> int:
        return self.model + self.recompute

    def executed_by_part(self, part: str) -> int:
        return sum(self.parts[part]) + self.recomputed.get(part, 0)

    @property
    def forward(self) -> int:
        return sum(f for f, _ in self.parts.values())

    @property
    def per_prediction(self) -> float:
        """Model FLOPs per supervised prediction (nan with none)."""
        return self.model / self.predictions if self.predictions else float("nan")


def step_flops(
    cfg: DSparkConfig,
    dims: DrafterDims,
    *,
    sequences: int,
    tokens: int,
    anchors: int,
    predictions: Optional[int] = None,
    target_topk: bool = False,
    recompute_vocab_chunks: bool = False,
    colocated_target: Optional[TargetShape] = None,
) -> StepFlops:
    """The FLOPs of one micro batch's forward + loss + backward (module docstring).

    ``sequences`` x ``tokens``: the padded batch (B x T); ``anchors``: anchors per sequence (A);
    ``predictions``: the predictions the loss supervised (``LossOutput.num_positions``; default
    every one, B*A*K), which the vocabulary-wide heads run on. ``target_topk``: the target's
    distribution comes from its cached top k (``train.target_topk > 0``), so its LM head does not
    run. ``colocated_target``: the target's forward over the window (``data.mode=colocated``),
    counted as B x (T-1) tokens with causal attention over the lower triangle.
    """
    b, t, a = sequences, tokens, anchors
    s = t - 1
    k = cfg.block_size
    q = k if cfg.sample_from_anchor else k + 1
    h, v = dims.hidden_size, dims.vocab_size
    vd = cfg.draft_vocab_size or v  # the draft head and the Markov output run over the draft vocabulary
    r = cfg.markov_rank
    layers = cfg.num_layers
    p = b * a * k if predictions is None else predictions
    rows_pred = b * a * k  # heads over every prediction slot (the confidence and gated Markov heads)
    blk = b * a * q  # block tokens through the backbone

    parts = dict.fromkeys(PARTS, (0, 0))
    fc = _linear(b * s, dims.num_context_layers * dims.target_hidden_size, h)
    parts[PARTS[0]] = (fc, fc)  # the target's states need no gradient: the weight's only
    ctx_kv, proj, attn = get_family(cfg.family).layer_flops(
        cfg,
        dims,
        context_rows=b * s,
        block_rows=blk,
        attention=(b, a * q, s + a * q),  # dense over [context ; blocks]
    )
    parts[PARTS[1]] = (layers * ctx_kv, 2 * layers * ctx_kv)
    parts[PARTS[2]] = (layers * proj, 2 * layers * proj)
    parts[PARTS[3]] = (layers * attn, 2 * layers * attn)
    head = _linear(p, h, vd)
    parts[PARTS[4]] = (head, head)  # frozen weight: the input's gradient only
    target = 0 if target_topk else _linear(p, dims.target_hidden_size, v)
    parts[PARTS[5]] = (target, 0)
    markov_f = markov_b = 0
    if r > 0:
        w2 = _linear(p, r, vd)
        markov_f, markov_b = w2, 2 * w2
        if cfg.markov_head_type == "gated":
            gate = _linear(rows_pred, h, r)
            markov_f, markov_b = markov_f + gate, markov_b + 2 * gate
        elif cfg.markov_head_type == "rnn":  # K steps; the first one's carry (zeros) needs no gradient
            step = _linear(b * a, r, r)
            markov_f, markov_b = markov_f + k * step, markov_b + (2 * k - 1) * step
    parts[PARTS[6]] = (markov_f, markov_b)
    if cfg.enable_confidence_head:
        conf = _linear(rows_pred, h + (r if cfg.confidence_head_with_markov and r > 0 else 0), 1)
        parts[PARTS[7]] = (conf, 2 * conf)
    if colocated_target is not None:
        parts[PARTS[8]] = (target_forward_flops(colocated_target, sequences=b, tokens=s), 0)
    recomputed = {}
    if recompute_vocab_chunks:  # the chunk function runs again whole: both heads and W2
        recomputed = {PARTS[4]: head, PARTS[5]: target, PARTS[6]: _linear(p, r, vd) if r > 0 else 0}
    return StepFlops(parts, recomputed, p, b * t)


def target_forward_flops(target: TargetShape, *, sequences: int, tokens: int) -> int:
    """A dense target's decoder forward over ``sequences`` x ``tokens`` (no LM head: only states
    are needed), causal attention counted over the lower triangle (what a causal kernel runs)."""
    rows = sequences * tokens
    h, n, nkv, d = target.hidden_size, target.num_heads, target.num_kv_heads, target.head_dim
    proj = 2 * _linear(rows, h, n * d) + 2 * _linear(rows, h, nkv * d) + 3 * _linear(rows, h, target.intermediate_size)
    attn = 2 * 2 * sequences * n * d * (tokens * (tokens + 1) // 2)
    return target.num_layers * (proj + attn)


# --- device peaks -------------------------------------------------------------------------------
#: Dense (no 2:4 sparsity) bf16/fp16 tensor-core peaks per GPU, FLOP/s, by a lower-case substring
#: of ``torch.cuda.get_device_name()``; first match wins. From NVIDIA's datasheets, whose headline
#: figures are with sparsity (halved here): H100 SXM / H200 SXM 1,979 -> 989 TFLOP/s, H100 NVL
#: 1,671 -> 835, H100 PCIe 1,513 -> 756, H200 NVL 1,671 -> 836, A100 312 (dense), B200 4.5 ->
#: 2.25 PFLOP/s, GB200 5 -> 2.5 PFLOP/s; the same table as torchtitan's ``get_peak_flops``. A GPU
#: that is not here (GB300 among them: not confirmed from a datasheet here) gets no MFU.
PEAK_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("gb200",), 2.5e15),
    (("b200",), 2.25e15),
    (("h200", "nvl"), 836e12),
    (("h200", "pcie"), 836e12),
    (("h200",), 989e12),
    (("h100", "nvl"), 835e12),
    (("h100", "pcie"), 756e12),
    (("h100",), 989e12),
    (("a100",), 312e12),
)


def peak_flops(device_name: str, dtype: str) -> Optional[float]:
    """The device's dense peak FLOP/s for training in ``dtype`` (``train.dtype``), or None where it is
    not known: a CPU, a GPU not in :data:`PEAK_FLOPS`, or float32 (whose peak depends on TF32
    being allowed), so that no MFU is reported rather than a made-up one."""
    if dtype not in ("bfloat16", "float16"):
        return None
    name = device_name.lower()
    return next((flops for keys, flops in PEAK_FLOPS if all(key in name for key in keys)), None)
