"""Stage 3: export the checkpoint for vLLM, then measure acceptance on AA-LCR-style prompts with
the reference loop and with vLLM itself, and write the report.

    python -m eval.run +experiment=smollm2_cpu_demo                    # this run's checkpoint
    python -m eval.run +experiment=... eval.checkpoint=PATH eval.ablation_checkpoint=PATH
    python -m eval.run +experiment=... eval.checkpoint=DRAFTER_DIR  # an export, or a speculators DSpark checkpoint
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from dspark.checkpoint_tags import latest_tag
from dspark.core.config import ConfigError, RunConfig, config_fingerprint, eval_fields, load_config
from dspark.core.errors import exit_on_user_error, run_hydra_command, task_started
from dspark.core.files import atomic_write_json, holding, read_json
from dspark.core.serving_methods import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN, export_method
from dspark.export import ExportSummary
from dspark.export.vllm_format import load_drafter, read_export
from eval.acceptance import AcceptanceCounts, per_bin_summary
from eval.checks import quality_checks
from eval.eval_set import eval_set_sha256
from eval.inputs import checkpoint_file, claim_out_dir, engine_kwargs, eval_set, export_all, vllm_max_model_len
from eval.llama_cpp_rows import llama_cpp_results, llama_cpp_wanted
from eval.results import (
    Check,
    DrafterResult,
    EvalConditions,
    EvalResults,
    drafter_from_dict,
    load_checks,
    load_results,
    nan_to_none,
    outputs_equal,
)
from eval.vllm_rows import ServeSpec, run_in_subprocess

log = logging.getLogger(__name__)


@dataclass
class EvalOutcome:
    results: EvalResults
    report_dir: Path
    exports: dict[str, Path] = field(default_factory=dict)
    report: Any = None
    checks: list[Check] = field(default_factory=list)  # the quality targets, measured


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
        if export_dir is not None:  # its block holds eval.gamma drafts: export_all validated it at that many
            exp = read_export(export_dir)
            if export_dir not in runners:
                runners[export_dir] = DraftRunner(load_drafter(exp, heads).to(device))
            draft, layers = runners[export_dir], list(exp.context_layer_ids)
            method = "dspark" if exp.drafter.sample_from_anchor else "dflash-layout"
            method = f"ngram-then-{method}" if lookup is not None else method
        return cls(name, export_dir, lookup, dcfg, draft, layers, method, torch.Generator().manual_seed(dcfg.seed))

    def result(self, prompts: list, plain_tps: Optional[float]) -> DrafterResult:
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
            + (f", plain decoding {1e3 / plain_tps:.1f} ms/token" if plain_tps else ""),
            per_prompt=_per_prompt(prompts, counts, [g.tokens for g in self.gens]),
        )


def _eos_ids(heads: Any) -> set[int]:
    eos = heads.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def vllm_eval(
    name: str,
    method: str,
    draft: Optional[Path],
    target_dir: Path,
    prompts_file: Path,
    cfg: RunConfig,
    out_dir: Path,
    max_model_len: int,
) -> DrafterResult:
    gamma, e = cfg.eval.gamma, cfg.eval
    spec = ServeSpec(
        target_dir,
        method,
        prompts_file,
        gamma,
        max_model_len,
        e.vllm_cpu_kvcache_gib,
        draft=draft,
        max_new_tokens=e.max_new_tokens,
        temperature=e.temperature,
        dtype=cfg.target.dtype,
        seed=e.seed,
        engine_kwargs=engine_kwargs(cfg),
    )
    run = run_in_subprocess(spec, out_dir / f"vllm_{name}.json", timeout=e.vllm_timeout_s)
    total, per = AcceptanceCounts(gamma), {}
    for b, d in run.per_bin.items():
        c = AcceptanceCounts.from_dict({"gamma": gamma, **d})
        per[b] = {**c.summary(), "num_prompts": d["num_prompts"]}
        total.merge(c)
    return DrafterResult(
        name,
        "vllm",
        method,
        total.summary(),
        per,
        notes=f"vLLM {method}{' ' + str(draft) if draft else ''}; engine start {run.engine_start_s:.0f}s; "
        "one prompt at a time, steps from the engine's inter-token-latency count",
        per_prompt=[{"gamma": gamma, **p, "output_ids": run.outputs.get(p["prompt_id"])} for p in run.per_prompt],
    )


def ablation_checkpoint(cfg: RunConfig) -> Optional[Path]:
    """``eval.ablation_checkpoint``: a path, null, or auto = the Markov-off run of this very
    config (``RunConfig.ablation_dir``: what ``python train.py +experiment=...
    drafter.markov_rank=0`` trains), when it has been trained."""
    value = cfg.eval.ablation_checkpoint
    if value is None or value in ("", "null", "none"):
        return None
    if value != "auto":
        return Path(value).expanduser()
    if cfg.ablation_dir is None:
        return None  # this run is the ablation
    path = Path(cfg.ablation_dir).expanduser()
    return path if latest_tag(path) is not None else None


# which eval fields each fingerprint leaves out: declared on the fields (EvalConfig's ``part`` metadata)
NOT_SETTINGS = eval_fields("run_control")
"""Eval fields that say how an eval is run or where it writes, not what it measures."""
LLAMA_CPP_SETTINGS = eval_fields("llama_cpp")
"""Eval fields only llama.cpp's rows depend on: the reference loop's and vLLM's parts are kept across them."""
NOT_LLAMA_CPP_SETTINGS = eval_fields("not_llama_cpp")
"""Eval fields llama.cpp's rows do not depend on (the other parts' rows, the checks' lines): turning
the reference loop on for a parity table keeps llama.cpp's measured rows."""


