"""OS errors the user can act on (issue #48): a parent that is a file, no permission, a read-only
filesystem, a place that takes no files, a tag whose run.json is not its weights'. Each is one
``error:`` line naming the path and the cause, exit status 2; a full disk is said only for
ENOSPC/EDQUOT; a refused write replaces nothing and leaves nothing."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark.core.atomic_files import NotWritableError, atomic_path
from dspark.core.disk_space import DiskFullError, is_disk_full
from dspark.export import export, main
from tests.dspark.test_export_bytes import TARGET_CONFIG, checkpoint
from tests.dspark.test_export_out_dir import FIELDS, _tree


@pytest.fixture
def setup(tmp_path):
    """A drafter's tag (checkpoints/ckpt/step00000007, its weights in memory) and its target's config."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    (tmp_path / "checkpoints" / "ckpt").mkdir(parents=True)
    ckpt = checkpoint(tmp_path / "checkpoints", FIELDS)
    ckpt.path.mkdir()
    return ckpt, target


def _refuse(monkeypatch, name: str, code: int, where: Path) -> None:
    """``os.<name>`` raises ``code`` for every path directly in ``where``, as the OS would."""
    real = getattr(os, name)

    def refused(path, *args, **kwargs):
        if Path(path).parent == where:
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, refused)


def _cli_error(capsys, monkeypatch, ckpt, target: Path, out: Path) -> str:
    """The one ``error:`` line of ``python -m dspark.export export TAG --out OUT`` (status 2)."""
    monkeypatch.setattr("dspark.export.load_training_checkpoint", lambda _: ckpt)
    argv = ["export", str(ckpt.path), "--out", str(out), "--target-dir", str(target), "--no-validate"]
    with pytest.raises(SystemExit) as ended:
        main(argv)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


def test_out_below_a_regular_file_is_one_error_naming_the_file(setup, tmp_path, capsys, monkeypatch):
    ckpt, target = setup
    (tmp_path / "notes.txt").write_text("mine")
    line = _cli_error(capsys, monkeypatch, ckpt, target, tmp_path / "notes.txt" / "out")
    assert line == f"error: cannot write {tmp_path}/notes.txt/out: {tmp_path}/notes.txt is a file, expected a directory"
    line = _cli_error(capsys, monkeypatch, ckpt, target, tmp_path / "notes.txt" / "a" / "out")  # ENOTDIR
    assert line.endswith(f": {tmp_path}/notes.txt is a file, expected a directory")
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM])
def test_a_parent_without_write_permission_is_one_error(setup, tmp_path, capsys, monkeypatch, code):
    ckpt, target = setup
    (tmp_path / "locked").mkdir()
    _refuse(monkeypatch, "mkdir", code, tmp_path / "locked")
    line = _cli_error(capsys, monkeypatch, ckpt, target, tmp_path / "locked" / "out")
    assert line == f"error: cannot write {tmp_path}/locked/out: no permission to write in {tmp_path}/locked " + (
        f"({os.strerror(code)})"
    )


def test_a_read_only_filesystem_is_one_error_not_two(setup, tmp_path, capsys, monkeypatch):
    """The cleanup's unlink, refused too (a read-only mount refuses even a missing file's), is not
    raised over the first error."""
    ckpt, target = setup
    (tmp_path / "ro").mkdir()
    for name in ("mkdir", "unlink", "rmdir"):
        _refuse(monkeypatch, name, errno.EROFS, tmp_path / "ro")
    line = _cli_error(capsys, monkeypatch, ckpt, target, tmp_path / "ro" / "out")
    assert line == f"error: cannot write {tmp_path}/ro/out: {tmp_path}/ro is on a read-only filesystem"


def test_a_cleanup_that_fails_is_a_warning_not_a_second_error(tmp_path, monkeypatch, caplog):
    _refuse(monkeypatch, "unlink", errno.EROFS, tmp_path)
    with caplog.at_level(logging.WARNING, logger="dspark.core.atomic_files"):
        with pytest.raises(
            NotWritableError, match=rf"cannot write {tmp_path}/f: {tmp_path} is on a read-only filesystem$"
        ):
            with atomic_path(tmp_path / "f") as tmp:
                tmp.write_text("half")
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp))  # the remount came mid-write
    assert "could not remove" in caplog.text and "the unfinished f" in caplog.text


def test_out_under_proc_is_not_a_full_disk(setup, capsys, monkeypatch):
    ckpt, target = setup
    line = _cli_error(capsys, monkeypatch, ckpt, target, Path("/proc/dspark-export"))
    assert line == (
        "error: cannot write /proc/dspark-export: nothing can be created in /proc, although it exists (a filesystem "
        "such as /proc or /sys)"
    )


