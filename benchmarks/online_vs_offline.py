"""Online against offline training on the same prompts and steps (issue #16, part 2).

Offline: ``stages=[extract,train]`` (shards on disk, then training on them). Online:
``data.mode=online stages=[train]`` (the engine streams states to the trainer). Both on the
experiment's target, the same prompt set and split (so the same validation sequences), the same
drafter, recipe, seed and number of steps. The prompt count is what online consumes:
``steps x grad_accum x new_per_micro_batch`` train prompts (plus the val share), so offline
trains the same prompts for about ``micro_batch / new_per_micro_batch`` epochs, as online reuses
each sequence from its window about that many times.

Reported per mode: val tau and loss at the last step, tokens per second consumed by training
(tokens / training seconds) and per wall-clock second, the extraction rate (tokens/s inside the
engine), the peak resident memory of the whole process tree (trainer + vLLM engine core, summed,
sampled every 0.2 s), wall time, and bytes written: what each run left on disk (shards and their
Arrow cache, checkpoints) and the bytes the process tree wrote (``/proc/<pid>/io`` write_bytes,
last sample per process, so a short-lived child may be missed).

    .venv/bin/python benchmarks/online_vs_offline.py --out outputs/benchmarks/online_vs_offline \\
        [--experiment smollm2_cpu_demo] [--steps 200] [--new-per-micro-batch 1] [-- key=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
CACHES = (".arrow_cache", ".target_topk")
"""What the offline trainer writes beside the shards (the memory-mapped copy, the target's top k)."""


class TreeSampler:
    """Peak summed RSS and per-process write_bytes of a process and its descendants."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.root, self.every_s = psutil.Process(pid), every_s
        self.peak_rss, self.written = 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                continue
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    self.written[p.pid] = p.io_counters().write_bytes
                except (psutil.Error, AttributeError):
                    continue
            self.peak_rss = max(self.peak_rss, rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def run_mode(mode: str, out: Path, common: list[str]) -> dict:
    work = out / mode
    stages = "stages=[train]" if mode == "online" else "stages=[extract,train]"
    cmd = [sys.executable, "train.py", *common, f"data.mode={mode}", stages, f"paths.output_dir={work}"]
    cmd.append(f"hydra.run.dir={work}/run")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(proc.pid)
    _, err = proc.communicate()
    sampler.stop()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{err[-4000:]}")
    log = (work / "run" / "train.log").read_text()
    ckpts = list((work / "checkpoints").rglob("latest"))
    assert len(ckpts) == 1, ckpts
    ckpt = ckpts[0].parent
    tag = ckpt / ckpts[0].read_text().strip()
    client = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    val = client["validations"][-1] if client["validations"] else {}
    if mode == "offline":
        m = re.findall(r"extract: .* ([\d.]+) tok/s", log)
    else:
        m = re.findall(r"online: \d+ sequences from the engine, ([\d.]+) tok/s extracted", log)
    data = work / "data"
    caches = {name: sum(dir_bytes(p) for p in data.rglob(name)) if data.exists() else 0 for name in CACHES}
    return {
        "mode": mode,
        "steps": client["step"],
        "val_tau": val.get("tau"),
        "val_loss": val.get("loss"),
        "tokens_consumed": client.get("tokens"),
        "train_seconds": client["train_seconds"],
        "tokens_per_train_s": client.get("tokens", 0) / max(client["train_seconds"], 1e-9),
        "tokens_per_wall_s": client.get("tokens", 0) / wall,
        "extraction_tokens_per_s": float(m[-1]) if m else None,
        "wall_s": wall,
        "peak_rss_gb": sampler.peak_rss / 2**30,
        "bytes_on_disk": {
            "shards": dir_bytes(data) - sum(caches.values()),
            **caches,
            "checkpoints": dir_bytes(work / "checkpoints"),
        },
        "bytes_written_by_processes": sum(sampler.written.values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--experiment", default="smollm2_cpu_demo")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--new-per-micro-batch", type=int, default=1)
    ap.add_argument("--val-prompts", type=int, default=16)
    ap.add_argument("--modes", default="offline,online")
    ap.add_argument("overrides", nargs="*", help="more key=value overrides for both runs")
    args = ap.parse_args(argv)
    train_prompts = args.steps * args.new_per_micro_batch
    total = train_prompts + args.val_prompts
    common = [
        f"+experiment={args.experiment}",
        f"data.num_prompts={total}",
        f"data.val_fraction={args.val_prompts / total:.6f}",
        f"train.max_steps={args.steps}",
        f"train.micro_batch_size={args.micro_batch}",
        f"data.online.new_per_micro_batch={args.new_per_micro_batch}",
        f"train.eval_every={args.steps}",
        f"train.save_every={args.steps}",
        "logging.wandb=false",
        *args.overrides,
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_mode(mode, args.out, common) for mode in args.modes.split(",")]
    (args.out / "results.json").write_text(json.dumps({"overrides": common, "results": results}, indent=2))
    print(f"overrides: {' '.join(common)}")
    print(
        "| mode | val tau | tok/s (train) | tok/s (wall) | extract tok/s | peak RSS GB | wall s "
        "| data B (shards + caches) | ckpt B |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        d = r["bytes_on_disk"]
        tau = r["val_tau"] if r["val_tau"] is not None else math.nan
        print(
            f"| {r['mode']} | {tau:.3f} | {r['tokens_per_train_s']:.0f} | {r['tokens_per_wall_s']:.0f} | "
            f"{r['extraction_tokens_per_s'] or math.nan:.0f} | {r['peak_rss_gb']:.2f} | {r['wall_s']:.0f} | "
            f"{d['shards'] + sum(d[c] for c in CACHES)} | {d['checkpoints']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
