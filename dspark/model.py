"""The DSpark drafter: a non-causal block-diffusion backbone over target context, with a
low-rank sequential Markov head and a confidence head (arXiv 2607.05147).

Serving contract (vLLM 0.32's DSpark classes, ``Qwen3DSparkModel`` and ``K3DSparkModel``,
mirrored here so training = serving):

* context: the chosen target layers' states, concatenated per token, ``fc`` -> ``hidden_norm``;
  in every layer that layer's own projections turn it into extra keys/values (its drafter
  family's layers, :mod:`dspark.families`: GQA ``k_proj``/``v_proj`` for Qwen3, the MLA latent
  for K3), RoPE at the context position. Queries come only from the block.
* block for an anchor at position a (the last verified token):
  ``sample_from_anchor=True``  inputs [x_a, m, ..., m] (gamma) at a..a+gamma-1; query i
  predicts x_{a+i+1}.  ``False`` (DFlash): [x_a, m, ..., m] (1+gamma) at a..a+gamma; query i>=1
  predicts x_{a+i}. Either way the gamma predictions target x_{a+1..a+gamma}.
* a block sees context positions < a and all of its own tokens (non-causal), nothing else.
* draft logits = lm_head(norm(h_k)) + W2(W1[x_{k-1}]) (Markov bias, teacher-forced in training;
  x_{k-1} is the anchor for k=1); confidence = sigmoid(w . [h_k ; W1[x_{k-1}]] + b).
* a reduced draft vocabulary (``drafter.draft_vocab_size`` = N < V, :mod:`dspark.data.draft_vocab`):
  the draft logits run over the N kept tokens (draft ids); ``lm_head`` is then the draft's own
  [N, H] (the target's rows of the kept tokens, frozen like the full head: speculators freezes
  its reduced head too, ``speculators/model.py``), ``markov_w1`` stays over the target vocabulary
  (x_{k-1} is a target token) and ``markov_w2`` maps to the N draft logits; ``d2t`` turns a draft
  id into a target id (``target = draft + d2t[draft]``), as vLLM's ``map_draft_to_target`` does.

Shape symbols: B batch, T tokens, S context positions (T-1), A anchors per sequence,
Q block queries (gamma or 1+gamma), K = gamma predictions, H drafter hidden, C = n_ctx_layers *
target hidden, V target vocab, Vd draft vocab (V unless reduced), R Markov rank, N heads, D head dim.

The model knows nothing of DeepSpeed, losses or logging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from dspark.config import ConfigError, DSparkConfig
from dspark.families import DrafterDims, get_family
from dspark.families.layers import RMSNorm


def resolve_dims(
    cfg: DSparkConfig, *, target_config: dict, vocab_size: int, num_context_layers: int, mask_token_id: int
) -> DrafterDims:
    """Derive sizes left open in ``DSparkConfig`` from the target: width and head layout copy
    the target's when the drafter is as wide as the target (the usual DFlash/DSpark choice);
    the family fills in its own sizes (:meth:`dspark.families.base.DrafterFamily.resolve_dims`)."""
    t_hidden = int(target_config["hidden_size"])
    hidden = cfg.hidden_size or t_hidden
    if hidden == t_hidden and cfg.head_dim is None:
        heads = int(target_config.get("num_attention_heads", cfg.num_attention_heads))
        kv = int(target_config.get("num_key_value_heads", heads))
        head_dim = int(target_config.get("head_dim") or hidden // heads)
    else:
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = cfg.head_dim or hidden // heads
    if heads % kv:
        raise ValueError(f"drafter heads {heads} must be a multiple of key/value heads {kv}")
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > vocab_size:
        raise ConfigError(
            f"drafter.draft_vocab_size={cfg.draft_vocab_size}: expected an int in [1, {vocab_size}] (the target's "
            "vocabulary), or null for all of it"
        )
    dims = DrafterDims(
        hidden,
        cfg.intermediate_size or 3 * hidden,
        heads,
        kv,
        head_dim,
        vocab_size,
        t_hidden,
        num_context_layers,
        mask_token_id,
    )
    return get_family(cfg.family).resolve_dims(cfg, dims, target_config)


class MarkovHead(nn.Module):
    """Logit bias from the previous token: W2(e_k) with e_k = W1[x_{k-1}] (vanilla, what vLLM
    serves), gated by the backbone state (gated), or carried along the block (rnn)."""

    def __init__(self, vocab: int, rank: int, hidden: int, kind: str, draft_vocab: Optional[int] = None):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab, rank)  # indexed by the previous (target) token
        self.markov_w2 = nn.Linear(rank, draft_vocab or vocab, bias=False)  # a bias on the draft logits
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as the plain (DFlash) drafter
        if kind == "gated":
            self.gate = nn.Linear(hidden, rank)
        elif kind == "rnn":
            self.recur = nn.Linear(rank, rank, bias=False)
            nn.init.zeros_(self.recur.weight)

    @torch.no_grad()
    def init_as_speculators(self) -> None:
        """``train.markov_init=speculators``: W1 ~ N(0, 0.01) and W2 nn.Linear's own (uniform) init,
        as speculators' DSpark starts (``speculators/models/dspark/model_definitions.py``): the
        head's bias is nonzero from the first step, where ours starts at W2 = 0."""
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2.reset_parameters()

    def embed(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """prev_ids: [..., K] previous tokens; hidden: [..., K, H]. Returns e: [..., K, R]."""
        e = self.markov_w1(prev_ids)
        if self.kind == "gated":
            e = e * torch.sigmoid(self.gate(hidden))
        elif self.kind == "rnn":
            steps, carry = [], torch.zeros_like(e[..., 0, :])
            for k in range(e.shape[-2]):
                carry = torch.tanh(e[..., k, :] + self.recur(carry))
                steps.append(carry)
            e = torch.stack(steps, dim=-2)
        return e


@dataclass
class DraftOutput:
    """Forward result at the K predicting positions of every anchor's block."""

    hidden: torch.Tensor  # [B, A, K, H] after the final norm (what lm_head and the confidence head read)
    markov_embed: Optional[torch.Tensor]  # [B, A, K, R], None when markov_rank == 0
    confidence_logits: Optional[torch.Tensor]  # [B, A, K], None without a confidence head


class DSparkDrafter(nn.Module):
    """Trainable backbone + heads; the target's embedding, final norm and LM head are frozen
    buffers-as-parameters (requires_grad=False) shared with the target.

    With ``cfg.draft_vocab_size`` set, ``d2t`` ([Vd] int64 offsets, :mod:`dspark.data.draft_vocab`) is
    required and kept as the persistent buffer ``d2t`` (so every checkpoint and export carries the
    map); ``lm_head`` is the frozen [Vd, H] rows of the target's head for the kept tokens, and
    ``target_lm_head`` the target's full head (the target distribution)."""

    def __init__(
        self,
        cfg: DSparkConfig,
        dims: DrafterDims,
        *,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
        target_norm: torch.Tensor,
        target_norm_eps: float,
        d2t: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        self.cfg, self.dims = cfg, dims
        if dims.hidden_size != embed_tokens.shape[1]:
            raise ValueError(
                f"drafter hidden {dims.hidden_size} must equal the target embedding width {embed_tokens.shape[1]} "
                f"(shared embedding/LM head)"
            )
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.clone(), freeze=True)
        self.draft_vocab_size = self._set_draft_vocab(cfg, dims, d2t)
        self.lm_head = nn.Linear(dims.hidden_size, self.draft_vocab_size, bias=False)
        if self.d2t is None:
            self.lm_head.weight = nn.Parameter(lm_head.clone(), requires_grad=False)
        else:
            self.target_lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)
            self.target_lm_head.weight = nn.Parameter(lm_head.clone(), requires_grad=False)
            self.lm_head.weight = nn.Parameter(lm_head[self.draft_to_target].clone(), requires_grad=False)
        self.target_norm = RMSNorm(dims.target_hidden_size, target_norm_eps)
        self.target_norm.weight = nn.Parameter(target_norm.clone(), requires_grad=False)
        self.fc = nn.Linear(dims.num_context_layers * dims.target_hidden_size, dims.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(dims.hidden_size, cfg.rms_norm_eps)
        self.family = get_family(cfg.family)
        self.layers = nn.ModuleList(self.family.layer(cfg, dims) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(dims.hidden_size, cfg.rms_norm_eps)
        self.markov_head = (
            MarkovHead(dims.vocab_size, cfg.markov_rank, dims.hidden_size, cfg.markov_head_type, self.draft_vocab_size)
            if cfg.markov_rank > 0
            else None
        )
        conf_in = dims.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov and self.markov_head else 0)
        self.confidence_head = nn.ModuleDict({"proj": nn.Linear(conf_in, 1)}) if cfg.enable_confidence_head else None
        self._init_weights()

    def _set_draft_vocab(self, cfg: DSparkConfig, dims: DrafterDims, d2t: Optional[torch.Tensor]) -> int:
        """Register the draft vocabulary's buffers (``d2t`` persistent; ``draft_to_target`` [Vd] and
        ``target_to_draft`` [V], -1 outside, derived); the draft vocabulary's size."""
        if cfg.draft_vocab_size is None:
            if d2t is not None:
                raise ValueError("a d2t map was given for a drafter without drafter.draft_vocab_size")
            self.d2t = self.draft_to_target = self.target_to_draft = None
            return dims.vocab_size
        if d2t is None:
            raise ValueError(
                f"drafter.draft_vocab_size={cfg.draft_vocab_size} needs its d2t map (dspark.data.draft_vocab)"
            )
        if tuple(d2t.shape) != (cfg.draft_vocab_size,):
            raise ValueError(
                f"d2t has shape {list(d2t.shape)}, expected [{cfg.draft_vocab_size}] (drafter.draft_vocab_size)"
            )
        if d2t.device.type != "meta":
            from dspark.data.draft_vocab import map_problem

            problem = map_problem(d2t, dims.vocab_size)
            if problem:
                raise ValueError(problem)
        d2t = d2t.to(torch.int64)
        self.register_buffer("d2t", d2t.clone())
        to_target = torch.arange(len(d2t), device=d2t.device) + d2t
        to_draft = torch.full((dims.vocab_size,), -1, dtype=torch.int64, device=d2t.device)
        to_draft[to_target] = torch.arange(len(d2t), device=d2t.device)
        self.register_buffer("draft_to_target", to_target, persistent=False)
        self.register_buffer("target_to_draft", to_draft, persistent=False)
        return cfg.draft_vocab_size

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (the identity for the full vocabulary)."""
        if self.draft_to_target is None:
            return draft_ids
        return self.draft_to_target.to(draft_ids.device)[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Target ids -> (draft ids, in_vocab): a token outside the draft vocabulary gets draft id 0
        and in_vocab False; ``in_vocab`` is None for the full vocabulary (every token is in it)."""
        if self.target_to_draft is None:
            return target_ids, None
        ids = self.target_to_draft.to(target_ids.device)[target_ids]
        return ids.clamp_min(0), ids >= 0

    def to_target_vocab(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[..., Vd] over draft ids -> [..., V] over target ids, ``fill`` outside the draft vocabulary
        (probabilities: 0; logits: -inf, as vLLM scatters a reduced draft before sampling)."""
        if self.draft_to_target is None:
            return values
        out = values.new_full((*values.shape[:-1], self.dims.vocab_size), fill)
        out[..., self.draft_to_target.to(values.device)] = values
        return out

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.requires_grad and p.dim() == 2 and "markov_head" not in name:
                nn.init.normal_(p, std=0.02)
        if self.confidence_head is not None:
            nn.init.zeros_(self.confidence_head["proj"].weight)
            nn.init.zeros_(self.confidence_head["proj"].bias)
        # The drafter reads out through the target's LM head: start its final norm where the
        # target's is, so initial logits have the target's scale (sharp heads learn much faster).
        with torch.no_grad():
            self.norm.weight.copy_(self.target_norm.weight.to(self.norm.weight.dtype))

    @torch.no_grad()
    def init_layers_from(self, layers: list[dict[str, torch.Tensor]]) -> None:
        """Copy target decoder layers into the drafter's (one per layer, names relative to the
        layer as :func:`dspark.target.load_target_layer` gives them). Norms the target lacks
        (Llama has no q/k norm) keep their identity init; a shape that differs is an error."""
        if len(layers) != len(self.layers):
            raise ValueError(f"{len(layers)} target layers for {len(self.layers)} drafter layers")
        for i, (layer, weights) in enumerate(zip(self.layers, layers)):
            own = dict(layer.named_parameters())
            missing = [n for n in own if n not in weights and not n.endswith(("q_norm.weight", "k_norm.weight"))]
            if missing:
                raise ValueError(f"drafter layer {i}: the target layer has no {missing}")
            for name, p in own.items():
                if name in weights:
                    if tuple(weights[name].shape) != tuple(p.shape):
                        raise ValueError(
                            f"drafter layer {i}: {name} is {list(p.shape)}, the target's is {list(weights[name].shape)}"
                        )
                    p.copy_(weights[name].to(p.dtype))

    @property
    def queries_per_block(self) -> int:
        return self.cfg.block_size if self.cfg.sample_from_anchor else self.cfg.block_size + 1

    def block_mask(
        self, anchor_positions: torch.Tensor, num_context: int, window: Optional[int] = None
    ) -> torch.Tensor:
        """[B, 1, A*Q, S + A*Q] bool: block j sees context < its anchor and its own block; with a
        ``window`` W, its query at position p sees only the context positions p0 with p - p0 < W
        (:func:`window_mask`, the served edge)."""
        b, a = anchor_positions.shape
        q = self.queries_per_block
        ctx_pos = torch.arange(num_context, device=anchor_positions.device)
        anchors = anchor_positions[:, :, None, None]  # [B, A, 1, 1]
        sees_ctx = ctx_pos < anchors  # [B, A, 1, S]
        if window is not None:
            sees_ctx = sees_ctx & window_mask(
                anchors + torch.arange(q, device=ctx_pos.device)[:, None], ctx_pos, window
            )
        sees_ctx = sees_ctx.expand(b, a, q, num_context).reshape(b, a * q, num_context)
        blk = torch.arange(a, device=anchor_positions.device).repeat_interleave(q)
        sees_blk = (blk[:, None] == blk[None, :]).expand(b, a * q, a * q)
        return torch.cat([sees_ctx, sees_blk], dim=-1)[:, None]

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        context_states: torch.Tensor,  # [B, S, C] target states of the context layers, S = T-1
        anchor_positions: torch.Tensor,  # [B, A] anchors in [1, T-2]; padded ones: any valid index (loss masks them)
    ) -> DraftOutput:
        b, a = anchor_positions.shape
        q, k_pred = self.queries_per_block, self.cfg.block_size
        ctx = self.hidden_norm(self.fc(context_states))  # [B, S, H]
        ctx_pos = torch.arange(ctx.shape[1], device=ctx.device).expand(b, -1)
        offsets = torch.arange(q, device=ctx.device)
        positions = (anchor_positions[:, :, None] + offsets).reshape(b, a * q)  # [B, A*Q]
        block_ids = torch.full((b, a, q), self.dims.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
        block_ids[:, :, 0] = input_ids.gather(1, anchor_positions)
        x = self.embed_tokens(block_ids.reshape(b, a * q)).to(ctx.dtype)
        mask = self.block_mask(anchor_positions, ctx.shape[1], self.cfg.attention_window)
        for layer in self.layers:
            x = layer(x, positions, ctx, ctx_pos, mask)
        hidden = self.norm(x).view(b, a, q, -1)[:, :, q - k_pred :]  # [B, A, K, H]
        # previous token of each prediction (teacher-forced): x_{a}, x_{a+1}, ..., x_{a+K-1}
        prev_pos = (anchor_positions[:, :, None] + torch.arange(k_pred, device=ctx.device)).clamp(
            max=input_ids.shape[1] - 1
        )
        prev_ids = input_ids.gather(1, prev_pos.reshape(b, a * k_pred)).view(b, a, k_pred)
        markov = self.markov_head.embed(prev_ids, hidden) if self.markov_head is not None else None
        conf = self.confidence_logits(hidden, markov) if self.confidence_head is not None else None
        return DraftOutput(hidden=hidden, markov_embed=markov, confidence_logits=conf)

    @torch.no_grad()
    def context_kv(self, context_states: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per-layer context cache for inference, as vLLM precomputes it: [B, S, C] target states at
        ``positions`` [B, S] -> one tuple per layer (the family's: (k, v) [B, Nkv, S, D] for GQA,
        latents (c [B, S, R], k_pe [B, S, Dr]) for MLA). Appending along the family's
        ``cache_seq_dim`` is exact (each position's entry depends on that position only), so a
        decoder extends it step by step (:meth:`extend_context`)."""
        ctx = self.hidden_norm(self.fc(context_states))
        return [layer.context_cache(ctx, positions) for layer in self.layers]

    def extend_context(
        self, cache: Optional[list[tuple[torch.Tensor, ...]]], new: list[tuple[torch.Tensor, ...]]
    ) -> list[tuple[torch.Tensor, ...]]:
        """``cache`` followed by ``new`` (both from :meth:`context_kv`), per layer."""
        if cache is None:
            return new
        dim = self.family.cache_seq_dim
        return [tuple(torch.cat([a, b], dim) for a, b in zip(old, add)) for old, add in zip(cache, new)]

    @torch.no_grad()
    def forward_block(
        self, block_ids: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, ...]]
    ) -> torch.Tensor:
        """One block per row over the cached context: block_ids, positions [B, Q] -> normed hidden
        [B, K, H] at the K predicting queries (the layout of :meth:`forward`; a block may be shorter
        than ``block_size``, as vLLM runs it when num_speculative_tokens < block_size). The cache
        holds context positions 0..S-1 (:meth:`context_kv`), all before the block. With
        ``drafter.attention_window`` W only its last W - 1 entries are read (what the block's first
        query sees), each query masked at its own edge, so the step's cost does not grow with S."""
        window = self.cfg.attention_window
        mask = None
        if window is not None:
            dim = self.family.cache_seq_dim
            length = context[0][0].shape[dim]
            start = max(0, length - (window - 1))
            context = [tuple(t.narrow(dim, start, length - start) for t in cache) for cache in context]
            ctx_pos = torch.arange(start, length, device=positions.device)
            sees_ctx = window_mask(positions[:, :, None], ctx_pos, window)  # [B, Q, S']
            sees_blk = sees_ctx.new_ones(*positions.shape, positions.shape[1])
            mask = torch.cat([sees_ctx, sees_blk], dim=-1)[:, None]
        x = self.embed_tokens(block_ids).to(context[0][0].dtype)
        for layer, cache in zip(self.layers, context):
            x = layer.forward_cached(x, positions, cache, mask)
        return self.norm(x)[:, 0 if self.cfg.sample_from_anchor else 1 :]

    def draft_logits(self, hidden: torch.Tensor, markov_embed: Optional[torch.Tensor]) -> torch.Tensor:
        """[..., H] (+ [..., R]) -> [..., V]: LM head plus the Markov bias."""
        logits = self.lm_head(hidden).float()
        if markov_embed is not None:
            logits = logits + self.markov_logits(markov_embed)
        return logits

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]: the LM head alone, fp32 (:func:`few_rows_linear`)."""
        return few_rows_linear(self.lm_head, hidden)

    def markov_logits(self, markov_embed: torch.Tensor) -> torch.Tensor:
        """[..., R] -> [..., V]: the Markov head's bias on the draft logits, W2(e)."""
        return self.markov_head.markov_w2(markov_embed).float()

    def confidence_logits(self, hidden: torch.Tensor, markov_embed: Optional[torch.Tensor]) -> torch.Tensor:
        """[..., H] (+ [..., R]) -> [...]: the confidence head's logit, sigmoid(.) = P(accept)."""
        use_markov = markov_embed is not None and self.cfg.confidence_head_with_markov
        feats = torch.cat([hidden, markov_embed], dim=-1) if use_markov else hidden
        proj = self.confidence_head["proj"]  # fp32 when kept so (as vLLM serves it), else the model's dtype
        return proj(feats.to(proj.weight.dtype)).float().squeeze(-1)

    def target_logits(self, final_states: torch.Tensor) -> torch.Tensor:
        """[..., Ht] target final pre-norm states -> [..., V] target logits (frozen norm + the
        target's full head, whatever the draft vocabulary)."""
        head = self.lm_head if self.d2t is None else self.target_lm_head
        return head(self.target_norm(final_states).to(head.weight.dtype)).float()

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def few_rows_linear(linear: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """[..., in] -> [..., out] fp32: ``linear(hidden)`` computed as W @ h^T, for a few rows at
    inference (a block of draft or verify positions): on CPU torch's h @ W^T with 7 rows took 4x as
    long (34 against 8 ms at V 49152, H 576, 2 cores). Equal to ``linear(hidden)`` up to rounding."""
    w = linear.weight
    flat = hidden.reshape(-1, hidden.shape[-1]).to(w.dtype)
    out = (w @ flat.T).T.reshape(*hidden.shape[:-1], w.shape[0]).float()
    return out if linear.bias is None else out + linear.bias.float()


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding window's edge as vLLM and llama.cpp serve it: a query at position p sees a key at
    p0 when ``p - p0 < window`` (W keys counting its own position; ``llama_hparams::is_masked_swa``
    masks ``p - p0 >= W``, vLLM's non-causal window is W - 1 to either side). Broadcasts."""
    return query_positions - key_positions < window


def unloaded_drafter(cfg: DSparkConfig, dims: DrafterDims, device: str = "meta") -> DSparkDrafter:
    """A drafter of ``cfg``'s shape with no weights loaded: on the meta device nothing is allocated
    (its shapes, its FLOPs or its saved tensors counted without computing); elsewhere the target's
    tensors are uninitialised and a draft vocabulary maps to its first tokens."""
    with torch.device(device):
        return DSparkDrafter(
            cfg,
            dims,
            embed_tokens=torch.empty(dims.vocab_size, dims.hidden_size),
            lm_head=torch.empty(dims.vocab_size, dims.hidden_size),
            target_norm=torch.empty(dims.target_hidden_size),
            target_norm_eps=cfg.rms_norm_eps,
            d2t=torch.zeros(cfg.draft_vocab_size, dtype=torch.int64) if cfg.draft_vocab_size else None,
        )


def trainable_parameter_shapes(cfg: DSparkConfig, dims: DrafterDims) -> dict[str, tuple[int, ...]]:
    """Every trainable tensor of the drafter and its shape, read off the model itself (built on
    the meta device, so nothing is allocated): the checkpoint's names (the served names through
    the family's :meth:`~dspark.families.base.DrafterFamily.to_serving`), plus the draft
    vocabulary's ``d2t`` map when the drafter has one (a buffer, kept with the weights)."""
    model = unloaded_drafter(cfg, dims)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    if model.d2t is not None:
        shapes["d2t"] = tuple(model.d2t.shape)
    return shapes


def copy_continuations(ids: torch.Tensor) -> torch.Tensor:
    """[n] token ids -> [n] bool: True at a when the bigram (x_a, x_{a+1}) occurred earlier in the
    sequence (at some j < a), i.e. the next token continues something already in the context,
    which is where answers copy from documents. False at the last position."""
    n = len(ids)
    out = torch.zeros(n, dtype=torch.bool)
    if n < 3:
        return out
    bigram = ids[:-1] * (int(ids.max()) + 1) + ids[1:]  # [n-1]
    _, inverse = torch.unique(bigram, return_inverse=True)
    pos = torch.arange(n - 1)
    first = torch.full((int(inverse.max()) + 1,), n, dtype=torch.long).scatter_reduce(0, inverse, pos, reduce="amin")
    out[: n - 1] = first[inverse] < pos
    return out


def sample_anchors(
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator,
    *,
    input_ids: Optional[torch.Tensor] = None,
    copy_boost: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors where the anchor and its first label are answer tokens.

    loss_mask: [B, T] bool; lengths: [B]. Returns (anchor_positions [B, A], valid [B, A]); rows
    with fewer candidates than A are padded with their first candidate (or 1) and valid=False.
    ``copy_boost`` > 0 (needs ``input_ids``): a candidate whose next token continues a bigram
    seen earlier (:func:`copy_continuations`) is drawn with weight 1 + copy_boost instead of 1.
    """
    b, t = loss_mask.shape
    anchors = torch.ones(b, num_anchors, dtype=torch.long)
    valid = torch.zeros(b, num_anchors, dtype=torch.bool)
    for i in range(b):
        n = int(lengths[i])
        m = loss_mask[i, :n]
        cand = torch.nonzero(m[1 : n - 1] & m[2:n], as_tuple=False).flatten() + 1  # a in [1, n-2]
        if len(cand) == 0:
            continue
        if copy_boost > 0 and len(cand) > num_anchors:
            assert input_ids is not None, "copy_boost needs input_ids"
            w = 1.0 + copy_boost * copy_continuations(input_ids[i, :n])[cand].double()
            order = torch.multinomial(w, num_anchors, replacement=False, generator=generator)
        else:
            order = torch.randperm(len(cand), generator=generator)[:num_anchors]
        pick = cand[order].sort().values
        anchors[i, : len(pick)] = pick
        anchors[i, len(pick) :] = pick[0]
        valid[i, : len(pick)] = True
    return anchors, valid