def fingerprint(cfg: RunConfig, checkpoints: list[Path], *, without: tuple[str, ...] = ()) -> str:
    """What an eval report depends on: the eval settings (not how it is run: ``force``, the
    timeouts; nor those in ``without``), the target, and which checkpoint files it read (path,
    size, mtime). Equal fingerprints: the report is up to date."""
    files = []
    for c in checkpoints:
        f = checkpoint_file(c)
        st = f.stat()
        files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    settings = {k: v for k, v in asdict(cfg.eval).items() if k not in NOT_SETTINGS + without}
    return config_fingerprint({"eval": settings, "target": asdict(cfg.target), "files": files})


def run_eval(cfg: RunConfig | DictConfig, heads: Any, target_dir: Path) -> EvalOutcome:
    """Export (and validate) the checkpoints, build the eval set, measure every drafter, report.
    Skipped when results.json already holds this fingerprint (same checkpoint files, settings);
    after a killed eval, the parts it finished are kept (:class:`Parts`) and the rest is measured.
    Its output and export directories are held while it runs: a second eval on either is refused
    naming the first."""
    cfg = load_config(cfg)
    out_dir = Path(cfg.eval.out_dir).expanduser()
    claim_out_dir(out_dir, key="eval.out_dir", stage="eval", earlier=("results.json", "parts"))
    with (
        holding(out_dir, key="eval.out_dir", what="eval"),
        holding(Path(cfg.eval.export_dir).expanduser(), key="eval.export_dir", what="eval's export"),
    ):
        return _run_eval(cfg, heads, target_dir, out_dir)


