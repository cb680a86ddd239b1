"""Stage 3: measure acceptance of the exports the export stage listed (``exports.json``) on
AA-LCR-style prompts, with the reference loop, vLLM and llama.cpp, and write the report.

    python -m eval.run +experiment=smollm2_cpu_demo                    # this run's checkpoint
    python -m eval.run +experiment=... export.checkpoint=PATH eval.ablation_checkpoint=PATH
    python -m eval.run +experiment=... export.checkpoint=DRAFTER_DIR  # an export, or a speculators DSpark checkpoint

The command runs the export stage first (:func:`dspark.export.stage.run_export`, a no-op when its
record is up to date), as ``python train.py stages=[eval]`` does; :func:`run_eval` itself never
exports.
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

from dspark.config import RunConfig, config_fingerprint, eval_fields, load_config
from dspark.core.atomic_files import atomic_write_json
from dspark.core.errors import exit_on_user_error, run_hydra_command, task_started
from dspark.core.locks import holding
from dspark.export import ExportSummary
from dspark.export.stage import ExportRecord, read_exports, run_export
from dspark.serving.methods import export_method
from eval.acceptance import AcceptanceCounts
from eval.agreement import greedy_outputs_equal, llama_cpp_parity
from eval.checks import quality_checks
from eval.engine_args import engine_kwargs, vllm_max_model_len
from eval.eval_set import eval_set_sha256
from eval.llama_cpp_rows import llama_cpp_results, llama_cpp_wanted
from eval.out_dir import claim_out_dir
from eval.prompts import run_eval_set, warn_past_training_window
from eval.reference_rows import reference_results
from eval.results import (
    Check,
    DrafterResult,
    EvalConditions,
    EvalResults,
    drafter_from_dict,
    load_checks,
    load_results,
    nan_to_none,
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


# which eval fields each fingerprint leaves out: declared on the fields (EvalConfig's ``part`` metadata)
NOT_SETTINGS = eval_fields("run_control")
"""Eval fields that say how an eval is run or where it writes, not what it measures."""
LLAMA_CPP_SETTINGS = eval_fields("llama_cpp")
"""Eval fields only llama.cpp's rows depend on: the reference loop's and vLLM's parts are kept across them."""
NOT_LLAMA_CPP_SETTINGS = eval_fields("not_llama_cpp")
"""Eval fields llama.cpp's rows do not depend on (the other parts' rows, the checks' lines): turning
the reference loop on for a parity table keeps llama.cpp's measured rows."""


def fingerprint(cfg: RunConfig, record: ExportRecord, *, without: tuple[str, ...] = ()) -> str:
    """What an eval report depends on: the eval settings (not how it is run: ``force``, the
    timeouts; nor those in ``without``), the target, and the exports it serves (the export stage's
    fingerprint: which checkpoint files, in which dtype). Equal fingerprints: the report is up to date."""
    settings = {k: v for k, v in asdict(cfg.eval).items() if k not in NOT_SETTINGS + without}
    return config_fingerprint({"eval": settings, "target": asdict(cfg.target), "exports": record.fingerprint})


def run_eval(cfg: RunConfig | DictConfig, heads: Any, target_dir: Path) -> EvalOutcome:
    """Build the eval set, measure every drafter the export stage's record lists, report.
    Skipped when results.json already holds this fingerprint (same exports, settings);
    after a killed eval, the parts it finished are kept (:class:`Parts`) and the rest is measured.
    Its output and export directories are held while it runs: a second eval on either is refused
    naming the first."""
    cfg = load_config(cfg)
    out_dir = Path(cfg.eval.out_dir).expanduser()
    claim_out_dir(out_dir, key="eval.out_dir", stage="eval", earlier=("results.json", "parts"))
    with (
        holding(out_dir, key="eval.out_dir", what="eval"),
        holding(Path(cfg.export.out_dir).expanduser(), key="export.out_dir", what="eval's export"),
    ):
        return _run_eval(cfg, heads, target_dir, out_dir)


def _run_eval(cfg: RunConfig, heads: Any, target_dir: Path, out_dir: Path) -> EvalOutcome:
    e = cfg.eval
    record = read_exports(cfg)  # what the export stage wrote and checked, for these checkpoints
    ckpt, ablation = record.sources["ours"], record.sources.get("ablation")
    fp = fingerprint(cfg, record)  # the whole report's
    done = _up_to_date(out_dir, fp)
    if done is not None and not e.force:
        log.info(
            "eval: %s is up to date (same checkpoint files and eval settings), skipped; eval.force=true reruns it",
            out_dir / "report.md",
        )
        return done
    t0 = time.perf_counter()
    for window, trained in record.windows.values():  # ours and the ablation, as the export stage read them
        warn_past_training_window(cfg, window, trained)
    prompts, prompts_file = run_eval_set(cfg, heads, out_dir)
    exports = record.exports
    seconds = {"eval set": round(time.perf_counter() - t0, 1)}  # every part's wall clock, in the order run
    # the reference loop's and vLLM's parts do not depend on llama.cpp's settings: another llama.cpp
    # target or method list measures llama.cpp's rows again and keeps the rest
    # (whether llama.cpp's rows are measured at all is in their key: the reference loop then ends
    # each answer as llama.cpp does)
    core = config_fingerprint(
        {"eval": fingerprint(cfg, record, without=LLAMA_CPP_SETTINGS), "llama_cpp_beside": llama_cpp_wanted(cfg)}
    )
    parts = Parts(out_dir / "parts", _parts_key(core, prompts), not e.force, seconds)
    drafters = []
    if e.reference:
        drafters += parts.get_or_run("reference", lambda: reference_results(cfg, heads, target_dir, prompts, exports))
    drafters += vllm_results(cfg, target_dir, prompts, prompts_file, out_dir, exports, parts=parts)
    if llama_cpp_wanted(cfg):
        llama_fp = fingerprint(cfg, record, without=NOT_LLAMA_CPP_SETTINGS)
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
    from dspark.config.wandb_run import init_wandb

    return init_wandb(cfg, out_dir, job_type="eval")


def main() -> None:
    import hydra

    import dspark.config  # noqa: F401
    from dspark.target import prepare_target

    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def _main(raw: DictConfig) -> None:
        task_started()
        with exit_on_user_error():  # error: <message> and exit status 2, no traceback
            cfg = load_config(raw)
            heads, target_dir = prepare_target(cfg)
            run_export(cfg, target_dir)
            run_eval(cfg, heads, target_dir)

    run_hydra_command(_main)


if __name__ == "__main__":
    main()
