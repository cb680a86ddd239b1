"""Issue #48: the drafter GGUF beside an export is reused only when it is the one converted from
this export's bytes, and a user's file of that name is never overwritten (llama.cpp's converter
is stood in for; tests/eval/test_llama_cpp.py runs the real one)."""

import os
from types import SimpleNamespace

import pytest

from dspark.core.derived_files import NotDerivedError
from dspark.export import gguf


@pytest.fixture
def fake(tmp_path, monkeypatch):
    exp, target = tmp_path / "exp", tmp_path / "target"
    exp.mkdir()
    target.mkdir()
    (exp / "config.json").write_text("{}")
    (exp / "model.safetensors").write_bytes(b"weights-1")
    (target / "config.json").write_text("{}")
    calls = []

    def convert(tree, args, out, what, tmp):
        calls.append(what)
        tmp.write_bytes(b"gguf of " + (exp / "model.safetensors").read_bytes())

    monkeypatch.setattr(gguf, "_convert", convert)
    monkeypatch.setattr(gguf, "export_problem", lambda d: None)
    run = lambda: gguf.convert_export(SimpleNamespace(root=tmp_path / "b11434"), exp, target, "f32")  # noqa: E731
    return SimpleNamespace(exp=exp, out=gguf.gguf_path(exp, "f32"), calls=calls, run=run)


def test_a_users_file_where_the_gguf_goes_is_refused_and_kept(fake):
    fake.out.write_bytes(b"my own model")
    with pytest.raises(NotDerivedError) as err:
        fake.run()
    assert str(err.value) == (
        f"{fake.out}: a file this project did not write (no {fake.out.name}.record.json), where the drafter GGUF "
        "goes; refusing to overwrite it: move it, or export to another --out"
    )
    assert fake.out.read_bytes() == b"my own model" and fake.calls == []


def test_the_gguf_is_reused_only_when_converted_from_these_bytes(fake, caplog):
    assert fake.run() == fake.out and fake.out.read_bytes() == b"gguf of weights-1" and len(fake.calls) == 1
    fake.run()
    assert len(fake.calls) == 1  # reused
    weights = fake.exp / "model.safetensors"
    old = weights.stat()
    weights.write_bytes(b"weights-2")
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns - 10**9))  # older than the GGUF: mtime would reuse it
    fake.run()
    assert fake.out.read_bytes() == b"gguf of weights-2" and len(fake.calls) == 2
    fake.out.write_bytes(b"gguf of weights-X")  # damaged in place
    with caplog.at_level("WARNING"):
        fake.run()
    assert fake.out.read_bytes() == b"gguf of weights-2" and len(fake.calls) == 3
    assert f"{fake.out}: sha256 " in caplog.text and "rebuilding this drafter GGUF from its source" in caplog.text
