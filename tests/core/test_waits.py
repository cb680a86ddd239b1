"""Issue #17, nothing hangs: a child process past its bound is killed with everything it started,
and the error names what was waited for, its log and what to do; a start-up call (vLLM's engine)
past its bound has its processes killed, which ends the wait."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.core.waits import WaitTimedOut, run_child

REPO = Path(__file__).resolve().parents[2]

# a child that starts a grandchild (as eval.vllm_rows starts vLLM's engine core), then waits forever
PARENT_OF_SLEEPER = (
    "import subprocess, sys, time; "
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "open(sys.argv[1], 'w').write(str(g.pid)); print('started', flush=True); time.sleep(600)"
)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_a_child_past_its_bound_is_killed_with_its_children_and_named(tmp_path):
    log, pidfile = tmp_path / "child.log", tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    with pytest.raises(WaitTimedOut) as err:
        run_child(
            [sys.executable, "-c", PARENT_OF_SLEEPER, str(pidfile)],
            log_file=log,
            timeout_s=3,
            what="the test child",
            todo="do the thing",
        )
    assert time.monotonic() - t0 < 20
    assert re.fullmatch(
        rf"the test child did not finish within 3 s \(pid \d+; it and its 1 child process\(es\) were killed; its "
        rf"log: {log}\); do the thing",
        str(err.value),
    ), err.value
    assert not alive(int(pidfile.read_text()))
    assert log.read_text() == "started\n"


def test_a_child_in_bound_gives_its_exit_status_and_log(tmp_path):
    log = tmp_path / "c.log"
    cmd = [sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"]
    assert run_child(cmd, log_file=log, timeout_s=60, what="x", todo="y") == 3
    assert log.read_text() == "hi\n"


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_the_vllm_child_of_eval_is_bounded_by_eval_vllm_timeout_s(tmp_path, monkeypatch):
    from eval.vllm_rows import ServeSpec, run_in_subprocess

    fake = tmp_path / "python"  # what eval.vllm_rows's child is started with: it never finishes
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -c "{PARENT_OF_SLEEPER}" {tmp_path / "g.pid"}\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    spec = ServeSpec(tmp_path, "ngram", tmp_path / "p.jsonl", 4, 512, 1, 8, 0.0, "float32", 0)
    out = tmp_path / "vllm_ngram.json"
    with pytest.raises(WaitTimedOut) as err:
        run_in_subprocess(spec, out, timeout=3)
    assert str(err.value).startswith(
        "the vLLM ngram engine (python -m eval.serve --method ngram) did not finish within 3 s"
    )
    assert f"its log: {tmp_path / 'vllm_ngram.log'}" in str(err.value) and "eval.vllm_timeout_s" in str(err.value)
    assert not alive(int((tmp_path / "g.pid").read_text())) and not out.exists()


# a stand-in for vllm.LLM: starts an "engine core" process and waits for its ready message, which
# never comes; like vLLM, it fails when that process dies
FAKE_VLLM_START = r"""
import os, subprocess, sys, types
fake = types.ModuleType("vllm")
class LLM:
    def __init__(self, **kwargs):
        core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("ready timeout", os.environ["VLLM_ENGINE_READY_TIMEOUT_S"], flush=True)
        core.wait()
        raise RuntimeError(f"Engine core initialization failed. Failed core proc(s): {core.returncode}")
fake.LLM = LLM
sys.modules["vllm"] = fake
from dspark.core.errors import exit_on_user_error
from dspark.serving.vllm_engine import make_llm
with exit_on_user_error():
    make_llm({"model": "/models/t"}, cpu_kvcache_gib=1, start_timeout_s=3, timeout_key="data.vllm.start_timeout_s")
"""


def test_an_engine_start_past_its_bound_kills_the_engine_and_names_the_setting():
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENGINE_READY_TIMEOUT_S"}
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", FAKE_VLLM_START], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert time.monotonic() - t0 < 60
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stdout == "ready timeout 3\n"  # vLLM's own bound on its last step, set to ours
    assert out.stderr.splitlines()[-1] == (
        "error: starting vLLM's engine for /models/t did not finish within 3 s; see vLLM's log above for the step "
        "it was on (loading weights, compiling, a multi-node peer that never joined: check master_addr/master_port "
        "and that every node was started), then rerun; a larger data.vllm.start_timeout_s if it was only slow"
    )


def test_a_child_dies_with_the_process_that_started_it(tmp_path):
    """kill -9 of the driver alone (not its process group): its child does not run on for nobody."""
    pidfile = tmp_path / "child.pid"
    sleeper = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
    code = (
        "import sys\nfrom pathlib import Path\nfrom dspark.core.waits import run_child\n"
        f"run_child([sys.executable, '-c', {sleeper!r}, {str(pidfile)!r}], log_file=Path({str(tmp_path / 'c.log')!r}),"
        " timeout_s=600, what='x', todo='y')\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    deadline = time.monotonic() + 60
    while not (pidfile.is_file() and pidfile.read_text()):
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    child = int(pidfile.read_text())
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


REAL_VLLM_START = r"""
import os, subprocess, sys
from dspark.core.errors import exit_on_user_error
from dspark.serving.vllm_engine import make_llm

try:
    with exit_on_user_error():
        kwargs = dict(model=sys.argv[1], dtype="float32", max_model_len=512, enforce_eager=True)
        make_llm(kwargs, cpu_kvcache_gib=1, start_timeout_s=float(sys.argv[2]), timeout_key="data.vllm.start_timeout_s")
finally:
    left = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
    print("processes left:", len(left), flush=True)
"""


@pytest.mark.slow
def test_a_real_vllm_engine_start_past_its_bound_is_ended_and_named(tiny_qwen3_dir):
    """vLLM 0.32 itself: its engine core killed by the bound, its start-up wait ends (it does not
    wait forever for the handshake), no process is left and the error names the setting."""
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", REAL_VLLM_START, str(tiny_qwen3_dir), "5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    assert f"error: starting vLLM's engine for {tiny_qwen3_dir} did not finish within 5 s;" in out.stderr
    assert "a larger data.vllm.start_timeout_s if it was only slow" in out.stderr
    assert out.stdout.strip().endswith("processes left: 0")
    assert time.monotonic() - t0 < 300  # the vLLM import included
