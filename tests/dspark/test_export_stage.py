"""The export stage (issue #59): it writes every layout and the record ``exports.json`` that the
eval and the serving benchmark read; it is a no-op while the record matches the checkpoint files
and settings; a record that no longer matches (a newer checkpoint, another dtype, an export file
changed or gone) is refused by its readers naming the file and the command, and rewritten by the
stage. vLLM's check is stubbed here (the main job's test runs it)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

import dspark.export.stage as stage
from dspark.export.stage import ExportRecordError, read_exports, run_export
from tests.dspark.test_export_bytes import TARGET_CONFIG, checkpoint

FIELDS = dict(num_layers=1, block_size=4, markov_rank=4)


@pytest.fixture
def run(tmp_path, monkeypatch, compose_config):
    """(config, target dir, the checkpoint's weights file): a tiny checkpoint run directory with its
    ``latest`` tag, a target config beside it, and the config pointing the export stage at them."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    ckpt = checkpoint(tmp_path, FIELDS)  # tmp_path/ckpt/step00000007
    ckpt.path.mkdir(parents=True)
    weights = ckpt.path / "mp_rank_00_model_states.pt"
    weights.write_bytes(b"weights")
    (ckpt.path.parent / "latest").write_text(ckpt.path.name)
    monkeypatch.setattr(stage, "read_checkpoint", lambda cfg, path: ckpt)
    monkeypatch.setattr(stage, "_check", lambda d, target_dir, gamma: f"vLLM classes, {gamma} draft tokens: ok")
    cfg = compose_config(
        f"paths.output_dir={tmp_path / 'out'}",
        f"export.checkpoint={ckpt.path.parent}",
        "eval.ablation_checkpoint=null",
        "drafter.block_size=4",
    )
    return cfg, target, weights


def _mtimes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in d.iterdir()}


def test_the_stage_writes_the_exports_and_their_record_which_the_readers_get(run):
    cfg, target, _ = run
    record = run_export(cfg, target)
    out = Path(cfg.export.out_dir)
    assert record.path == out / "exports.json" and list(record.exports) == ["ours"]
    assert list(record.exports["ours"]) == ["dspark"]  # a Markov head: no dflash layout
    d = record.export_dir("ours", "dspark")
    assert d == out / "dspark-dspark" and sorted(p.name for p in d.iterdir()) == [
        "config.json",
        "export.json",
        "model.safetensors",
    ]
    written = json.loads(record.path.read_text())
    assert written["exports"]["ours"]["dspark"]["check"] == "vLLM classes, 4 draft tokens: ok"
    assert (
        written["exports"]["ours"]["dspark"]["files"]["model.safetensors"][0]
        == (d / "model.safetensors").stat().st_size
    )
    got = read_exports(cfg)
    assert got.fingerprint == record.fingerprint and got.sources == record.sources
    # what the eval's long-context warning reads: the window and the training length (not in this run.json)
    assert record.windows == got.windows == {"ours": [None, None]}
    assert got.exports["ours"]["dspark"] == record.exports["ours"]["dspark"]
    assert record.summary_line() == f"1 exports (ours dspark), 1 checked with vLLM's classes -> {record.path}"


def test_a_second_run_is_a_no_op(run, caplog):
    cfg, target, _ = run
    first = run_export(cfg, target)
    before = _mtimes(first.export_dir()) | {"exports.json": first.path.stat().st_mtime_ns}
    with caplog.at_level(logging.INFO):
        again = run_export(cfg, target)
    assert "is up to date (same checkpoint files and settings), skipped" in caplog.text
    assert _mtimes(again.export_dir()) | {"exports.json": again.path.stat().st_mtime_ns} == before


