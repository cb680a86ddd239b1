"""Adding a drafter family is one module, one registry line and one ``conf/drafter/NAME.yaml``
(docs/architecture.md, "Adding a drafter family"; issue #39): proven on a copy of the project
with a dummy family added exactly that way, nothing else edited. In the copy the family's own
field composes through Hydra, names its runs, is refused by the other families, resolves into
the drafter's sizes, builds a drafter that runs, and exports a config.json of its own class that
reads back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TOY_MODULE = '''
"""A dummy drafter family: Qwen3's layers, one field of its own that sets the MLP's width."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from dspark.families.base import dspark_head_fields, served_fields
from dspark.families.qwen3 import Qwen3Family


@dataclass
class ToyFields:
    toy_ffn_mult: Optional[int] = None
    """The MLP's width in multiples of the hidden size; None: 2."""


class ToyFamily(Qwen3Family):
    name = "toy"
    architectures = {"dspark": "ToyDSparkModel"}
    fields = ToyFields
    tag_names = {"toy_ffn_mult": "ffn"}
    tag_defaults = {"rms_norm_eps": 1e-5}
    serves_draft_vocab = False

    def resolve_dims(self, cfg, dims, target_config):
        mult = cfg.toy_ffn_mult or 2
        return replace(dims, toy_ffn_mult=mult, intermediate_size=mult * dims.hidden_size)

    def config_json(self, cfg, dims, layout, *, target_layer_ids, max_position_embeddings, dtype):
        return {
            "architectures": [self.architectures[layout]],
            "model_type": "toy",
            "toy_ffn_mult": dims.toy_ffn_mult,
            "num_hidden_layers": cfg.num_layers,
            "target_layer_ids": target_layer_ids,
            **served_fields(cfg, dims, dtype=dtype),
            **dspark_head_fields(cfg),
        }