def _run_eval(cfg: RunConfig, heads: Any, target_dir: Path, out_dir: Path) -> EvalOutcome:
    e = cfg.eval
    ckpt = Path(e.checkpoint or Path(cfg.train.checkpoint_dir)).expanduser()
    ablation = ablation_checkpoint(cfg)
    fp = fingerprint(cfg, [ckpt] + ([ablation] if ablation else []))  # the whole report's
    done = _up_to_date(out_dir, fp)
    if done is not None and not e.force:
        log.info(
            "eval: %s is up to date (same checkpoint files and eval settings), skipped; eval.force=true reruns it",
            out_dir / "report.md",
        )
        return done
    t0 = time.perf_counter()
    prompts, prompts_file = eval_set(cfg, heads, out_dir)  # a bad prompts file stops it before any export
    exports = {"ours": export_all(cfg, ckpt, target_dir, "dspark")}
    if ablation is not None:
        log.info("Markov-off ablation: %s", ablation)
        exports["ablation"] = export_all(cfg, ablation, target_dir, "ablation")
    seconds = {"export": round(time.perf_counter() - t0, 1)}  # every part's wall clock, in the order run
    checkpoints = [ckpt] + ([ablation] if ablation else [])
    # the reference loop's and vLLM's parts do not depend on llama.cpp's settings: another llama.cpp
    # target or method list measures llama.cpp's rows again and keeps the rest
    # (whether llama.cpp's rows are measured at all is in their key: the reference loop then ends
    # each answer as llama.cpp does)
    core = config_fingerprint(
        {"eval": fingerprint(cfg, checkpoints, without=LLAMA_CPP_SETTINGS), "llama_cpp_beside": llama_cpp_wanted(cfg)}
    )
    parts = Parts(out_dir / "parts", _parts_key(core, prompts), not e.force, seconds)
    drafters = []
    if e.reference:
        drafters += parts.get_or_run("reference", lambda: reference_results(cfg, heads, target_dir, prompts, exports))
    drafters += vllm_results(cfg, target_dir, prompts, prompts_file, out_dir, exports, parts=parts)
    if llama_cpp_wanted(cfg):
        llama_fp = fingerprint(cfg, checkpoints, without=NOT_LLAMA_CPP_SETTINGS)
        llama_parts = Parts(out_dir / "parts", _parts_key(llama_fp, prompts), reuse=not e.force, seconds=seconds)
        drafters += llama_cpp_results(cfg, target_dir, prompts, out_dir, exports, llama_parts)
    equal = greedy_outputs_equal(cfg, drafters)
    parity = llama_cpp_parity(drafters)
    conditions = _conditions(
        cfg,
        target_dir,
        prompts,
        ckpt,
        exports,
        extra={
            "eval_seconds": round(time.perf_counter() - t0, 1),
            "part_seconds": seconds,
            "fingerprint": fp,
            "ablation_checkpoint": str(ablation) if ablation else None,
            **({"greedy_outputs_equal": equal} if equal else {}),
            **({"llama_cpp_parity": parity} if parity else {}),
        },
    )
    return _report(cfg, EvalResults(conditions, drafters), out_dir, exports)


@dataclass
class Parts:
    """The finished parts of an eval (the reference loop's results, each vLLM method's), kept as
    ``<out_dir>/parts/<name>.json`` so that a killed eval's rerun redoes only what was not
    finished. Each is written atomically once its part is complete and carries ``key`` (the
    eval's fingerprint and the eval set's hash): a part is reused only when its file reads
    whole and its key is this run's; ``reuse`` False (``eval.force``) measures everything again."""

    dir: Path
    key: str
    reuse: bool = True
    seconds: dict[str, float] = field(default_factory=dict)
    """Each part measured by this run: its wall clock (a kept part is not in it)."""

    def get_or_run(self, name: str, run: Any) -> list[DrafterResult]:
        kept = self.get(name)
        if kept is not None:
            return kept
        t0 = time.perf_counter()
        drafters = run()
        self.seconds[name] = round(time.perf_counter() - t0, 1)
        self.put(name, drafters)
        return drafters

    def get(self, name: str) -> Optional[list[DrafterResult]]:
        path = self.dir / f"{name}.json"
        if not self.reuse or not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("key") != self.key:
                log.info("eval: %s is from other checkpoints, settings or prompts: measured again", path)
                return None
            drafters = [drafter_from_dict(d) for d in data["drafters"]]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            log.warning("eval: %s is unreadable (%s): measured again", path, err)
            return None
        log.info("eval: %s kept from an earlier run (same checkpoints, settings and prompts)", path)
        return drafters

    def put(self, name: str, drafters: list[DrafterResult]) -> None:
        payload = {"key": self.key, "drafters": [asdict(d) for d in drafters]}
        atomic_write_json(self.dir / f"{name}.json", nan_to_none(payload), indent=1, allow_nan=False)


def _parts_key(fp: str, prompts: list) -> str:
    return config_fingerprint({"fingerprint": fp, "eval_set_sha256": eval_set_sha256(prompts)})


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
    return [ps.result(prompts, plain) for ps in passes]


