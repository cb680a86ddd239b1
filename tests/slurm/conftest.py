"""A real local Slurm for the batch-script tests (one node, and a second on the same host for
heterogeneous jobs): munged, slurmctld and slurmd from
Debian's `munge` and `slurm-wlm`, on loopback, with every file (config, state, spool, logs, the
munge socket) in one temporary directory. Started once per session, always stopped.

proctrack/linuxproc, task/none and no accounting: nothing needs cgroups or namespaces, so it
runs as root inside a container. No GRES: jobs ask for `--gpus-per-node=0`.

Debug by hand:  python tests/slurm/conftest.py   (starts it, prints SLURM_CONF, waits for ^C)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sacct")
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def missing_binaries() -> list[str]:
    return [b for b in DAEMONS if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_line(name: str, port: int | None = None) -> str:
    """This machine as slurmd sees it (`slurmd -C`), memory rounded down a little so the node
    never reports less than configured; ``port``: its own slurmd port (a second node here)."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(\w+)=(\S+)", out.splitlines()[0]))
    mem = int(int(fields["RealMemory"]) * 0.9)
    return (
        f"NodeName={name} NodeAddr=127.0.0.1 CPUs={fields['CPUs']} Boards={fields['Boards']} "
        f"SocketsPerBoard={fields['SocketsPerBoard']} CoresPerSocket={fields['CoresPerSocket']} "
        f"ThreadsPerCore={fields['ThreadsPerCore']} RealMemory={mem}"
        + (f" Port={port}" if port else "")
        + " State=UNKNOWN"
    )


