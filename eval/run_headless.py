"""Nodes 1..n-1 of the multi-node eval engine (slurm/eval.sbatch): wait for node 0's export,
then host this node's vLLM workers for the `dspark` engine node 0 drives, with the same
arguments eval.run gives it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig

from dspark.config import load_or_exit
from dspark.core.errors import exit_on_user_error, run_hydra_command, task_started
from dspark.export.stage import export_path, wait_for_export
from dspark.target import resolve_target
from eval.engine_args import engine_kwargs, vllm_max_model_len
from eval.serve import main as serve_main

log = logging.getLogger(__name__)


def main() -> None:
    import hydra

    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def _main(raw: DictConfig) -> None:
        task_started()
        cfg = load_or_exit(raw)
        target_dir = resolve_target(cfg.target, cache_dir=Path(cfg.paths.cache_dir).expanduser()).path
        export = export_path(cfg, "ours", "dspark")
        with exit_on_user_error():
            wait_for_export(export)  # node 0 exports (and validates) first
        serve_main(
            [
                "--headless",
                "--target",
                str(target_dir),
                "--method",
                "dspark",
                "--draft",
                str(export),
                "--gamma",
                str(cfg.eval.gamma),
                "--max-model-len",
                str(vllm_max_model_len(cfg)),
                "--dtype",
                cfg.target.dtype,
                "--prompts",
                "unused",
                "--engine-kwargs",
                json.dumps(engine_kwargs(cfg)),
            ]
        )

    run_hydra_command(_main)


if __name__ == "__main__":
    main()
