"""issue #58 item 7: the llama.cpp build is checked like a cache. A truncated ``llama-server`` made
the eval say "exited with status -11", an emptied one gave an Exec format error traceback: the
build was trusted on its marker alone. Here on a made-up build tree (the real build is
tests/eval/test_llama_cpp.py's)."""

import json
import os

import pytest

from dspark.serving.llama_cpp import build as lb


def _fake_build(tmp_path, monkeypatch, *, record=True):
    built = []

    def fake_unpack(_sdist, dest):
        (dest / "llama.cpp" / "build" / "bin").mkdir(parents=True)

    def fake_build(tree, _log, _jobs):
        built.append(tree.root)
        (tree.bin_dir / "llama-server").write_bytes(b"\x7fELF" + b"s" * 4000)
        (tree.bin_dir / "libggml-cpu-zen4.so").write_bytes(b"\x7fELF" + b"z" * 3000)
        (_log).write_text("built\n")

    monkeypatch.setattr(lb, "_sdist", lambda where: where / "fake.tar.gz")
    monkeypatch.setattr(lb, "_unpack", fake_unpack)
    monkeypatch.setattr(lb, "_build", fake_build)
    monkeypatch.setattr(lb.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    tree = lb.ensure_built(tmp_path)
    if not record:
        info = tree.info()
        del info["binaries"]
        (tree.root / lb.BUILT_MARKER).write_text(json.dumps(info))
    return tree, built


def test_a_build_records_its_binaries_and_an_intact_one_is_used_as_is(tmp_path, monkeypatch):
    tree, built = _fake_build(tmp_path, monkeypatch)
    assert sorted(tree.info()["binaries"]) == ["libggml-cpu-zen4.so", "llama-server"]
    assert tree.info()["binaries"]["llama-server"][0] == 4004
    assert lb.find(tmp_path) == tree and lb.require(tmp_path) == tree
    assert lb.ensure_built(tmp_path) == tree and len(built) == 1  # not built again


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda p: os.truncate(p, 100), "llama-server: 100 bytes, its build wrote 4004"),
        (lambda p: os.truncate(p, 0), "llama-server: 0 bytes, its build wrote 4004"),
        (lambda p: p.write_bytes(b"\x7fELF" + b"x" * 4000), "llama-server: altered since its build"),
        (lambda p: p.unlink(), "llama-server: missing"),
    ],
)
def test_a_damaged_server_is_refused_naming_it_and_the_rebuild_then_rebuilt(tmp_path, monkeypatch, damage, says):
    tree, built = _fake_build(tmp_path, monkeypatch)
    damage(tree.server)
    assert lb.find(tmp_path) is None
    with pytest.raises(lb.LlamaCppError) as err:
        lb.require(tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"the llama.cpp build in {tree.root} is damaged ({tree.bin_dir}/") and says in msg
    assert msg.endswith("rebuild it (about 10 min on 2 cores): .venv/bin/python -m dspark.serving.llama_cpp build")
    again = lb.ensure_built(tmp_path)  # what `python -m dspark.serving.llama_cpp build` and the eval call
    assert len(built) == 2 and lb.damage(again) is None and lb.find(tmp_path) == again


def test_a_build_from_before_the_record_is_recorded_on_first_use(tmp_path, monkeypatch):
    tree, _ = _fake_build(tmp_path, monkeypatch, record=False)
    assert "binaries" not in tree.info()
    assert lb.find(tmp_path) == tree and "llama-server" in tree.info()["binaries"]
    os.truncate(tree.server, 10)
    assert lb.find(tmp_path) is None
