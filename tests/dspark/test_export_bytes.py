"""The Qwen3-style family's exports, byte for byte: what vLLM reads (config.json and
model.safetensors) from a checkpoint of fixed weights, pinned by SHA-256.

The digests were recorded with the code from before the drafter-family seam (commit ac0119a,
``python -m pytest tests/dspark/test_export_bytes.py`` printing them). Moving the Qwen3 layers
behind dspark.families must not change one byte of what is served; a deliberate format change
updates them here, with its reason in the commit.
"""

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from dspark.checkpoint_weights import TrainingCheckpoint
from dspark.config import DSparkConfig
from dspark.export import export
from dspark.model import DrafterDims, trainable_parameter_shapes

DIMS = DrafterDims(
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    vocab_size=96,
    target_hidden_size=32,
    num_context_layers=3,
    mask_token_id=5,
)
TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 32,
    "num_hidden_layers": 6,
    "vocab_size": 96,
    "max_position_embeddings": 4096,
}

CASES = {
    # layout, drafter fields -> (config.json sha256, model.safetensors sha256)
    "dspark": (
        "dspark",
        dict(num_layers=2, block_size=4, markov_rank=4),
        (
            "d12676531e05c6cf372517bd1bf276c7276138d71f61f5336db1a0b949842193",
            "bc406ed13e799fde81c1a43a94220d9a5df763a3925c47936d5d891a6dea1d2c",
        ),
    ),
    "dspark-markov0": (
        "dspark",
        dict(num_layers=1, block_size=3, markov_rank=0, enable_confidence_head=False),
        (
            "5e4f7f3f2372ba5bb6381a6cb0bf191e20501c6ce9d7491f306edcd52a3e2f5b",
            "359cd4d44253549f69a808343c1965c1ec01eda4ae0c6a8a0ef289c12040f000",
        ),
    ),
    "dflash": (
        "dflash",
        dict(num_layers=2, block_size=4, markov_rank=0, sample_from_anchor=False, enable_confidence_head=False),
        (
            "8979e976f9002ad2a853e1109c48b26eaaae65ce27ff85c6d0c22b001ad70c6e",
            "23e7d813a1507000afaaa853834a5d2147ecc7a6efa46d94ec36b187137f2a00",
        ),
    ),
}

PINNED_NUMBERS = [523.9703972446168, 2.3194361687928904, 168.25300126639195, -0.0794131732545793]
"""(initial |weights| sum at seed 0, hidden sum, |draft logits| sum, confidence logits sum)."""


def fixed_weights(cfg: DSparkConfig, dims: DrafterDims) -> dict[str, torch.Tensor]:
    """Every trainable tensor filled from its name and index alone (no RNG): the same bytes on
    every machine and torch version."""
    out = {}
    for i, (name, shape) in enumerate(sorted(trainable_parameter_shapes(cfg, dims).items())):
        n = math.prod(shape)
        out[name] = torch.sin(torch.arange(n, dtype=torch.float64) * 0.37 + i).float().reshape(shape) * 0.1
    return out


