"""The trainer's checkpoints exported for vLLM (``dspark.export``): the trained weights from ZeRO-0
and ZeRO-3 tags, bad checkpoints and exports refused, an export for another target refused, and a
kill or a full disk mid-export leaving no half export."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.core.file_reads import file_sha256
from tests.toy import REPO, make_trainer
from tests.toy import TINY_LAYERS as LAYERS  # + final state 4


def test_export_from_zero0_and_zero3_checkpoints_gives_the_trained_weights(compose_config, tiny, tmp_path):
    from dspark.export import export
    from dspark.export.validate import validate
    from dspark.export.vllm_format import read_export

    target, _ = tiny
    z0 = make_trainer(
        compose_config, tiny, tmp_path / "z0", "train.max_steps=3", "train.save_every=3", "deepspeed=zero0"
    )
    z0.train()
    z3 = make_trainer(
        compose_config, tiny, tmp_path / "z3", "train.max_steps=3", "train.save_every=3", "deepspeed=zero3"
    )
    z3.train()
    s0 = export(tmp_path / "z0" / "ckpt", tmp_path / "e0")
    s3 = export(tmp_path / "z3" / "ckpt", tmp_path / "e3")
    assert (s0.zero_stage, s3.zero_stage, s3.step) == (0, 3, 3)
    assert s3.vllm_target_layer_ids == [i - 1 for i in LAYERS] and s3.sample_from_anchor is True
    e0, e3 = read_export(tmp_path / "e0"), read_export(tmp_path / "e3")
    trained = {k: v for k, v in z0.model.state_dict().items() if k in e0.weights}
    assert set(trained) == set(e0.weights) and len(trained) > 10
    for k, v in trained.items():
        assert torch.equal(e0.weights[k], v.float()), k
        torch.testing.assert_close(
            e3.weights[k], e0.weights[k], rtol=1e-3, atol=1e-4
        )  # merged ZeRO-3 shards; weights ~0.02
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert (
        cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["sample_from_anchor"] is True and cfg["markov_rank"] == 16
    )
    rep = validate(tmp_path / "e3", target_dir=target, num_speculative_tokens=4)
    assert rep.vllm_aux_layer_ids == LAYERS and rep.params_checked > 10


def test_export_refuses_bad_checkpoints_and_exports(compose_config, tiny, tmp_path):
    from dspark.checkpoint_tags import CheckpointError
    from dspark.export import export
    from dspark.export.vllm_format import ExportError, read_export

    target, _ = tiny
    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1", "train.save_every=1").train()
    ckpt = tmp_path / "ckpt"
    with pytest.raises(ExportError, match="sample_from_anchor=true"):
        export(ckpt, tmp_path / "x", layout="dflash")
    export(ckpt, tmp_path / "ok")
    cfg_file = tmp_path / "ok" / "config.json"
    good = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({k: v for k, v in good.items() if k != "sample_from_anchor"}))
    with pytest.raises(ExportError, match="sample_from_anchor' missing"):
        read_export(tmp_path / "ok")
    cfg_file.write_text(json.dumps({**good, "target_layer_ids": LAYERS}))  # the classic off-by-one
    with pytest.raises(ExportError, match=r"name layers \[2, 3\].*trained on \[1, 2\]"):
        read_export(tmp_path / "ok")
    tag = ckpt / "step00000001"
    states_file = tag / "mp_rank_00_model_states.pt"
    states = torch.load(states_file, weights_only=False)
    states["module"]["drafter.fc.weight"] = states["module"]["drafter.fc.weight"][:, :-1]
    torch.save(states, states_file)
    with pytest.raises(CheckpointError, match=r"'fc.weight' has shape \[64, 127\], expected \[64, 128\]"):
        export(ckpt, tmp_path / "y")
    states_file.write_bytes(states_file.read_bytes()[:1000])  # a torn write
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt: cannot be read"):
        export(ckpt, tmp_path / "y")
    (tag / "run.json").unlink()
    shutil.rmtree(tag / "mp_rank_00_model_states.pt", ignore_errors=True)
    with pytest.raises(CheckpointError, match="no DeepSpeed checkpoint|not a DeepSpeed checkpoint|cannot be read"):
        export(ckpt, tmp_path / "y")
    assert not (tmp_path / "y").exists()  # nothing half-written is left behind


def test_validate_refuses_an_export_for_another_target(compose_config, tiny, tmp_path, smollm2_dir):
    from dspark.export import export
    from dspark.export.validate import check_target, validate
    from dspark.export.vllm_format import ExportError, read_export

    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1", "train.save_every=1").train()
    export(tmp_path / "ckpt", tmp_path / "e")
    check_target(read_export(tmp_path / "e"), tiny[0])  # its own target passes
    with pytest.raises(ExportError, match="target states of width 64.*hidden_size is 576"):
        validate(tmp_path / "e", target_dir=smollm2_dir)


KILL_MID_EXPORT = r"""
import os, signal, sys
import safetensors.torch
import dspark.export

