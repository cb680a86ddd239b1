"""scripts/device_run.sh, the prepared one-GPU run (issue #26), end to end on CPU at a tiny budget,
as the device runs it: only the packages the device has (torch, transformers and their needs) and
the ones scripts/device_stage.sh stages are importable, so vLLM is not; the wheel staging (a wheel
in parts over two call folders) runs first."""

import hashlib
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "device_run.sh"

SITECUSTOMIZE = '''import sys

HIDDEN = frozenset({hidden!r})


class _Hidden:
    """A meta-path finder wrapped so that the hidden packages are not found: find_spec is None and
    import raises ModuleNotFoundError, as where they are not installed."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self._finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_Hidden(f) for f in sys.meta_path]
'''


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_lacks() -> set[str]:
    """Top-level modules of this environment that the device does not have: neither in
    scripts/device_stage.sh's DEVICE_HAS (with their requirements, as pip would install them) nor
    in its PACKAGES (what it stages). vLLM, wandb, datasets, accelerate, requests are among them."""
    from packaging.requirements import Requirement

    stage = (REPO / "scripts" / "device_stage.sh").read_text()
    has = re.search(r'^DEVICE_HAS="([^"]*)"', stage, re.M).group(1).split()
    staged = re.search(r"^PACKAGES=\(([^)]*)\)", stage, re.M).group(1).split()
    dists = {_norm(d.metadata["Name"]): d for d in md.distributions()}
    allowed, todo = set(), [_norm(n) for n in has]
    while todo:
        name = todo.pop()
        if name in allowed or name not in dists:
            continue
        allowed.add(name)
        for line in dists[name].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    allowed |= {_norm(n) for n in [*staged, "dspark-train", "pip"]}
    return {
        mod
        for mod, names in md.packages_distributions().items()
        if mod.isidentifier() and not any(_norm(n) in allowed for n in names)
    }


def fake_wheel(path: Path, package: str) -> Path:
    """A pure-Python wheel of ``package`` 0.1 (one module), as pip installs it."""
    info = f"{package}-0.1.dist-info"
    files = {
        f"{package}/__init__.py": "STAGED = True\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    wheel = path / f"{package}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def staged_wheels(root: Path, *, with_second_part: bool = True) -> Path:
    """device_stage.sh's layout: call1/ a whole wheel, the first part of another and its hash;
    call2/ the second part."""
    (root / "call1").mkdir(parents=True)
    (root / "call2").mkdir()
    fake_wheel(root / "call1", "dspark_whole")
    split = fake_wheel(root, "dspark_split")
    data = split.read_bytes()
    (root / "call1" / f"{split.name}.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {split.name}\n")
    (root / "call1" / f"{split.name}.part1").write_bytes(data[:200])
    if with_second_part:
        (root / "call2" / f"{split.name}.part2").write_bytes(data[200:])
    split.unlink()
    return root


def device_env(tmp_path: Path, wheels: Path) -> dict[str, str]:
    hide = tmp_path / "hide"
    hide.mkdir()
    hidden = device_lacks()
    assert {"vllm", "wandb", "datasets"} <= hidden
    (hide / "sitecustomize.py").write_text(SITECUSTOMIZE.format(hidden=sorted(hidden)))
    return {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(hide),
        "WHEELS": str(wheels),
        "SITE": str(tmp_path / "site"),
    }


@pytest.mark.slow
def test_device_run_end_to_end_without_vllm(tmp_path):
    """The target converted from the wheel's GGUF (a fresh cache, as on the device) -> generate
    (transformers) -> colocated training with validation at the listed steps -> eval of ours, ngram
    and the chain in the reference loop, every artifact in $OUT."""
    env = device_env(tmp_path, staged_wheels(tmp_path / "whl")) | {"DSPARK_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            f"paths.output_dir={tmp_path / 'run'}",
            f"hydra.run.dir={tmp_path / 'run' / 'hydra'}",
            "train.dtype=float32",
            # the preset's source (1k-8k-token prompts), each cut to its last 256 tokens
            "data.num_prompts=8",
            "data.val_fraction=0.25",
            "data.max_new_tokens=8",
            "data.batch_size=8",
            "data.max_seq_len=256",
            "data.on_overlong=truncate",
            "train.max_seq_len=256",
            "drafter=tiny",
            "train.max_steps=4",
            "train.eval_at_steps=[1,2]",
            "train.micro_batch_size=1",
            "train.anchors_per_seq=4",
            "train.log_every=1",
            "train.warmup_steps=1",
            "eval.context_bins=[1024]",
            "eval.prompts_per_bin=1",
            "eval.max_new_tokens=16",
            # no logging.wandb=false: without wandb (hidden, as on the device) the script turns it off
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "device_run: train.py exited 0" in out.stdout
    assert f"target smollm2-135m: LlamaForCausalLM at {tmp_path / 'cache' / 'targets'}" in out.stdout
    assert "(converted now" in out.stdout  # from the GGUF, with gguf and accelerate as staged

    # staging: the wheel in parts joined and checked, both installed into SITE ahead of the rest
    site = Path(env["SITE"])
    assert "device_run: 2 wheels from" in out.stdout
    assert (site / "dspark_whole" / "__init__.py").is_file() and (site / "dspark_split" / "__init__.py").is_file()

    res = Path(env["OUT"])
    assert {"device.json", "run.log", "validation.jsonl", "results.json", "report.md"} <= {
        p.name for p in res.iterdir()
    }
    assert json.loads((res / "device.json").read_text())["cuda"] is False
    run_log = (res / "run.log").read_text()
    assert "prompt lookup matching: eval.prompt_lookup.longest_match_proposal (vLLM not installed)" in run_log
    assert re.search(r"WARNING\] - vLLM is not installed here: \S+ is not checked with vLLM's classes", run_log)

    steps = [json.loads(line)["step"] for line in (res / "validation.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 4]  # train.eval_at_steps, then the last step

    results = json.loads((res / "results.json").read_text())
    rows = {d["name"]: d for d in results["drafters"]}
    assert set(rows) == {"dspark", "ngram-then-dspark", "ngram-reference"}  # no vLLM row
    assert rows["ngram-reference"]["method"] == "ngram"
    prompts = {name: [p["prompt_id"] for p in d["per_prompt"]] for name, d in rows.items()}
    assert len(prompts["dspark"]) == 1 and all(ids == prompts["dspark"] for ids in prompts.values())
    for d in rows.values():
        assert d["runner"] == "reference"
        o = d["overall"]
        assert o["num_steps"] > 0 and 0 <= o["num_accepted"] <= o["num_draft_tokens"]
        assert o["tokens_per_step"] == 1 + o["num_accepted"] / o["num_steps"] >= 1
    # ours drafts on every step, and so does the chain (ours wherever the lookup finds nothing)
    assert rows["dspark"]["overall"]["draft_share"] == rows["ngram-then-dspark"]["overall"]["draft_share"] == 1.0
    report = (res / "report.md").read_text()
    assert all(f"| {name} | reference |" in report for name in rows)


def test_device_run_refuses_a_wheel_with_a_part_missing(tmp_path):
    """Only the first call's folder arrived: the run stops before anything starts, saying which."""
    env = device_env(tmp_path, staged_wheels(tmp_path / "whl", with_second_part=False))
    out = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "dspark_split-0.1-py3-none-any.whl: 1 part(s)" in out.stderr and "callN folder" in out.stderr
    assert not Path(env["SITE"]).exists()
