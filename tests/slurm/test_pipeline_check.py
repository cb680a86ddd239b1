"""slurm/pipeline.sh without a cluster: a stub `sbatch` on PATH records every call, so these
tests see what would have been submitted. The config is composed for real before any sbatch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.config.compose import main as compose_main

REPO = Path(__file__).resolve().parents[2]
SBATCH = """#!/bin/bash
echo "$*" >> "$STUB_RECORD"
echo 4242
"""


@pytest.fixture
def stub_sbatch(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    return bin_dir, tmp_path / "sbatch.log"


def pipeline(stub_sbatch, tmp_path: Path, *args: str, experiment: str = "smollm2_cpu_smoke"):
    bin_dir, record = stub_sbatch
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "DSPARK_DEBUG")}
    env |= {
        "PATH": f"{bin_dir}:{env['PATH']}",
        "STUB_RECORD": str(record),
        "PYTHON": sys.executable,
        "EXPERIMENT": experiment,
        "DSPARK_OUTPUT_DIR": str(tmp_path / "out"),
    }
    return subprocess.run(
        [str(REPO / "slurm" / "pipeline.sh"), *args], capture_output=True, text=True, cwd="/", env=env, timeout=120
    )


def test_help_goes_to_stdout(stub_sbatch, tmp_path):
    r = pipeline(stub_sbatch, tmp_path, "--help")
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.startswith("Submit the three stages as Slurm batch jobs") and "--dry-run" in r.stdout
    assert not stub_sbatch[1].exists()


@pytest.mark.parametrize(
    ("args", "experiment", "msg"),
    [
        (
            ["--cpu", "train.lrr=1"],
            "smollm2_cpu_smoke",
            "error: Could not override 'train.lrr': Key 'lrr' not in 'TrainConfig'",
        ),
        (
            ["--dry-run"],
            "smollm2_cpu_smok",
            "error: In 'config': Could not find 'experiment/smollm2_cpu_smok', expected one of: kimi_k3_gb300, ",
        ),
        (
            ["--cpu", "train.anchors_per_seq=0"],
            "smollm2_cpu_smoke",
            "error: train.anchors_per_seq=0: expected a number >= 1",
        ),
    ],
)
def test_a_config_that_does_not_compose_is_refused_before_any_submission(stub_sbatch, tmp_path, args, experiment, msg):
    r = pipeline(stub_sbatch, tmp_path, *args, experiment=experiment)
    assert r.returncode == 2, r.stderr
    first, second = r.stderr.strip().splitlines()[-2:]
    assert first.startswith(msg)
    assert second.startswith(f"pipeline.sh: error: +experiment={experiment} ") and "nothing submitted" in second
    assert not stub_sbatch[1].exists() and not (tmp_path / "out").exists()
    assert r.stdout == ""


def test_a_good_config_is_submitted_as_three_chained_jobs(stub_sbatch, tmp_path):
    r = pipeline(stub_sbatch, tmp_path, "--cpu", "train.lr=1e-3")
    assert r.returncode == 0, r.stderr
    assert [line.split()[:2] for line in r.stdout.splitlines()[:3]] == [
        ["extract", "4242"],
        ["train", "4242"],
        ["eval", "4242"],
    ]
    calls = stub_sbatch[1].read_text().splitlines()
    assert [c.split()[-2] for c in calls] == ["slurm/extract.sbatch", "slurm/train.sbatch", "slurm/eval.sbatch"]
    assert all(c.endswith(" train.lr=1e-3") for c in calls) and "--dependency=afterok:4242" in calls[1]


def test_compose_check_reports_ok_per_stage(capsys):
    assert compose_main(["--stages", "extract,train", "--", "+experiment=smollm2_cpu_smoke", "hydra.run.dir=/x"]) == 0
    assert capsys.readouterr().out == (
        "config ok: extract (smollm2-135m, markov16-L1-i256)\nconfig ok: train (smollm2-135m, markov16-L1-i256)\n"
    )