def save_file(tensors, filename, metadata=None):  # half of model.safetensors written, then SIGKILL
    data = safetensors.torch.save(tensors, metadata=metadata)
    with open(filename, "wb") as f:
        f.write(data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)

dspark.export.save_file = save_file
sys.exit(dspark.export.main(sys.argv[1:]))
"""


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_kill_9_mid_export_leaves_no_half_export_and_the_rerun_writes_the_same_bytes(
    compose_config, tiny, tmp_path, caplog
):
    import socket

    from dspark.export import export

    target, _ = tiny
    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1", "train.save_every=1").train()
    ckpt, out = tmp_path / "ckpt", tmp_path / "export"

    def killed_export() -> None:
        cmd = [sys.executable, "-c", KILL_MID_EXPORT, "export", str(ckpt), "--out", str(out), "--no-validate"]
        child = subprocess.run(
            [*cmd, "--target-dir", str(target)], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]

    def digests(d: Path) -> dict[str, str]:
        return {p.name: file_sha256(p) for p in sorted(d.iterdir())}

    killed_export()
    assert not out.exists()  # the half model.safetensors is in a temporary directory, never under --out
    (half,) = tmp_path.glob(".export.tmp-*")
    assert (half / "model.safetensors").is_file()
    live = tmp_path / f".export.tmp-{socket.gethostname()}-{os.getpid()}-000000"  # an export still running
    elsewhere = tmp_path / ".export.tmp-another-host-1-000000"  # another node's: its process cannot be asked
    live.mkdir(), elsewhere.mkdir()
    export(ckpt, out, target_dir=target)  # the rerun: the killed export's directory goes, with a warning
    assert f"removed {half}: a temporary export left by process" in caplog.text
    assert sorted(tmp_path.glob(".export.tmp-*")) == sorted([live, elsewhere])
    export(ckpt, tmp_path / "uninterrupted", target_dir=target)
    want = digests(tmp_path / "uninterrupted")
    assert digests(out) == want and set(want) == {"config.json", "export.json", "model.safetensors"}
    killed_export()  # a re-export over a complete one, killed: the complete one stays as it was
    assert digests(out) == want


def test_a_full_disk_during_export_is_named_and_leaves_nothing(compose_config, tiny, tmp_path, small_disk, capsys):
    from dspark.export import main

    make_trainer(compose_config, tiny, tmp_path, "train.max_steps=1", "train.save_every=1").train()
    disk = small_disk.mount(256 * 1024)  # the tiny drafter's model.safetensors is about 3 MB
    args = ["export", str(tmp_path / "ckpt"), "--out", str(disk / "drafter"), "--no-validate"]
    with pytest.raises(SystemExit) as e:
        main([*args, "--target-dir", str(tiny[0])])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"error: {disk}: no space for export drafter \([\d,]+ bytes needed, [\d,]+ bytes free\); free space there "
        r"or pass another --out, then export again\n",
        err,
    ), err
    assert list(disk.iterdir()) == []  # no half export, no temporary directory
