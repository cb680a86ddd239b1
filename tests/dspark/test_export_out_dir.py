"""Export writes only where it may (issue #37): ``--out`` missing, empty or an earlier export of
this project; anything else is refused with one error naming what is there, and nothing is lost."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.core.atomic_files import DirectoryInUseError, atomic_path
from dspark.export import export
from dspark.export.vllm_format import ExportError
from tests.dspark.test_export_bytes import TARGET_CONFIG, checkpoint

REPO = Path(__file__).resolve().parents[2]
FIELDS = dict(num_layers=1, block_size=4, markov_rank=4)


@pytest.fixture
def setup(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    run = tmp_path / "checkpoints" / "ckpt"
    run.mkdir(parents=True)
    ckpt = checkpoint(run.parent, FIELDS)  # its tag: checkpoints/ckpt/step00000007
    ckpt.path.mkdir()
    (ckpt.path / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (run / "validation.jsonl").write_text("{}\n")
    return ckpt, target


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_directory_with_a_users_files_is_refused_and_kept(setup, tmp_path):
    ckpt, target = setup
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "dataset.csv").write_text("a,b\n")
    before = _tree(out)
    with pytest.raises(ExportError, match=r"--out .*mine: .*mine holds notes.txt, sub \(no export.json"):
        export(ckpt, out, target_dir=target)
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("where", ["tag", "run", "checkpoints", "inside"])
def test_the_checkpoint_its_parents_and_the_run_directory_are_refused(setup, tmp_path, where):
    ckpt, target = setup
    run = ckpt.path.parent
    out = {"tag": ckpt.path, "run": run, "checkpoints": run.parent, "inside": run / "export"}[where]
    before = _tree(tmp_path / "checkpoints")
    message = r"inside the run's checkpoint directory" if where == "inside" else r"it holds the checkpoint"
    with pytest.raises(ExportError, match=message):
        export(ckpt, out, target_dir=target)
    assert _tree(tmp_path / "checkpoints") == before and not (run / "export").exists()


def test_missing_empty_and_an_earlier_export_are_written_and_the_replacement_is_said(setup, tmp_path, caplog):
    ckpt, target = setup
    export(ckpt, tmp_path / "new", target_dir=target)
    (tmp_path / "empty").mkdir()
    export(ckpt, tmp_path / "empty", target_dir=target)
    assert _tree(tmp_path / "new") == _tree(tmp_path / "empty")
    with caplog.at_level(logging.WARNING, logger="dspark.export"):
        export(ckpt, tmp_path / "new", layout="dspark", dtype="bfloat16", target_dir=target)
    assert f"replacing the earlier export at {tmp_path / 'new'}" in caplog.text
    assert json.loads((tmp_path / "new" / "export.json").read_text())["dtype"] == "bfloat16"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".new")] == []  # the old one is gone


def test_an_earlier_export_with_a_users_file_in_it_is_refused(setup, tmp_path):
    ckpt, target = setup
    export(ckpt, tmp_path / "exp", target_dir=target)
    (tmp_path / "exp" / "notes.txt").write_text("mine")
    before = _tree(tmp_path / "exp")
    with pytest.raises(ExportError, match=r"is an earlier output \(export.json\) but also holds notes.txt"):
        export(ckpt, tmp_path / "exp", target_dir=target)
    assert _tree(tmp_path / "exp") == before


def test_atomic_path_never_replaces_a_directory_it_did_not_write(tmp_path):
    """Every directory atomic_path replaces: refused before anything is written unless it is empty
    or holds the output's marker; a file or a link in its place is refused too."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "user.txt").write_text("x")
    for marker in (None, "done.json"):
        with pytest.raises(DirectoryInUseError, match=r"d holds user.txt"):
            with atomic_path(d, owner_marker=marker) as tmp:
                tmp.mkdir()
    (tmp_path / "link").symlink_to(d, target_is_directory=True)
    with pytest.raises(DirectoryInUseError, match=r"link is a link"):
        with atomic_path(tmp_path / "link") as tmp:
            tmp.mkdir()
    assert (d / "user.txt").read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["d", "link"]
    (d / "done.json").write_text("{}")
    with atomic_path(d, owner_marker="done.json") as tmp:  # an earlier output of its kind: replaced
        tmp.mkdir()
        (tmp / "done.json").write_text("{}")
    assert sorted(p.name for p in d.iterdir()) == ["done.json"]


def test_the_cli_refuses_in_one_error_line_with_status_2(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    ckpt = tmp_path / "ckpt"  # a run's checkpoint directory, its latest tag named
    (ckpt / "step00000001").mkdir(parents=True)
    (ckpt / "latest").write_text("step00000001")
    run = subprocess.run(
        [sys.executable, "-m", "dspark.export", "export", str(ckpt), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: --out {out}: ") and "notes.txt" in errors[0]
    assert (out / "notes.txt").read_text() == "mine"