def checkpoint(tmp_path: Path, fields: dict) -> TrainingCheckpoint:
    cfg = DSparkConfig(**fields)
    return TrainingCheckpoint(
        path=tmp_path / "ckpt" / "step00000007",
        step=7,
        drafter=cfg,
        dims=DIMS,
        weights=fixed_weights(cfg, DIMS),
        run_config={"target": {"name": "golden"}, "train": {"dtype": "float32"}},
        zero_stage=0,
        context_layer_ids=[1, 3, 5],
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen3_family_export_bytes_are_pinned(tmp_path, case):
    layout, fields, want = CASES[case]
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    export(checkpoint(tmp_path, fields), tmp_path / "out", layout=layout, target_dir=target)
    got = tuple(
        hashlib.sha256((tmp_path / "out" / f).read_bytes()).hexdigest() for f in ("config.json", "model.safetensors")
    )
    print(case, got)
    assert got == want, f"{case}: the served bytes changed"


def test_qwen3_family_numbers_are_pinned():
    """The same weights give the same forward numbers, and the same seed the same initial weights
    (recorded before the seam like the digests above): training and eval numbers carry over."""
    from dspark.model import DSparkDrafter

    cfg = DSparkConfig(num_layers=2, block_size=4, markov_rank=4)
    v, h = DIMS.vocab_size, DIMS.hidden_size
    shared = dict(
        embed_tokens=torch.sin(torch.arange(v * h, dtype=torch.float64)).float().reshape(v, h),
        lm_head=torch.cos(torch.arange(v * h, dtype=torch.float64)).float().reshape(v, h),
        target_norm=1 + 0.1 * torch.sin(torch.arange(h, dtype=torch.float64)).float(),
        target_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model = DSparkDrafter(cfg, DIMS, **shared)
    init = sum(p.detach().double().abs().sum() for p in model.parameters() if p.requires_grad)
    model.load_state_dict(fixed_weights(cfg, DIMS), strict=False)
    ids = (torch.arange(2 * 12).reshape(2, 12) * 7) % v
    states = torch.sin(torch.arange(2 * 11 * 3 * h, dtype=torch.float64)).float().reshape(2, 11, 3 * h)
    with torch.no_grad():
        out = model(ids, states, torch.tensor([[1, 4, 6], [2, 3, 7]]))
        logits = model.draft_logits(out.hidden, out.markov_embed)
    got = [float(init), float(out.hidden.double().sum()), float(logits.double().abs().sum())]
    got.append(float(out.confidence_logits.double().sum()))
    print(got)
    assert got == pytest.approx(PINNED_NUMBERS, rel=1e-5)


@pytest.mark.parametrize(
    "fields",
    [
        dict(num_layers=1, block_size=4, markov_rank=0),  # the Markov-off ablation: a rank-1 zero head
        dict(num_layers=1, block_size=4, markov_rank=4, confidence_head_with_markov=False),
    ],
    ids=["markov0", "state-only"],
)
def test_confidence_head_on_the_state_alone_is_served_over_state_and_markov_with_zero_columns(tmp_path, fields):
    """llama.cpp reads a DSpark confidence head over [state; Markov embedding] only: a head trained
    on the state alone is exported with zero Markov columns, gives the same logits as served, and
    reads back as it was trained."""
    from safetensors.torch import load_file

    from dspark.export.vllm_format import read_export
    from dspark.families import get_family
    from dspark.model import DSparkDrafter

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    ckpt = checkpoint(tmp_path, fields)
    export(ckpt, tmp_path / "out", layout="dspark", target_dir=target)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    rank = max(fields["markov_rank"], 1)
    assert config["confidence_head_with_markov"] is True and config["markov_rank"] == rank
    family = get_family("qwen3")
    served = {family.from_serving(k): v for k, v in load_file(str(tmp_path / "out" / "model.safetensors")).items()}
    conf = served["confidence_head.proj.weight"]
    h = DIMS.hidden_size
    assert conf.shape == (1, h + rank) and torch.equal(conf[:, h:], torch.zeros(1, rank))
    assert torch.equal(conf[:, :h], ckpt.weights["confidence_head.proj.weight"])
    back = read_export(tmp_path / "out")
    assert back.drafter == ckpt.drafter and set(back.weights) == set(ckpt.weights)
    assert all(torch.equal(back.weights[k], v) for k, v in ckpt.weights.items())

    v = DIMS.vocab_size
    shared = dict(
        embed_tokens=torch.sin(torch.arange(v * h, dtype=torch.float64)).float().reshape(v, h),
        lm_head=torch.cos(torch.arange(v * h, dtype=torch.float64)).float().reshape(v, h),
        target_norm=torch.ones(h),
        target_norm_eps=1e-6,
    )
    trained = DSparkDrafter(ckpt.drafter, DIMS, **shared)
    trained.load_state_dict(ckpt.weights, strict=False)
    as_served = DSparkDrafter(
        DSparkConfig(**{**fields, "markov_rank": rank, "confidence_head_with_markov": True}), DIMS, **shared
    )
    missing, unexpected = as_served.load_state_dict(served, strict=False)
    assert not unexpected and not [k for k in missing if k in served]
    ids = (torch.arange(12) * 7 % v).reshape(1, 12)
    states = torch.sin(torch.arange(11 * 3 * h, dtype=torch.float64)).float().reshape(1, 11, 3 * h)
    with torch.no_grad():
        a = trained(ids, states, torch.tensor([[1, 4, 6]]))
        b = as_served(ids, states, torch.tensor([[1, 4, 6]]))
    assert a.confidence_logits.abs().sum() > 0
    torch.testing.assert_close(b.confidence_logits, a.confidence_logits, rtol=1e-6, atol=1e-6)