def test_a_newer_checkpoint_is_refused_by_readers_and_exported_again(run):
    cfg, target, weights = run
    first = run_export(cfg, target)
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a later save
    with pytest.raises(ExportRecordError) as err:
        read_exports(cfg)
    assert str(err.value).startswith(f"{first.path}: lists exports of other checkpoint files or settings")
    assert "stages=[export]" in str(err.value)
    again = run_export(cfg, target)
    assert again.fingerprint != first.fingerprint and read_exports(cfg).fingerprint == again.fingerprint


def test_another_dtype_is_another_export(run, compose_config, tmp_path):
    cfg, target, _ = run
    run_export(cfg, target)
    bf16 = compose_config(
        f"paths.output_dir={tmp_path / 'out'}",
        f"export.checkpoint={cfg.export.checkpoint}",
        "eval.ablation_checkpoint=null",
        "drafter.block_size=4",
        "export.dtype=bfloat16",
    )
    with pytest.raises(ExportRecordError, match=r"export.dtype=bfloat16\); run the export stage"):
        read_exports(bf16)
    assert run_export(bf16, target).exports["ours"]["dspark"].dtype == "bfloat16"


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_an_export_file_changed_since_is_named_and_written_again(run, how):
    cfg, target, _ = run
    record = run_export(cfg, target)
    weights = record.export_dir() / "model.safetensors"
    if how == "removed":
        weights.unlink()
    else:
        weights.write_bytes(b"someone else's weights")
    with pytest.raises(ExportRecordError, match=rf"{weights} is not the file the export stage wrote"):
        read_exports(cfg)
    run_export(cfg, target)
    assert read_exports(cfg).export_dir() == weights.parent
    written = read_exports(cfg).files[str(weights.parent)]["model.safetensors"]
    assert b"someone else's" not in weights.read_bytes() and written[0] == weights.stat().st_size  # written again


def test_no_record_and_an_unreadable_one(run, caplog):
    cfg, target, _ = run
    path = Path(cfg.export.out_dir) / "exports.json"
    with pytest.raises(ExportRecordError) as err:
        read_exports(cfg)
    assert str(err.value) == (
        f"{path}: no export record (nothing exported there yet); run the export stage first: "
        "python train.py +experiment=... stages=[export]"
    )
    run_export(cfg, target)
    path.write_text('{"record_version": 2, "fingerprint": "x"}')  # cut short
    with pytest.raises(ExportRecordError, match=rf"{path}: unreadable field 'exports'"):
        read_exports(cfg)
    with caplog.at_level(logging.WARNING):
        run_export(cfg, target)
    assert f"export: {path} is unreadable" in caplog.text and read_exports(cfg).exports


def test_a_missing_checkpoint_names_the_key(run, compose_config, tmp_path):
    _, target, _ = run
    cfg = compose_config(f"paths.output_dir={tmp_path / 'out'}", f"export.checkpoint={tmp_path / 'nothing'}")
    with pytest.raises(ExportRecordError) as err:
        run_export(cfg, target)
    assert str(err.value) == (
        f"export: no checkpoint at {tmp_path / 'nothing'}; train it first (stages=[train]) or set export.checkpoint "
        "to a checkpoint or a drafter directory"
    )
    assert not Path(cfg.export.out_dir).exists()  # nothing created


@pytest.mark.parametrize(
    "old, new",
    [
        ("eval.export_dir", "export.out_dir"),
        ("eval.export_dtype", "export.dtype"),
        ("eval.checkpoint", "export.checkpoint"),
    ],
)
def test_the_moved_keys_name_their_new_place(old, new, compose_config):
    """Issue #59: the three keys moved to the export group; the old one is refused in one line."""
    from dspark.config import ConfigError
    from dspark.core.errors import UserError, check_composition

    want = f"{old} is now {new} (export is a stage of its own): write {new}=... instead"
    with pytest.raises(UserError) as err:
        check_composition([f"{old}=/x"])
    assert str(err.value) == want
    with pytest.raises(ConfigError) as err:
        compose_config(f"+{old}=/x")
    assert str(err.value) == want