def test_a_full_disk_is_said_only_for_enospc_and_edquot(tmp_path, monkeypatch):
    """An errno decides; free space is asked only of a writer whose error has none (torch's zip
    writer: ``unexpected pos``, a full tmpfs in test_trainer_checkpoints' disk-full save)."""
    monkeypatch.setattr("dspark.core.disk_space.free_bytes", lambda _: 0)
    for code in (errno.ENOSPC, errno.EDQUOT):
        assert is_disk_full(OSError(code, os.strerror(code)), tmp_path)
    for code in (errno.EACCES, errno.EROFS, errno.ENOENT, errno.EEXIST):
        assert not is_disk_full(OSError(code, os.strerror(code)), tmp_path)
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.EROFS, os.strerror(errno.EROFS))
    assert not is_disk_full(wrapped, tmp_path)
    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"), tmp_path)
    monkeypatch.setattr("dspark.core.disk_space.free_bytes", lambda _: 1 << 40)
    assert not is_disk_full(RuntimeError("unexpected pos 576 vs 534"), tmp_path)


def test_the_replacement_is_said_only_once_it_happened(setup, tmp_path, monkeypatch, caplog):
    ckpt, target = setup
    out = tmp_path / "exp"
    export(ckpt, out, target_dir=target)
    before = _tree(out)

    def full(weights, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr("dspark.export.save_file", full)
    with caplog.at_level(logging.WARNING, logger="dspark.export"):
        with pytest.raises(DiskFullError, match=r"no space for export exp"):
            export(ckpt, out, target_dir=target)
    assert "replacing" not in caplog.text and _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".exp")) == []
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="dspark.export"):
        export(ckpt, out, dtype="bfloat16", target_dir=target)
    assert f"replacing the earlier export at {out}: done" in caplog.text


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_export_file_has_the_mode_the_umask_gives(setup, tmp_path, umask):
    ckpt, target = setup
    old = os.umask(umask)
    try:
        export(ckpt, tmp_path / "exp", target_dir=target)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "exp").iterdir()}
    assert modes == dict.fromkeys(["config.json", "export.json", "model.safetensors"], 0o666 & ~umask)


def test_the_earlier_output_comes_back_when_the_swap_fails(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "done.json").write_text("old")
    real, failed = os.replace, []

    def replace(src, dst):  # the new output's move into place fails, once
        if Path(dst) == out and not failed:
            failed.append(src)
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        with atomic_path(out, owner_marker="done.json") as tmp:
            tmp.mkdir()
            (tmp / "done.json").write_text("new")
    assert (out / "done.json").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_shards_dir_that_is_a_file_is_named_with_its_key(compose_config, smollm2_dir, tmp_path):
    from data_tools.extract import extract
    from dspark.config import ConfigError

    shards = tmp_path / "shards"
    shards.write_text("mine")
    cfg = compose_config("+experiment=smollm2_cpu_demo", f"paths.output_dir={tmp_path}", f"data.shards_dir={shards}")
    with pytest.raises(ConfigError) as err:
        extract(cfg, target_dir=smollm2_dir)
    assert str(err.value) == f"data.shards_dir={shards}: {shards} is a file, expected a directory"
    assert shards.read_text() == "mine"


def test_a_tag_whose_run_json_is_of_another_drafter_names_the_tag_and_the_difference(tmp_path):
    """run.json copied from a tag of a wider drafter: DeepSpeed's strict load refuses the weights."""
    from dspark.checkpoint import Checkpointer
    from dspark.checkpoint_tags import CheckpointError

    tag = tmp_path / "ckpt" / "step00000004"
    tag.mkdir(parents=True)
    built = torch.nn.ModuleDict({"drafter": torch.nn.Linear(4, 8)})
    saved = {"drafter.weight": torch.zeros(16, 4), "drafter.bias": torch.zeros(16), "drafter.extra": torch.zeros(1)}
    engine = SimpleNamespace(load_checkpoint=lambda *a, **k: built.load_state_dict(saved))
    ck = Checkpointer.__new__(Checkpointer)
    ck.cfg = SimpleNamespace(train=SimpleNamespace(resume=str(tag)))
    ck.resume_tag = lambda: tag
    with pytest.raises(CheckpointError) as err:
        ck.resume(engine, torch.Generator())
    assert str(err.value).startswith(
        f"{tag}: its weights are not those of the drafter its run.json describes (2 tensor(s) of another shape, "
        "e.g. drafter.weight: [16, 4] saved, [8, 4] built; 1 tensor(s) in the tag, not in the drafter, e.g. "
        "drafter.extra); was run.json copied from another tag?"
    ), err.value
    assert "\n" not in str(err.value)
