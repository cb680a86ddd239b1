"""Nodes 1..n-1 of the multi-node eval engine (slurm/eval.sbatch): wait for node 0's export,
then host this node's vLLM workers for the `dspark` engine node 0 drives, with the same
arguments eval.run gives it."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from omegaconf import DictConfig

log = logging.getLogger(__name__)


def main() -> None:
    import hydra

    from dspark.core.config import load_or_exit

    @hydra.main(version_base="1.3", config_path="../conf", config_name="config")
    def _main(raw: DictConfig) -> None:
        from dspark.core.target import resolve_target
        from eval.run import engine_kwargs, export_path, vllm_max_model_len
        from eval.serve import main as serve_main

        cfg = load_or_exit(raw)
        target_dir = resolve_target(cfg.target, cache_dir=Path(cfg.paths.cache_dir).expanduser()).path
        export = export_path(cfg, "dspark", "dspark")
        deadline = time.time() + 3600
        while not (export / "export.json").is_file():  # node 0 exports (and validates) first
            if time.time() > deadline:
                raise SystemExit(f"error: {export} did not appear within an hour; did node 0 fail?")
            time.sleep(10)
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

    _main()


if __name__ == "__main__":
    main()
