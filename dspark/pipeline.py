"""The main job: run each pipeline stage that exists, in order, and say what it did."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from dspark.config import TORCH_DTYPES, DSparkConfig, TargetConfig, to_object
from dspark.target import TargetHeads, load_target_heads, resolve_target

log = logging.getLogger(__name__)


@dataclass
class PipelineResult:
    target: TargetHeads
    drafter: DSparkConfig
    stages_run: list[str]


def prepare_target(cfg: DictConfig) -> TargetHeads:
    return prepare_target_dir(cfg)[0]


def prepare_target_dir(cfg: DictConfig) -> tuple[TargetHeads, Path]:
    """Resolve the target spec to a directory and load its frozen heads."""
    spec = to_object(cfg.target, TargetConfig)
    t0 = time.perf_counter()
    resolved = resolve_target(spec, cache_dir=Path(cfg.paths.cache_dir).expanduser())
    heads = load_target_heads(resolved.path, dtype=TORCH_DTYPES[cfg.train.dtype], spec=spec)
    log.info(
        "target %s: %s at %s (%s, %.1fs) | hidden %d, vocab %d, %s head, chat template %s",
        spec.name,
        heads.architecture,
        resolved.path,
        "converted now" if resolved.converted else "cached",
        time.perf_counter() - t0,
        heads.hidden_size,
        heads.vocab_size,
        "tied" if heads.tied else "untied",
        "present" if heads.chat_template else "MISSING",
    )
    log.info("capture layers (transformers hidden_states ids): %s", spec.capture_layer_ids(int(heads.config["num_hidden_layers"])))
    return heads, resolved.path


def run(cfg: DictConfig) -> PipelineResult:
    t0 = time.perf_counter()
    heads, target_dir = prepare_target_dir(cfg)
    stages_run = ["target"]
    lines = [f"target   {cfg.target.name} ({target_dir})"]
    if "extract" in cfg.stages:
        from data_tools.extract import extract  # vLLM is imported only when the stage runs

        s = extract(cfg)
        stages_run.append("extract")
        what = (f"up to date ({s.shards_resumed} complete shards), skipped" if s.shards_written == 0
                else f"{s.rows} sequences, {s.tokens} tokens in {s.shards_written} new shards")
        lines.append(f"extract  {what} -> {cfg.data.shards_dir}")
    if "train" in cfg.stages:
        from dspark.trainer import finished_checkpoint, train  # DeepSpeed is imported only when needed

        done = finished_checkpoint(cfg)
        if done is not None:
            log.info("train: %s is at train.max_steps=%s for this drafter, skipped", done, cfg.train.max_steps)
            lines.append(f"train    up to date ({done}), skipped")
        else:
            state = train(cfg, heads)
            lines.append(f"train    step {state.step}/{cfg.train.max_steps} -> {cfg.train.checkpoint_dir}")
        stages_run.append("train")
    if "eval" in cfg.stages:
        from eval.run import run_eval  # export + reference loop + vLLM serving + report

        outcome = run_eval(cfg, heads, target_dir)
        stages_run.append("eval")
        taus = ", ".join(f"{d.name} {d.tau:.3f}" for d in outcome.results.drafters)
        lines.append(f"eval     tau: {taus}")
        lines += [f"check    {c.name}: {'PASS' if c.passed else 'MISS'} ({c.detail})" for c in outcome.checks]
        lines.append(f"report   {outcome.report_dir / 'report.md'} (+ results.json, *.png)")
        lines.append(f"exports  {cfg.eval.export_dir}")
    if cfg.logging.wandb:
        lines.append(f"W&B      {Path(cfg.paths.output_dir) / 'wandb'} (offline runs: wandb sync <run dir>)")
    drafter = to_object(cfg.drafter, DSparkConfig)
    log.info("main job done in %.1f min:\n  %s", (time.perf_counter() - t0) / 60, "\n  ".join(lines))
    return PipelineResult(heads, drafter, stages_run)
