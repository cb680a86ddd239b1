"""The optional Hydra route to Slurm: hydra-submitit-launcher (`pip install -e .[slurm]`, also in
the `test` extra). Each Hydra job becomes one Slurm job; it suits single-process stages and sweeps
(one GPU per drafter variant), while the multi-node engines and DeepSpeed use slurm/*.sbatch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher not installed (pip install -e .[slurm])"
)

REPO = Path(__file__).resolve().parents[2]


def test_submitit_slurm_launcher_composes_with_the_k3_experiment():
    from hydra import compose, initialize_config_dir

    import dspark.config  # noqa: F401  (registers the config schemas, as train.py does)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            return_hydra_config=True,
            overrides=[
                "+experiment=kimi_k3_gb300",
                "hydra/launcher=submitit_slurm",
                "hydra.launcher.nodes=1",
                "hydra.launcher.gpus_per_node=4",
                "hydra.launcher.partition=gb300",
                "hydra.launcher.timeout_min=600",
                "drafter.markov_rank=0",
            ],
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.nodes, launcher.gpus_per_node, launcher.partition, launcher.timeout_min) == (1, 4, "gb300", 600)
    assert cfg.target.name == "kimi-k3" and cfg.train.run_name == "k3_mla-markov0"


@pytest.mark.slow
def test_submitit_runs_a_hydra_job_on_the_local_slurm(slurm, tmp_path, smollm2_dir):
    """`--multirun hydra/launcher=submitit_slurm`: the target stage alone (stages=[]) as a Slurm job;
    submitit pickles the job, sbatch runs it on the node, the launcher reads the result back."""
    sweep = tmp_path / "sweep"
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--multirun",
            "+experiment=smollm2_cpu_smoke",
            "stages=[]",
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.gpus_per_node=0",
            "hydra.launcher.timeout_min=30",
            f"hydra.sweep.dir={sweep}",
            f"paths.output_dir={tmp_path}",
        ],
        cwd=REPO,
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:] + slurm.logs()
    assert "Submitit 'slurm' sweep output dir" in r.stdout + r.stderr
    logs = "\n".join(f.read_text() for f in sweep.glob(".submitit/*/*_log.*"))
    assert "capture layers (transformers hidden_states ids): [1, 8, 15, 22, 29, 30]" in logs, logs[-3000:]
    job_ids = {p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit()}
    assert len(job_ids) == 1
    job = job_ids.pop()  # the launcher returns once the result is written; the job ends just after
    assert slurm.wait(job, timeout=300)[job]["JobState"] == "COMPLETED"