FAMILY = ToyFamily()
'''

CHECKS = """
import json, sys
from pathlib import Path

import dspark
import torch

assert Path(dspark.__file__).resolve().is_relative_to(Path.cwd().resolve()), dspark.__file__

from dspark.checkpoint_weights import TrainingCheckpoint
from dspark.config.compose import compose_run
from dspark.config import ConfigError, DSparkConfig
from dspark.export import export
from dspark.model import DSparkDrafter, resolve_dims, trainable_parameter_shapes
from dspark.export.vllm_format import read_export

out = {}
cfg = compose_run(["+experiment=smollm2_cpu_smoke", "drafter=toy", "drafter.toy_ffn_mult=3"])
out["family"], out["field"], out["eps"] = cfg.drafter.family, cfg.drafter.toy_ffn_mult, cfg.drafter.rms_norm_eps
out["run_name"] = cfg.train.run_name
try:
    compose_run(["+experiment=smollm2_cpu_smoke", "drafter.toy_ffn_mult=3"])
except ConfigError as e:
    out["refused"] = str(e)
try:
    DSparkConfig(family="toy", draft_vocab_size=8)
except ConfigError as e:
    out["refused_vocab"] = str(e)

drafter = DSparkConfig(family="toy", toy_ffn_mult=3, num_layers=1, block_size=4, markov_rank=4)
target = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 6,
          "vocab_size": 64, "max_position_embeddings": 512, "architectures": ["Qwen3ForCausalLM"]}
dims = resolve_dims(drafter, target_config=target, vocab_size=64, num_context_layers=2, mask_token_id=3)
out["dims"] = [dims.toy_ffn_mult, dims.intermediate_size]
torch.manual_seed(0)
heads = dict(embed_tokens=torch.randn(64, 16), lm_head=torch.randn(64, 16), target_norm=torch.ones(16),
             target_norm_eps=1e-6)
model = DSparkDrafter(drafter, dims, **heads)
ids = torch.randint(0, 64, (1, 10))
with torch.no_grad():
    o = model(ids, torch.randn(1, 9, 2 * 16), torch.tensor([[1, 4]]))
    out["logits"] = list(model.draft_logits(o.hidden, o.markov_embed).shape)
shapes = trainable_parameter_shapes(drafter, dims)
weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k in shapes}
ckpt = TrainingCheckpoint(path=Path("ckpt/step00000001"), step=1, drafter=drafter, dims=dims, weights=weights,
                          run_config={"target": {"name": "toy"}, "train": {"dtype": "float32"}}, zero_stage=0,
                          context_layer_ids=[2, 4])
Path("target").mkdir()
Path("target/config.json").write_text(json.dumps(target))
export(ckpt, Path("export"), layout="dspark", target_dir=Path("target"))
out["config"] = json.loads(Path("export/config.json").read_text())
back = read_export(Path("export"))
out["read_back"] = [back.drafter == drafter, back.dims == dims, back.layout,
                    all(torch.equal(back.weights[k], v) for k, v in weights.items())]
print("RESULT " + json.dumps(out))
"""


def _project_with_a_dummy_family(root: Path) -> None:
    """A copy of the project's code and configs, plus the three additions and nothing else."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "local")
    for name in ("dspark", "conf"):
        shutil.copytree(REPO / name, root / name, ignore=ignore)
    (root / "dspark/families/toy.py").write_text(TOY_MODULE)
    registry = root / "dspark/families/__init__.py"
    text = registry.read_text()
    for old, new in (
        ("from dspark.families import k3_mla, qwen3", "from dspark.families import k3_mla, qwen3, toy"),
        ("(qwen3.FAMILY, k3_mla.FAMILY)", "(qwen3.FAMILY, k3_mla.FAMILY, toy.FAMILY)"),
    ):
        assert text.count(old) == 1, f"the registry line changed: {old!r}"
        text = text.replace(old, new)
    registry.write_text(text)
    (root / "conf/drafter/toy.yaml").write_text("family: toy\nrms_norm_eps: 1.0e-05\n")


def test_a_new_family_is_one_module_one_registry_line_and_one_preset(tmp_path):
    _project_with_a_dummy_family(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "WANDB_MODE": "disabled", "DSPARK_OUTPUT_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHECKS)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])

    assert (out["family"], out["field"], out["eps"]) == ("toy", 3, 1e-5)
    assert out["run_name"].startswith("toy-markov") and "-ffn3" in out["run_name"], out["run_name"]
    assert "eps" not in out["run_name"]  # what the preset sets is not spelled
    assert "drafter.toy_ffn_mult=3: read by drafter.family=toy only" in out["refused"]
    assert "drafter.draft_vocab_size=8" in out["refused_vocab"]
    assert out["dims"] == [3, 48] and out["logits"] == [1, 2, 4, 64]
    config = out["config"]
    assert config["architectures"] == ["ToyDSparkModel"] and config["toy_ffn_mult"] == 3
    assert config["draft_vocab_size"] == config["vocab_size"] == 64 and config["block_size"] == 4
    assert config["mask_token_id"] == 3 and config["target_hidden_size"] == 16
    assert out["read_back"] == [True, True, "dspark", True]


def test_a_family_config_without_the_shared_fields_is_refused_at_export(tmp_path, monkeypatch):
    """A family whose config.json leaves out a field every DSpark class reads fails the export,
    naming the family and the field."""
    import pytest

    from dspark.export import export
    from dspark.export.vllm_format import ExportError
    from dspark.families import qwen3
    from tests.dspark.test_export_bytes import TARGET_CONFIG, checkpoint

    written = qwen3.Qwen3Family.config_json

    def without_block_size(self, *args, **kwargs):
        config = written(self, *args, **kwargs)
        del config["block_size"]
        return config

    monkeypatch.setattr(qwen3.Qwen3Family, "config_json", without_block_size)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET_CONFIG))
    with pytest.raises(ExportError, match=r"family 'qwen3'.*block_size: expected 4, got '<missing>'"):
        export(
            checkpoint(tmp_path, dict(num_layers=1, block_size=4, markov_rank=4)),
            tmp_path / "out",
            target_dir=tmp_path / "target",
        )
    assert not (tmp_path / "out").exists()