class LocalSlurm:
    """munged + slurmctld + slurmd under ``root``; ``env`` is what a client (sbatch) needs.

    Partition ``debug`` (the default, every test's) is this host's node. A second slurmd on the
    same host, node ``localhost`` (another name that resolves here, as the batch scripts use
    node names as rendezvous addresses), makes partition ``het`` of two nodes: Slurm places the
    components of a heterogeneous job on different nodes (on one node they pend on Resources),
    so ``het`` is where slurm/online.sbatch runs. None when this host's own node is
    ``localhost``."""

    TERMINAL = TERMINAL

    def __init__(self, root: Path):
        self.root = root
        # The node is this host under its own name when that resolves (train.sbatch's rendezvous
        # endpoint is the node name, as on a cluster), else "localhost".
        self.node = socket.gethostname().split(".")[0]
        try:
            socket.gethostbyname(self.node)
        except OSError:
            self.node = "localhost"
        self.second = None if self.node == "localhost" else "localhost"
        self.het_partition = "het" if self.second else None
        self.conf = root / "etc" / "slurm.conf"
        self.socket = root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for k in list(self.env):  # a Slurm job running these tests must not leak its allocation
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF":
                del self.env[k]

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> None:
        for d in ("etc", "munge", "state", "log", *(f"spool/{n}" for n in (self.node, self.second) if n)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}", "--force"], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
            ],
        )
        self._wait_for(lambda: self.socket.exists(), timeout, "munged socket")
        self.ctld_port, self.slurmd_port, self.second_port = _free_port(), _free_port(), _free_port()
        self.conf.write_text(self.config())
        (self.conf.parent / "cgroup.conf").write_text(
            "# unused: proctrack/linuxproc, task/none\nCgroupPlugin=autodetect\n"
        )
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        if self.second:
            self._spawn("slurmd-2", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.second])
        self._wait_for(self._node_idle, timeout, f"nodes {self.node} {self.second or ''} IDLE")

    def stop(self) -> None:
        if all(self.procs.get(n) and self.procs[n].poll() is None for n in ("slurmctld", "slurmd", "munged")):
            # jobs a failed test left behind: their slurmstepd would outlive slurmd
            self.run("scancel", "--full", "--user=root", check=False)
            deadline = time.time() + 30
            while (
                time.time() < deadline
                and self.run("squeue", "-h", "-t", "RUNNING,COMPLETING", check=False).stdout.strip()
            ):
                time.sleep(1)
        for name in ("slurmd-2", "slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )

    def _wait_for(self, ok, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}\n{self.logs()}")
            if ok():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.logs()}")

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        want = [n for n in (self.node, self.second) if n]
        return out.returncode == 0 and all(states.get(n, "").rstrip("*") == "idle" for n in want)

    def config(self) -> str:
        r = self.root
        return f"""\
# Written by tests/slurm/conftest.py: nodes on loopback, no cgroups, no accounting.
ClusterName=dspark-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire=20
# ^ also the hold before a requeued batch job may start again (default 120 s)
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}/%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=3600
KillWait=10
InactiveLimit=0
{_node_line(self.node)}
{_node_line(self.second, self.second_port) if self.second else ""}
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
{f"PartitionName=het Nodes={self.node},{self.second} MaxTime=INFINITE State=UP" if self.second else ""}
"""

    # -- clients -----------------------------------------------------------------------------
    def run(
        self, *argv: str, check: bool = True, cwd: Path = REPO, env: dict | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        out = subprocess.run(
            list(argv), capture_output=True, text=True, cwd=cwd, timeout=timeout, env={**self.env, **(env or {})}
        )
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    def records(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job` as one dict per record (each task of an array, each het component),
        all from one call, so a job's state and its other fields are read at the same moment."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if out.returncode != 0:
            return []
        return [dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", line)) for line in out.stdout.splitlines() if line.strip()]

    def job(self, job_id: str) -> dict[str, str]:
        """The first record of `records` (an array job's first task), or {} for an unknown job."""
        return next(iter(self.records(job_id)), {})

    def states(self, job_id: str) -> list[str]:
        """JobState of every record of a job (each task of an array)."""
        return [r.get("JobState", "") for r in self.records(job_id)]

    def wait(self, *job_ids: str, timeout: float = 600, until=TERMINAL) -> dict[str, dict[str, str]]:
        """Wait until every job is in a terminal state (or a pending dependency can never run); the
        info returned is the query that found it so (a second query could still say COMPLETING)."""
        deadline = time.time() + timeout
        while True:
            records = {j: self.records(j) for j in job_ids}
            if all(self._settled(recs, until) for recs in records.values()):
                return {j: recs[0] for j, recs in records.items()}
            if time.time() > deadline:
                raise AssertionError(
                    f"jobs not finished after {timeout:.0f}s: "
                    + ", ".join(
                        f"{j} {[(r.get('JobState'), r.get('Reason')) for r in recs]}" for j, recs in records.items()
                    )
                    + "\n"
                    + self.logs()
                )
            time.sleep(2)

    @staticmethod
    def _settled(records: list[dict[str, str]], until) -> bool:
        if not records:
            return False
        first = records[0]
        if first.get("JobState") == "PENDING" and first.get("Reason") == "DependencyNeverSatisfied":
            return True
        return all(r.get("JobState") in until for r in records)

    def logs(self, tail: int = 40) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {f.name} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(parts)


@pytest.fixture(scope="session")
def slurm():
    missing = missing_binaries()
    if missing:
        pytest.skip(
            f"no local Slurm: {', '.join(missing)} not installed "
            "(apt-get install slurm-wlm munge; .ci/run installs them)"
        )
    if os.geteuid() != 0:
        pytest.skip("the local Slurm runs slurmd as root (SlurmdUser=root); not root here")
    root = Path(tempfile.mkdtemp(prefix="dspark-slurm-"))
    cluster = LocalSlurm(root)
    try:
        cluster.start()
        yield cluster
    except Exception:
        print(cluster.logs(200))
        raise
    finally:
        cluster.stop()
        if os.environ.get("DSPARK_KEEP_SLURM") != "1":
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":

    def _interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # also when started in the background
    c = LocalSlurm(Path(tempfile.mkdtemp(prefix="dspark-slurm-")))
    try:
        c.start()
        print(f"export SLURM_CONF={c.conf}\n(logs in {c.root / 'log'}; ^C stops it)", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
        print(c.logs(20))
