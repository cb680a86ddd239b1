"""The multi-node GPU scripts rendered for the Kimi K3 preset without a cluster: each batch script
runs under bash with the environment Slurm gives a 4-node x 4-GPU job, `srun`, `scontrol` and
`nvidia-smi` replaced by stubs that record their arguments (srun runs its command once per node
with that node's SLURM_NODEID), and PYTHON a stub that records every launch (it hands `-c` and
`--cfg` calls to the real interpreter, so the config is really composed). The tests assert on the
per-node commands and on the #SBATCH headers."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "slurm"
HOSTS = [f"gb300-{i:03d}" for i in range(1, 5)]

SRUN = """#!/bin/bash
# stub srun: record argv, then run the command once per node (SLURM_NODEID=i), like one task per node;
# --het-group=G: on that component's nodes (SLURM_JOB_NUM_NODES_HET_GROUP_G), as SLURM_HET_GROUP=G
printf '%s\\n' "$(printf '%q ' "$@")" >> "$STUB_RECORD/srun.log"
n=$SLURM_NNODES group=
for a in "$@"; do
  case $a in --het-group=*) group=${a#--het-group=}; v=SLURM_JOB_NUM_NODES_HET_GROUP_$group; n=${!v};; esac
done
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
worst=0
for ((i = 0; i < n; i++)); do
  SLURM_NNODES=$n SLURM_HET_GROUP=$group SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" \\
    || { rc=$?; [ $rc -gt $worst ] && worst=$rc; }
done
exit $worst
"""
SCONTROL = """#!/bin/bash
# stub scontrol: 'show hostnames LIST' prints STUB_HOSTS, or STUB_HOSTS_<LIST with [-,] as _> when set
printf '%s\\n' "$*" >> "$STUB_RECORD/scontrol.log"
if [ "$1 $2" = "show hostnames" ]; then
  v=STUB_HOSTS_$(printf '%s' "$3" | tr -c 'A-Za-z0-9' '_')
  printf '%s\\n' ${!v:-$STUB_HOSTS}
fi
"""
NVIDIA_SMI = """#!/bin/bash
for ((i = 0; i < ${SLURM_GPUS_ON_NODE:-0}; i++)); do echo "GPU $i: NVIDIA GB300 (UUID: GPU-stub-$i)"; done
"""
PYTHON = """#!{python}
import json, os, subprocess, sys
argv = sys.argv[1:]
if argv[:1] == ["-c"] or "--cfg" in argv:  # import checks and config composition: the real thing
    os.execv({python!r}, [{python!r}, *argv])
keep = ("SLURM_NODEID", "SLURM_HET_GROUP", "SLURM_JOB_ID", "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM", "DSPARK_ALLOW_CPU")
with open(os.path.join(os.environ["STUB_RECORD"], "python.jsonl"), "a") as f:
    f.write(json.dumps({{"argv": argv, "env": {{k: os.environ.get(k) for k in keep}}}}) + "\\n")
rcs = json.loads(os.environ.get("STUB_RC", "{{}}"))  # exit status per node id
sys.exit(int(rcs.get(os.environ.get("SLURM_NODEID", "0"), 0)))
"""


@dataclass
class Rendered:
    rc: int
    log: str
    launches: list[dict]  # one per python launch: argv, env
    srun: list[list[str]]
    scontrol: list[str]

    def node(self, i: int) -> list[str]:
        argv = [r["argv"] for r in self.launches if r["env"]["SLURM_NODEID"] == str(i)]
        assert len(argv) == 1, f"node {i}: {argv}\n{self.log}"
        return argv[0]


def header(script: Path) -> dict[str, str]:
    """#SBATCH options of a script, as sbatch reads them (up to the first command)."""
    opts = {}
    for line in script.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            key, _, value = line.split()[1].lstrip("-").partition("=")
            opts[key] = value
        elif line.strip() and not line.startswith("#"):
            break
    return opts


@pytest.fixture
def render(tmp_path):
    def _render(
        script: str,
        *overrides: str,
        nodes: int = 4,
        gpus: int | None = 4,
        env: dict | None = None,
        stub_rc: dict | None = None,
        nvidia_smi: bool = True,
    ) -> Rendered:
        stubs, record = tmp_path / "bin", tmp_path / "record"
        stubs.mkdir(exist_ok=True)
        record.mkdir(exist_ok=True)
        for f in record.iterdir():
            f.unlink()
        files = {"srun": SRUN, "scontrol": SCONTROL, "python": PYTHON.format(python=sys.executable)}
        if nvidia_smi:
            files["nvidia-smi"] = NVIDIA_SMI
        elif (stubs / "nvidia-smi").exists():
            (stubs / "nvidia-smi").unlink()
        for name, text in files.items():
            (stubs / name).write_text(text)
            (stubs / name).chmod(0o755)
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "DSPARK_", "CUDA_")) and k not in ("EXPERIMENT", "PYTHON")
        }
        # no real nvidia-smi may answer for a GPU-less render
        path = f"{stubs}:/usr/bin:/bin" if not nvidia_smi else f"{stubs}:{os.environ['PATH']}"
        hosts = HOSTS[:nodes]
        full_env = {
            **base,
            "PATH": path,
            "STUB_RECORD": str(record),
            "STUB_HOSTS": " ".join(hosts),
            "STUB_RC": json.dumps(stub_rc or {}),
            "PYTHON": str(stubs / "python"),
            "DSPARK_OUTPUT_DIR": str(tmp_path / "out"),
            "EXPERIMENT": "kimi_k3_gb300",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOBID": "4242",
            "SLURM_SUBMIT_DIR": str(REPO),
            "SLURM_NNODES": str(nodes),
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_JOB_NODELIST": f"gb300-[001-{nodes:03d}]",
            "SLURM_NTASKS_PER_NODE": "1",
            **({"SLURM_GPUS_ON_NODE": str(gpus), "SLURM_GPUS_PER_NODE": str(gpus)} if gpus is not None else {}),
            **(env or {}),
        }
        out = subprocess.run(
            ["bash", str(SLURM / script), *overrides],
            cwd=tmp_path,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        read = lambda name: (record / name).read_text().splitlines() if (record / name).exists() else []  # noqa: E731
        return Rendered(
            out.returncode,
            out.stdout + out.stderr,
            [json.loads(x) for x in read("python.jsonl")],
            [shlex.split(x) for x in read("srun.log")],
            read("scontrol.log"),
        )

    return _render


def k3_tp() -> int:
    target = OmegaConf.load(REPO / "conf" / "target" / "kimi_k3_gb300.yaml")
    return int(target.tensor_parallel_size) * int(target.get("pipeline_parallel_size", 1))


def arg(argv: list[str], prefix: str) -> str:
    hits = [a[len(prefix) :] for a in argv if a.startswith(prefix)]
    assert len(hits) == 1, f"{prefix!r} in {argv}"
    return hits[0]


@pytest.mark.parametrize("script", ["extract.sbatch", "train.sbatch", "eval.sbatch"])
def test_k3_headers_ask_for_the_engine_the_target_config_needs(script):
    opts = header(SLURM / script)
    assert opts["nodes"] == "4" and opts["gpus-per-node"] == "4" and opts["ntasks-per-node"] == "1"
    assert int(opts["nodes"]) * int(opts["gpus-per-node"]) == k3_tp() == 16
    assert "exclusive" in opts and opts["output"].startswith("outputs/slurm/%x-")
    assert "requeue" in opts and opts["open-mode"] == "append"  # a requeued job's log keeps its first run
    exp = OmegaConf.load(REPO / "conf" / "experiment" / "kimi_k3_gb300.yaml")
    assert {"override /target": "kimi_k3_gb300"} in OmegaConf.to_container(exp.defaults)


def test_train_renders_one_torchrun_per_node_for_16_ranks(render):
    r = render("train.sbatch", "train.lr=3e-4")
    assert r.rc == 0, r.log
    assert len(r.srun) == 1 and "--kill-on-bad-exit=1" in r.srun[0]
    assert "show hostnames gb300-[001-004]" in r.scontrol
    port = str(29500 + 4242 % 1000)
    ranks = 0
    for i in range(4):
        argv = r.node(i)
        assert argv[:2] == ["-m", "torch.distributed.run"]
        assert arg(argv, "--nnodes=") == "4" and arg(argv, "--node_rank=") == str(i)
        assert arg(argv, "--rdzv_backend=") == "c10d" and arg(argv, "--rdzv_id=") == "4242"
        assert arg(argv, "--rdzv_endpoint=") == f"{HOSTS[0]}:{port}"  # the head node, same for all
        ranks += int(arg(argv, "--nproc_per_node="))
        script = argv.index("train.py")
        assert argv[script + 1 : script + 4] == ["+experiment=kimi_k3_gb300", "stages=[train]", "train.resume=auto"]
        assert argv[-1] == "train.lr=3e-4" and arg(argv, "hydra.run.dir=").endswith(f"slurm/4242/train/node{i}")
    assert ranks == 16 == k3_tp()
    assert "4 node(s) x 4 rank(s) = 16 ranks" in r.log


def test_extract_renders_one_tp16_engine_over_four_nodes(render):
    r = render("extract.sbatch", "data.num_prompts=50000")
    assert r.rc == 0, r.log
    assert "--wait=300" in r.srun[0] and "--kill-on-bad-exit=0" in r.srun[0]
    port = str(29500 + 4242 % 1000)
    for i in range(4):
        argv = r.node(i)
        assert argv[:4] == [
            "-m",
            "data_tools.extract",
            "+experiment=kimi_k3_gb300",
            "+data.vllm.engine_kwargs.nnodes=4",
        ]
        assert arg(argv, "+data.vllm.engine_kwargs.node_rank=") == str(i)
        assert arg(argv, "+data.vllm.engine_kwargs.master_addr=") == HOSTS[0]
        assert arg(argv, "+data.vllm.engine_kwargs.master_port=") == port
        assert argv[-1] == "data.num_prompts=50000"
    assert all(x["env"]["VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"] == "1" for x in r.launches)
    assert "vLLM engine: TP16 x PP1 over 4 node(s) x 4 GPU(s)" in r.log


def test_eval_renders_node0_driver_and_headless_workers(render):
    r = render("eval.sbatch", "eval.prompts_per_bin=64")
    assert r.rc == 0, r.log
    head = r.node(0)
    assert head[:3] == ["-m", "eval.run", "+experiment=kimi_k3_gb300"]
    assert "eval.reference=false" in head and "eval.baselines=[]" in head
    for i in range(4):
        argv = r.node(i)
        if i:
            assert argv[:2] == ["-m", "eval.run_headless"]
        assert arg(argv, "+eval.vllm_engine_kwargs.nnodes=") == "4"
        assert arg(argv, "+eval.vllm_engine_kwargs.node_rank=") == str(i)
        assert arg(argv, "+eval.vllm_engine_kwargs.master_addr=") == HOSTS[0]
        assert argv[-1] == "eval.prompts_per_bin=64"
    assert all(x["env"]["VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"] == "1" for x in r.launches)


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
@pytest.mark.parametrize("script", ["extract.sbatch", "eval.sbatch"])
def test_the_job_result_is_node0s_not_the_headless_workers(render, script):
    """srun --wait stops the headless workers once node 0 is done; their status must not fail
    the job (its afterok dependents would never run), and node 0's failure must."""
    r = render(script, stub_rc={"2": 143})
    assert r.rc == 0, r.log
    assert "node exit codes:" in r.log and "node2.rc:143" in r.log
    r = render(script, stub_rc={"0": 3})
    assert r.rc == 3, r.log


def test_extract_array_task_renders_one_engine_on_its_share(render):
    r = render(
        "extract_array.sbatch",
        nodes=1,
        gpus=1,
        env={"SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3", "EXPERIMENT": "smollm2_cpu_demo"},
    )
    assert r.rc == 0, r.log
    assert r.srun[0][0] == "--kill-on-bad-exit=1"
    argv = r.node(0)
    assert argv[:3] == ["-m", "data_tools.extract", "+experiment=smollm2_cpu_demo"]
    assert arg(argv, "hydra.run.dir=").endswith("slurm/77/extract-task3")
    assert (
        header(SLURM / "extract_array.sbatch")["gpus-per-node"] == "1"
    )  # one override (--gpus-per-node) for every script


# -- the early checks -------------------------------------------------------------------------


def test_no_gpus_fails_before_anything_starts(render):
    r = render("train.sbatch", gpus=None, nvidia_smi=False)
    assert r.rc == 2 and not r.launches and not r.srun
    assert "error: no GPUs allocated on" in r.log and "--gpus-per-node=N" in r.log and "DSPARK_ALLOW_CPU=1" in r.log


def test_gpus_that_nvidia_smi_cannot_see_fail(render):
    r = render("extract.sbatch", nvidia_smi=False)
    assert r.rc == 2 and not r.launches
    assert "nvidia-smi cannot see them" in r.log


def test_dspark_allow_cpu_skips_the_gpu_check(render):
    r = render("train.sbatch", nodes=1, gpus=None, nvidia_smi=False, env={"DSPARK_ALLOW_CPU": "1"})
    assert r.rc == 0, r.log
    assert "DSPARK_ALLOW_CPU=1: no GPU check" in r.log and arg(r.node(0), "--nproc_per_node=") == "1"


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_tp16_on_two_nodes_is_refused_with_the_expected_shape(render):
    r = render("extract.sbatch", nodes=2)
    assert r.rc == 2 and not r.launches
    assert (
        "target.tensor_parallel_size=16 x pipeline_parallel_size=1 needs 16 GPUs, the job has 2 nodes x 4 GPUs = 8; "
        "expected --nodes=4"
    ) in r.log
    r = render("eval.sbatch", nodes=1, gpus=1)  # one GPU for a TP16 target
    assert r.rc == 2 and "expected --gpus-per-node=16" in r.log
    r = render("eval.sbatch", "target.tensor_parallel_size=1", nodes=1, gpus=1)
    assert r.rc == 0, r.log


@pytest.mark.slow  # a subprocess or several: 4-6 s, kept out of the 5-minute fast tier
def test_a_misspelt_override_fails_on_the_batch_host(render):
    r = render("train.sbatch", "train.lrr=3e-4")
    assert r.rc == 2 and not r.srun
    assert "error: unknown config key train.lrr (did you mean train.lr?)" in r.log
    r = render("eval.sbatch", env={"EXPERIMENT": "kimi_k3"})
    assert r.rc == 2 and "+experiment=kimi_k3: no such experiment" in r.log and "kimi_k3_gb300" in r.log


def test_missing_python_names_the_interpreter(render):
    r = render("extract.sbatch", env={"PYTHON": "/nonexistent/python"})
    assert r.rc == 2 and not r.srun
    assert re.search(
        r"error: PYTHON=/nonexistent/python is not an executable in \S+; expected the project's "
        r"virtualenv interpreter",
        r.log,
    )


def test_outside_the_repository_says_where_to_submit_from(render, tmp_path):
    r = render("train.sbatch", env={"SLURM_SUBMIT_DIR": str(tmp_path)})
    assert r.rc == 2 and "is not the dspark repository" in r.log and "DSPARK_REPO" in r.log
    r = render("train.sbatch", env={"SLURM_SUBMIT_DIR": str(tmp_path), "DSPARK_REPO": str(REPO)})
    assert r.rc == 0, r.log


@pytest.mark.parametrize("mode", ["1", "only"])
def test_eval_renders_the_serving_benchmark_one_server_over_four_nodes_per_configuration(render, mode):
    """Issue #15 on K3: per configuration one srun step; node 0 runs the server (its engine spans
    the 4 nodes) and vLLM's client, nodes 1-3 host its workers; a fresh rendezvous port each."""
    r = render("eval.sbatch", "serve_bench.concurrency=[1,8]", env={"SERVE_BENCH": mode})
    assert r.rc == 0, r.log
    bench = [x for x in r.launches if x["argv"][:2] == ["-m", "eval.serve_bench"]]
    evals = [x for x in r.launches if x["argv"][:2] != ["-m", "eval.serve_bench"]]
    assert len(evals) == (4 if mode == "1" else 0)
    assert len(bench) == 3 * 4 and len(r.srun) == 3 + (1 if mode == "1" else 0)
    ports = set()
    for k, config in enumerate(["none", "ngram", "ours"]):
        step = bench[4 * k : 4 * k + 4]
        for i, launch in enumerate(step):
            argv = launch["argv"]
            assert launch["env"]["SLURM_NODEID"] == str(i) and argv[2] == "+experiment=kimi_k3_gb300"
            assert arg(argv, "serve_bench.configs=") == f"[{config}]"
            assert ("serve_bench.headless=true" in argv) == (i > 0)  # node 0 serves and runs the client
            assert arg(argv, "+eval.vllm_engine_kwargs.nnodes=") == "4"
            assert arg(argv, "+eval.vllm_engine_kwargs.node_rank=") == str(i)
            assert arg(argv, "+eval.vllm_engine_kwargs.master_addr=") == HOSTS[0]
            assert arg(argv, "hydra.run.dir=").endswith(f"eval/serve_bench-{config}/node{i}")
            assert argv[-1] == "serve_bench.concurrency=[1,8]"
        assert len({arg(x["argv"], "+eval.vllm_engine_kwargs.master_port=") for x in step}) == 1
        ports.add(arg(step[0]["argv"], "+eval.vllm_engine_kwargs.master_port="))
    assert len(ports) == 3  # no rendezvous port reused between consecutive servers


def test_eval_refuses_an_unknown_serve_bench_mode(render):
    r = render("eval.sbatch", env={"SERVE_BENCH": "yes"})
    assert r.rc == 2 and "error: SERVE_BENCH=yes: expected 0, 1 or only" in r.log


# -- online training: one heterogeneous job -----------------------------------------------------


def het_components(script: Path) -> list[dict[str, str]]:
    """#SBATCH options per component of a heterogeneous job (``#SBATCH hetjob`` separates them);
    the options before the first component-specific one are the job's and go to the first."""
    parts: list[dict[str, str]] = [{}]
    for line in script.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            word = line.split()[1]
            if word == "hetjob":
                parts.append({})
                continue
            key, _, value = word.lstrip("-").partition("=")
            parts[-1][key] = value
        elif line.strip() and not line.startswith("#"):
            break
    return parts


def het_env(extract: int = 4, train: int = 4) -> dict[str, str]:
    """Slurm's environment in a heterogeneous job of ``extract`` then ``train`` GB300 nodes."""
    n = extract + train

    def names(lo: int, hi: int) -> tuple[str, str, str]:  # nodelist, the stub's variable, its hosts
        return (
            f"gb300-[{lo:03d}-{hi:03d}]",
            f"STUB_HOSTS_gb300__{lo:03d}_{hi:03d}_",
            " ".join(f"gb300-{i:03d}" for i in range(lo, hi + 1)),
        )

    ext, trn = names(1, extract), names(extract + 1, n)
    return {
        "SLURM_NNODES": str(n),
        "SLURM_JOB_NUM_NODES": str(n),
        "SLURM_JOB_NODELIST": names(1, n)[0],
        "SLURM_JOB_NUM_NODES_HET_GROUP_0": str(extract),
        "SLURM_JOB_NUM_NODES_HET_GROUP_1": str(train),
        "SLURM_JOB_NODELIST_HET_GROUP_0": ext[0],
        "SLURM_JOB_NODELIST_HET_GROUP_1": trn[0],
        ext[1]: ext[2],
        trn[1]: trn[2],
    }


HET_ENV = het_env()


def test_online_header_is_a_hetjob_of_an_engine_and_a_trainer_for_k3():
    engine, trainer = het_components(SLURM / "online.sbatch")
    for part in (engine, trainer):
        assert part["nodes"] == "4" and part["gpus-per-node"] == "4" and part["ntasks-per-node"] == "1"
        assert "exclusive" in part
    assert int(engine["nodes"]) * int(engine["gpus-per-node"]) == k3_tp() == 16  # one TP16 engine
    assert "requeue" in engine and engine["open-mode"] == "append" and engine["output"].startswith("outputs/slurm/")


def test_online_renders_a_streaming_engine_and_16_training_ranks(render):
    r = render("online.sbatch", "data.online.window_size=16", env=HET_ENV)
    assert r.rc == 0, r.log
    steps = {x[0]: x for x in r.srun}  # both run in the background: either may be recorded first
    assert len(r.srun) == 2 and sorted(steps) == ["--het-group=0", "--het-group=1"]
    assert "--kill-on-bad-exit=1" in steps["--het-group=1"] and "--kill-on-bad-exit=0" in steps["--het-group=0"]
    base = 29500 + 4242 % 1000
    producers = [x for x in r.launches if x["env"]["SLURM_HET_GROUP"] == "0"]
    trainers = [x for x in r.launches if x["env"]["SLURM_HET_GROUP"] == "1"]
    assert [x["env"]["SLURM_NODEID"] for x in producers] == ["0", "1", "2", "3"]
    for i, x in enumerate(producers):
        argv = x["argv"]
        assert argv[:3] == ["-m", "data_tools.online", "+experiment=kimi_k3_gb300"]
        assert arg(argv, "+data.vllm.engine_kwargs.nnodes=") == "4"
        assert arg(argv, "+data.vllm.engine_kwargs.node_rank=") == str(i)
        assert arg(argv, "+data.vllm.engine_kwargs.master_addr=") == "gb300-001"
        assert arg(argv, "+data.vllm.engine_kwargs.master_port=") == str(base)
        assert "data.mode=online" in argv and arg(argv, "data.online.trainer_addr=") == "gb300-005"
        assert arg(argv, "data.online.port=") == str(base + 2) and argv[-1] == "data.online.window_size=16"
        assert x["env"]["VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"] == "1"
    ranks = 0
    for i, x in enumerate(trainers):
        argv = x["argv"]
        assert argv[:2] == ["-m", "torch.distributed.run"] and arg(argv, "--node_rank=") == str(i)
        assert arg(argv, "--nnodes=") == "4" and arg(argv, "--rdzv_endpoint=") == f"gb300-005:{base + 1}"
        ranks += int(arg(argv, "--nproc_per_node="))
        script = argv.index("train.py")
        assert argv[script + 1 : script + 5] == [
            "+experiment=kimi_k3_gb300",
            "stages=[train]",
            "train.resume=auto",
            "data.mode=online",
        ]
        assert arg(argv, "data.online.trainer_addr=") == "gb300-005" and arg(argv, "data.online.port=") == str(base + 2)
        assert argv[-1] == "data.online.window_size=16"
    assert ranks == 16
    assert "1 engine(s) of 4 node(s) from gb300-001" in r.log and "trainer rank 0 on gb300-005" in r.log
    assert all(arg(x["argv"], "data.online.producers=") == "1" for x in r.launches)
    assert all(arg(x["argv"], "data.online.producer_rank=") == "0" for x in producers)
    assert "vLLM engine: TP16 x PP1 over 4 node(s) x 4 GPU(s)" in r.log


def test_online_with_8_extraction_nodes_renders_two_engines_each_on_its_own_4_nodes(render):
    env = het_env(extract=8, train=4)
    r = render("online.sbatch", env=env)
    assert r.rc == 0, r.log
    base = 29500 + 4242 % 1000
    producers = [x["argv"] for x in r.launches if x["env"]["SLURM_HET_GROUP"] == "0"]
    trainers = [x["argv"] for x in r.launches if x["env"]["SLURM_HET_GROUP"] == "1"]
    assert len(producers) == 8 and len(trainers) == 4
    for node, argv in enumerate(producers):
        engine = node // 4
        assert arg(argv, "data.online.producer_rank=") == str(engine) and arg(argv, "data.online.producers=") == "2"
        assert arg(argv, "+data.vllm.engine_kwargs.nnodes=") == "4"
        assert arg(argv, "+data.vllm.engine_kwargs.node_rank=") == str(node % 4)
        assert arg(argv, "+data.vllm.engine_kwargs.master_addr=") == ("gb300-001", "gb300-005")[engine]
        assert arg(argv, "data.online.port=") == str(base + 2)  # producer k's link: port + k (the config)
    assert all(
        arg(a, "data.online.producers=") == "2" and arg(a, "data.online.trainer_addr=") == "gb300-009" for a in trainers
    )
    assert "2 engine(s) of 4 node(s) from gb300-001" in r.log and f"gb300-009:{base + 2}..{base + 3}" in r.log


def test_online_extraction_nodes_not_a_multiple_of_an_engine_are_refused(render):
    env = het_env(extract=6, train=4)
    r = render("online.sbatch", env=env)
    assert r.rc != 0 and not r.srun
    assert "needs 4 node(s) per engine; the extraction component has 6: expected a multiple of 4" in r.log


def test_online_outside_a_hetjob_says_so(render):
    r = render("online.sbatch")
    assert r.rc != 0 and not r.srun
    assert "not a heterogeneous job" in r.log