def vllm_results(
    cfg: RunConfig,
    target_dir: Path,
    prompts: list,
    prompts_file: Path,
    out_dir: Path,
    exports: dict[str, dict[str, ExportSummary]],
    parts: Optional[Parts] = None,
) -> list[DrafterResult]:
    """The baselines (ngram) and our exports as vLLM serves them: ``dspark`` on a GPU, the
    ``dflash`` export on CPU when the drafter has that layout. With ``parts``, a method already
    measured (by a killed run, same fingerprint) is kept, not served again."""
    max_len = vllm_max_model_len(cfg, prompts)
    runs: list[tuple[str, str, Optional[Path]]] = [(m, m, None) for m in cfg.eval.baselines]
    for who, ex in exports.items() if cfg.eval.serve_export != "never" else ():
        served = export_method(gpu=torch.cuda.is_available(), has_layout=ex.__contains__)
        if served is not None:
            runs.append((f"vllm-{served.name}-{who}", served.name, ex[served.layout].out_dir))
        else:
            log.info(
                "vLLM on CPU serves only the dflash layout; the %s export is measured by the reference loop "
                "(serve it on a GPU: python -m eval.serve --method dspark --draft %s)",
                who,
                ex["dspark"].out_dir,
            )
    out = []
    for name, method, draft in runs:

        def serve(name: str = name, method: str = method, draft: Optional[Path] = draft) -> list[DrafterResult]:
            return [vllm_eval(name, method, draft, target_dir, prompts_file, cfg, out_dir, max_len)]

        out += parts.get_or_run(f"vllm_{name}", serve) if parts is not None else serve()
    return out


def greedy_outputs_equal(cfg: RunConfig, drafters: list[DrafterResult]) -> dict[str, dict[str, Any]]:
    """Per row, how many prompts' greedy outputs equal the reference's token for token: the
    outputs of ``eval.reference_outputs`` (another run, e.g. vLLM on CPU), else this run's first
    vLLM row. Every method here is lossless, so under greedy decoding each should reproduce the
    target's own text; a prompt that differs shows where two numerics part (fp32 on CPU and GPU,
    a verify of 8 tokens against one). Empty when sampling or when there is no reference."""
    if cfg.eval.temperature > 0:
        return {}
    if cfg.eval.reference_outputs:
        path = Path(cfg.eval.reference_outputs).expanduser()
        expected = "expected the JSON that python -m eval.serve --out writes, with 'outputs' (prompt id -> token ids)"
        if not path.is_file():
            raise ConfigError(f"eval.reference_outputs={path}: no such file; {expected}")
        data = read_json(path, expected=expected, error=ConfigError)
        outputs = data.get("outputs") if isinstance(data, dict) else None
        if not isinstance(outputs, dict):
            raise ConfigError(f"eval.reference_outputs={path}: {expected}")
        reference = {str(k): v for k, v in outputs.items()}
        source = str(path)
    else:
        first = next((d for d in drafters if d.runner == "vllm" and d.per_prompt), None)
        if first is None:
            return {}
        reference = {str(p["prompt_id"]): p["output_ids"] for p in first.per_prompt if p.get("output_ids") is not None}
        source = f"vLLM {first.name} in this run"
    out = {}
    for d in drafters:
        equal, total = outputs_equal(d.per_prompt, reference)
        if total:
            out[d.name] = {"equal": equal, "prompts": total, "reference": source}
            log.info("eval: %s: %d of %d prompts' greedy outputs equal %s's", d.name, equal, total, source)
    return out


LLAMA_CPP_TWINS = (
    ("llama.cpp-dspark", "dspark"),
    ("llama.cpp-ngram-then-dspark", "ngram-then-dspark"),
    ("llama.cpp-markov-off", "markov-off"),
)
"""llama.cpp rows and their twins in the reference loop (the exact acceptance instrument)."""


