"""The main job: every pipeline stage that ``stages`` names, in order, and what each one did.

    python train.py +experiment=smollm2_cpu_demo            # run the stages on the embedded target
    python train.py +experiment=kimi_k3_gb300 --cfg job --resolve  # the resolved config
    python train.py --help                                  # the stages, experiments, examples and every key

This is the only module that imports every stage (``tests/test_layering.py``); each stage is
imported when it runs, so a node that only trains never imports vLLM. Tests call :func:`run`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
from omegaconf import DictConfig

from dspark.config import DSparkConfig, RunConfig, load_config  # also registers the schemas
from dspark.core.errors import exit_on_user_error, run_hydra_command, task_started
from dspark.target import TargetHeads, prepare_target

log = logging.getLogger("train")


@dataclass
class PipelineResult:
    target: TargetHeads
    drafter: DSparkConfig
    stages_run: list[str]


def run(cfg: RunConfig | DictConfig) -> PipelineResult:
    """Each stage's summary line ends with its wall clock, and the last line totals them: the
    measured duration of the main job, which the README quotes."""
    cfg = load_config(cfg)
    clock = _StageClock()
    heads, target_dir = prepare_target(cfg)
    stages_run = ["target"]
    lines = [f"target   {cfg.target.name} ({target_dir}){clock.lap('target')}"]
    online = cfg.data.mode == "online"
    if "extract" in cfg.stages and online:
        log.info("extract: data.mode=online, the engine streams states to the trainer, no shards: skipped")
        lines.append("extract  online: streamed to the trainer, no shards")
    elif "extract" in cfg.stages:
        from data_tools.extract import extract

        s = extract(cfg, target_dir)
        stages_run.append("extract")
        what = (
            f"up to date ({s.shards_resumed} complete shards), skipped"
            if s.shards_written == 0
            else f"{s.rows} sequences, {s.tokens} tokens in {s.shards_written} new shards"
        )
        lines.append(f"extract  {what} -> {cfg.data.shards_dir}{clock.lap('extract')}")
    if "train" in cfg.stages:
        from dspark.checkpoint_run import finished_checkpoint
        from dspark.recipe import train

        done = finished_checkpoint(cfg)
        if done is not None:
            log.info("train: %s is at train.max_steps=%s for this drafter, skipped", done, cfg.train.max_steps)
            lines.append(f"train    up to date ({done}), skipped{clock.lap('train')}")
        elif online:
            state = train(cfg, heads, online_source(cfg, target_dir))  # the trainer closes it
            lines.append(
                f"train    step {state.step}/{cfg.train.max_steps} (online) -> {cfg.train.checkpoint_dir}"
                f"{clock.lap('train')}"
            )
        else:
            state = train(cfg, heads)
            lines.append(
                f"train    step {state.step}/{cfg.train.max_steps} -> {cfg.train.checkpoint_dir}{clock.lap('train')}"
            )
        stages_run.append("train")
    if _export_wanted(cfg):
        from dspark.export.stage import run_export

        record = run_export(cfg, target_dir)
        stages_run.append("export")
        lines.append(f"export   {record.summary_line()}{clock.lap('export')}")
    if "eval" in cfg.stages:
        from eval.run import run_eval

        outcome = run_eval(cfg, heads, target_dir)
        stages_run.append("eval")
        from eval.report import summary_lines

        lines += summary_lines(outcome.results, outcome.checks)
        lines.append(
            f"report   {outcome.report_dir / 'report.md'}: open it first, its Summary says what was found "
            f"(tables, results.json and plots beside it){clock.lap('eval')}"
        )
    if "serve_bench" in cfg.stages:
        from eval.serve_bench.stage import run_serve_bench

        bench = run_serve_bench(cfg, heads, target_dir)
        stages_run.append("serve_bench")
        lines.append(f"serve    {bench.summary_line()}")
        lines.append(f"serving  {bench.markdown} (+ serve_bench.json, *.png){clock.lap('serve_bench')}")
    if cfg.logging.wandb:
        lines.append(f"W&B      {Path(cfg.paths.output_dir) / 'wandb'} (offline runs: wandb sync <run dir>)")
    lines.append(f"time     {clock.total()}")
    log.info("main job done in %.1f min:\n  %s", clock.minutes(), "\n  ".join(lines))
    return PipelineResult(heads, cfg.drafter, stages_run)


def _export_wanted(cfg: RunConfig) -> bool:
    """The export stage runs when asked for, and before a stage that reads its record: the eval,
    and a serving benchmark that serves this run's drafter (a no-op when exports.json is up to date)."""
    if "export" in cfg.stages or "eval" in cfg.stages:
        return True
    if "serve_bench" in cfg.stages:
        from eval.serve_bench.configs import serves_exports

        return serves_exports(cfg)
    return False


class _StageClock:
    """Wall clock per stage, for the closing summary."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.stages: list[tuple[str, float]] = []

    def lap(self, stage: str) -> str:
        now = time.perf_counter()
        self.stages.append((stage, now - self.last))
        self.last = now
        return f"  [{self.stages[-1][1] / 60:.1f} min]"

    def minutes(self) -> float:
        return (time.perf_counter() - self.start) / 60

    def total(self) -> str:
        parts = " + ".join(f"{stage} {s / 60:.1f}" for stage, s in self.stages)
        return f"{self.minutes():.1f} min of wall clock ({parts})"


def online_source(cfg: RunConfig, target_dir: Path):  # noqa: ANN201 - a SequenceSource, or None
    """``data.mode=online``: rank 0 reads the stream, from an engine it starts here (one machine)
    or over the link to the producer on the extraction nodes (``data.online.trainer_addr``);
    the other ranks get their share from rank 0."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    online = cfg.data.online
    if online.trainer_addr:
        from dspark.formats.stream_remote import RemoteSource

        return RemoteSource(
            online.trainer_addr,
            online.port,
            buffer_size=online.buffer_size,
            timeout_s=online.connect_timeout_s,
            producers=online.producers,
        )
    from data_tools.online import VllmSource

    return VllmSource(cfg, target_dir)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """A user error (a config value, no dataset, a damaged shard, a checkpoint of another drafter)
    ends the command with ``error: <message>`` and exit status 2; ``HYDRA_FULL_ERROR=1`` or
    ``DSPARK_DEBUG=1`` shows the traceback. :func:`run` raises, for tests."""
    task_started()
    with exit_on_user_error():
        run(load_config(cfg))


if __name__ == "__main__":
    run_hydra_command(main)
