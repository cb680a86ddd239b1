"""The reference loop's rows of the eval (``eval.reference_proposers``): our drafter (and its
ablation) read back from their exports, the prompt lookup chained before it, the lookup alone,
each measured in the PyTorch loop of :mod:`eval.reference` on the same prefills, with plain
decoding timed for the wall-clock speedup."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

from dspark.config import RunConfig
from dspark.export import ExportSummary
from dspark.export.vllm_format import load_drafter, read_export
from dspark.serving.methods import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN
from eval.acceptance import AcceptanceCounts, per_bin_summary
from eval.engine_args import vllm_max_model_len
from eval.llama_cpp_rows import llama_cpp_wanted
from eval.results import DrafterResult

log = logging.getLogger(__name__)


def _per_prompt(prompts: list, counts: list[AcceptanceCounts], outputs: list[list[int]]) -> list[dict[str, Any]]:
    return [
        {"prompt_id": p.prompt_id, "bin": p.bin, **asdict(c), "output_ids": out}
        for p, c, out in zip(prompts, counts, outputs)
    ]


@dataclass
class _ReferencePass:
    """One proposer in the PyTorch reference loop, run prompt by prompt beside the others
    (:func:`reference_results`): our drafter read back from its export (``export_dir``), vLLM's
    prompt lookup (``lookup``, an :class:`eval.reference.PromptLookup`), or both chained (the lookup
    first)."""

    name: str
    export_dir: Optional[Path]
    lookup: Any
    dcfg: Any  # eval.reference.DecodeConfig
    draft: Any  # eval.reference.DraftRunner, or None
    layers: list[int]
    method: str
    gen: torch.Generator
    gens: list[Any] = field(default_factory=list)  # eval.reference.Generation, one per prompt

    @classmethod
    def of(
        cls,
        name: str,
        export_dir: Optional[Path],
        heads: Any,
        device: Any,
        cfg: RunConfig,
        runners: dict[Path, Any],
        lookup: Any = None,
    ):
        """``runners``: the drafters loaded so far, by export; a pass over the same export shares its
        runner (each pass resets it per prompt), so the chain does not load a second copy."""
        from eval.reference import DecodeConfig, DraftRunner

        # beside llama.cpp's rows, the drafter's rows end an answer as llama.cpp does (their twins);
        # the lookup alone stays vLLM's ngram's twin
        dcfg = DecodeConfig.of(cfg.eval, budget_blocks=export_dir is not None and llama_cpp_wanted(cfg))
        draft, layers, method = None, [], "ngram"
        if export_dir is not None:  # its block holds eval.gamma drafts: the export stage checked it at that many
            exp = read_export(export_dir)
            if export_dir not in runners:
                runners[export_dir] = DraftRunner(load_drafter(exp, heads).to(device))
            draft, layers = runners[export_dir], list(exp.context_layer_ids)
            method = "dspark" if exp.drafter.sample_from_anchor else "dflash-layout"
            method = f"ngram-then-{method}" if lookup is not None else method
        return cls(name, export_dir, lookup, dcfg, draft, layers, method, torch.Generator().manual_seed(dcfg.seed))

    def result(self, prompts: list, plain_tps: Optional[float], plain_over: Optional[int] = None) -> DrafterResult:
        counts = [g.counts for g in self.gens]
        overall, per_bin = per_bin_summary([p.bin for p in prompts], counts, self.dcfg.gamma)
        steps = max(overall["num_steps"], 1)
        tokens = sum(len(g.tokens) - 1 for g in self.gens)  # the first token comes from prefill
        dec_s, draft_s, verify_s = (sum(getattr(g, k) for g in self.gens) for k in ("decode_s", "draft_s", "verify_s"))
        where = f"export {self.export_dir}" if self.export_dir is not None else "no drafter"
        if self.lookup is not None:
            where += f"; vLLM's prompt lookup (n-grams {self.lookup.min_n}-{self.lookup.max_n}) first"
        from eval.reference import calibration

        return DrafterResult(
            self.name,
            "reference",
            self.method,
            overall,
            per_bin,
            calibration([c for g in self.gens for c in g.confidence]),
            draft_cost_ratio=(draft_s / steps) / (verify_s / steps) if verify_s else None,
            tokens_per_s=tokens / dec_s if dec_s else None,
            baseline_tokens_per_s=plain_tps,
            notes=f"{where}; decode phase only (prefill excluded); per step: draft "
            f"{1e3 * draft_s / steps:.1f} ms, target verify of up to {self.dcfg.gamma + 1} tokens "
            f"{1e3 * verify_s / steps:.1f} ms"
            + (f", plain decoding {1e3 / plain_tps:.1f} ms/token" if plain_tps else "")
            + (f" (each answer's first {plain_over} tokens)" if plain_tps and plain_over else ""),
            per_prompt=_per_prompt(prompts, counts, [g.tokens for g in self.gens]),
        )


def _eos_ids(heads: Any) -> set[int]:
    eos = heads.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def reference_results(
    cfg: RunConfig, heads: Any, target_dir: Path, prompts: list, exports: dict[str, dict[str, ExportSummary]]
) -> list[DrafterResult]:
    """The rows of ``eval.reference_proposers`` in the PyTorch reference loop: our drafter (and
    its ablation) read back from their exports, the prompt lookup chained before it, the lookup
    alone; plain decoding of the same target is timed for the wall-clock speedup. The loop runs
    prompt by prompt: the target prefills a prompt once (its cache, logits and context states), and
    every pass over it (plain decoding, each row) starts from that prefill, which no row's timing
    counts; each row's numbers are those of its own pass over every prompt."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from eval.reference import (
        DecodeConfig,
        TargetRunner,
        plain_generate,
        prefill_prompt,
        speculative_generate,
        state_columns,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"  # fp32 on either: the numbers vLLM's CPU run has
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
    names = {"ours": "dspark", "ablation": "markov-off"}
    wanted = cfg.eval.reference_proposers
    passes, runners = [], {}
    if "dspark" in wanted:
        passes += [
            _ReferencePass.of(names[who], ex["dspark"].out_dir, heads, device, cfg, runners)
            for who, ex in exports.items()
        ]
    chained = [r for r in wanted if r.startswith("ngram")]
    if chained:
        from eval.reference import PromptLookup

        lookup = PromptLookup(PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX, vllm_max_model_len(cfg, prompts))
        for r in chained:
            export_dir = exports["ours"]["dspark"].out_dir if r == "ngram-then-dspark" else None
            name = r if export_dir is not None else "ngram-reference"
            passes.append(_ReferencePass.of(name, export_dir, heads, device, cfg, runners, lookup=lookup))
    layers = list(dict.fromkeys(i for ps in passes for i in ps.layers))  # every drafter's, in first-seen order
    tr = TargetRunner(model, layers)
    width = int(model.config.get_text_config().hidden_size)
    for ps in passes:
        if ps.draft is not None:
            ps.draft.columns = state_columns(layers, ps.layers, width)
    plain_cfg, eos, plain_tokens, plain_s = DecodeConfig.of(cfg.eval), _eos_ids(heads), 0, 0.0
    if cfg.eval.plain_tokens is not None:  # timed over each answer's first tokens
        plain_cfg = replace(plain_cfg, max_new_tokens=min(plain_cfg.max_new_tokens, cfg.eval.plain_tokens))
    todo = [("plain decoding", None)] * bool(cfg.eval.measure_plain) + [(ps.name, ps) for ps in passes]
    with tqdm(total=len(prompts) * len(todo), desc="reference loop", unit="pass") as bar:
        for p in prompts:
            ids = p.prompt_token_ids
            prefill = prefill_prompt(tr, ids)
            for name, ps in todo:
                bar.set_postfix_str(f"prompt {p.prompt_id}, {name}")
                if ps is None:  # plain decoding: a fresh generator per prompt, as ever
                    g = plain_generate(tr, ids, plain_cfg, eos, torch.Generator().manual_seed(0), prefill=prefill)
                    plain_tokens, plain_s = plain_tokens + len(g.tokens) - 1, plain_s + g.decode_s
                else:
                    ps.gens.append(
                        speculative_generate(tr, ps.draft, ids, ps.dcfg, eos, ps.gen, lookup=ps.lookup, prefill=prefill)
                    )
                bar.update()
    plain = (plain_tokens / plain_s if plain_s else float("nan")) if cfg.eval.measure_plain else None
    capped = plain_cfg.max_new_tokens < cfg.eval.max_new_tokens
    return [ps.result(prompts, plain, plain_cfg.max_new_tokens if capped else None) for ps in passes]