def llama_cpp_parity(drafters: list[DrafterResult]) -> dict[str, dict[str, Any]]:
    """Per llama.cpp row with a reference-loop twin, per prompt: are the generated tokens equal
    (and where they first differ), and the accepted tokens, drafts and steps of each side. Under
    greedy decoding both are lossless, so the tokens should be equal where the targets' numerics
    are; the accepted tokens then say whether the two drafters are the same drafter."""
    by = {d.name: d for d in drafters}
    out = {}
    for name, twin in LLAMA_CPP_TWINS:
        if name not in by or twin not in by:
            continue
        ref = {str(p["prompt_id"]): p for p in by[twin].per_prompt}
        rows = []
        for p in by[name].per_prompt:
            r = ref.get(str(p["prompt_id"]))
            if r is None or r.get("output_ids") is None:
                continue
            a, b = p["output_ids"], r["output_ids"]
            diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if diff is None and len(a) != len(b):
                diff = min(len(a), len(b))
            rows.append(
                {
                    "prompt_id": p["prompt_id"],
                    "bin": p["bin"],
                    "tokens_equal": diff is None,
                    "first_difference": diff,
                    "accepted": [p["num_accepted"], r["num_accepted"]],
                    "drafts": [p["num_drafts"], r["num_drafts"]],
                    "steps": [p["num_steps"], r["num_steps"]],
                }
            )
        out[name] = {
            "reference": twin,
            "prompts": len(rows),
            "tokens_equal": sum(r["tokens_equal"] for r in rows),
            "accepted_equal": sum(r["accepted"][0] == r["accepted"][1] for r in rows),
            "per_prompt": rows,
        }
        log.info(
            "eval: %s against the reference loop's %s: tokens equal on %d of %d prompts, accepted tokens on %d",
            name,
            twin,
            out[name]["tokens_equal"],
            len(rows),
            out[name]["accepted_equal"],
        )
    return out


def _conditions(
    cfg: RunConfig, target_dir: Path, prompts: list, ckpt: Path, exports: dict, extra: dict
) -> EvalConditions:
    e, bins = cfg.eval, sorted({p.bin for p in prompts})
    return EvalConditions(
        target=cfg.target.name,
        target_path=str(target_dir),
        gamma=e.gamma,
        temperature=e.temperature,
        max_new_tokens=e.max_new_tokens,
        prompt_source=str(e.prompts_file or e.source),
        context_bins=bins,
        prompts_per_bin={str(b): sum(p.bin == b for p in prompts) for b in bins},
        checkpoint=str(ckpt),
        export_dir=str(exports["ours"]["dspark"].out_dir),
        dtype=f"reference loop float32, vLLM {cfg.target.dtype}",
        device="cuda" if torch.cuda.is_available() else "cpu",
        extra={"eval_set_sha256": eval_set_sha256(prompts), "confidence_threshold": e.confidence_threshold, **extra},
    )


def _report(cfg: RunConfig, results: EvalResults, out_dir: Path, exports: dict) -> EvalOutcome:
    """The quality checks, results.json, report.md, plots and the W&B run."""
    from eval.report import write_report

    checks = quality_checks(results, cfg.eval)
    for c in checks:
        log.info("target %-48s %s  %s", c.name, c.verdict, c.detail)
    run = _wandb(cfg, out_dir)
    report = write_report(results, out_dir, checks=checks, wandb_run=run)
    if run is not None:
        run.finish()
    log.info("eval report: %s (plots %s)", report.markdown, ", ".join(str(p) for p in report.plots.values()))
    return EvalOutcome(results, out_dir, {k: v["dspark"].out_dir for k, v in exports.items()}, report, checks)


def _up_to_date(out_dir: Path, fp: str) -> Optional[EvalOutcome]:
    path = out_dir / "results.json"
    if not path.is_file():
        return None
    try:
        results = load_results(path)
    except (ValueError, KeyError, TypeError):
        return None  # unreadable or from an older layout: evaluate again
    if results.conditions.extra.get("fingerprint") != fp:
        return None
    return EvalOutcome(results, out_dir, checks=load_checks(path) or [])


def _wandb(cfg: RunConfig, out_dir: Path):  # noqa: ANN202
    from dspark.core.wandb_run import init_wandb

    return init_wandb(cfg, out_dir, job_type="eval")


def main() -> None:
    import hydra

    import dspark.core.config  # noqa: F401
    from dspark.core.target import prepare_target

    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def _main(raw: DictConfig) -> None:
        task_started()
        with exit_on_user_error():  # error: <message> and exit status 2, no traceback
            cfg = load_config(raw)
            heads, target_dir = prepare_target(cfg)
            run_eval(cfg, heads, target_dir)

    run_hydra_command(_main)


if __name__ == "__main__":
    main()
