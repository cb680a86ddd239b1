"""`python -m dspark.export`: bad input ends with rc 2 and one `error:` line naming the file, not a
traceback (the export itself is tested on a trained checkpoint in test_trainer_export.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.export.vllm_format import ExportError, read_export

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """As a user runs it: under ``python -m``, where the module is ``__main__``."""
    return subprocess.run(
        [sys.executable, "-m", "dspark.export", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def fake_export(directory: Path, *, config: str = '{"architectures": ["Qwen3DSparkModel"]}', prov: str = "{}") -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(config)
    (directory / "export.json").write_text(prov)
    (directory / "model.safetensors").write_bytes(b"")
    return directory


@pytest.mark.slow  # a subprocess or several: 4-6 s, kept out of the 5-minute fast tier
def test_validate_under_python_m_prints_the_error_line_with_rc_2(tmp_path):
    export = fake_export(tmp_path / "e", config='{"architectures": ["Qwen3DSparkModel"],')  # a torn write
    out = run_cli("validate", export)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: {export / 'config.json'}: not valid JSON (")
    assert out.stderr.rstrip().endswith(f"export it again: python -m dspark.export export CHECKPOINT --out {export}")
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    missing = run_cli("validate", tmp_path / "nope")
    assert missing.returncode == 2
    assert (
        missing.stderr
        == f"error: {tmp_path / 'nope' / 'config.json'}: missing; expected an export written by dspark.export\n"
    )


def test_export_under_python_m_names_a_missing_checkpoint_with_rc_2(tmp_path):
    out = run_cli("export", tmp_path / "ckpt", "--out", tmp_path / "e")
    assert (out.returncode, out.stderr) == (2, f"error: {tmp_path / 'ckpt'}: no such checkpoint directory\n")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    "config, prov, message",
    [
        ("[1, 2]", "{}", r"config.json: a JSON list, expected an object; export it again"),
        ("{}", "{}", r"config.json: field\(s\) \['architectures'\] missing, expected an export written by dspark"),
        (
            None,
            '{"context_layer_ids": [1]}',
            r"export.json: field\(s\) \['drafter', 'dims'\] missing, expected an export written by dspark.export; "
            r"export it again: python -m dspark.export export CHECKPOINT --out ",
        ),
        (None, "{", r"export.json: not valid JSON \(Expecting property name"),
    ],
)
def test_damaged_export_files_are_named(tmp_path, config, prov, message):
    kwargs = {"prov": prov} if config is None else {"config": config, "prov": prov}
    with pytest.raises(ExportError, match=message):
        read_export(fake_export(tmp_path / "e", **kwargs))


def test_provenance_that_does_not_fit_is_named(tmp_path):
    prov = {"context_layer_ids": [1], "drafter": {"no_such_field": 1}, "dims": {}}
    config = {"architectures": ["Qwen3DSparkModel"], "sample_from_anchor": True, "target_layer_ids": [0]}
    export = fake_export(tmp_path / "e", config=json.dumps(config), prov=json.dumps(prov))
    with pytest.raises(
        ExportError, match=r"export.json: fields 'drafter'/'dims' do not fit this code \(.*no_such_field"
    ):
        read_export(export)
    config.pop("target_layer_ids")
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"config.json: field 'target_layer_ids' missing, expected the target layers"):
        read_export(export)
