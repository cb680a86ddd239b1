"""The layer-id convention, pinned against transformers' output_hidden_states."""

import pytest
import torch

from dspark.config import TargetConfig
from dspark.core.layer_ids import (
    reference_hidden_states,
    spread_layer_ids,
    vllm_aux_layer_ids,
    vllm_draft_target_layer_ids,
)
from tests.toy import tiny_llama_target


def test_reference_states_follow_output_hidden_states():
    model = tiny_llama_target()  # 3 layers, hidden 32, vocab 64
    ids = torch.randint(0, 64, (9,))
    with torch.no_grad():
        hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states  # 4 entries
    ref = reference_hidden_states(model, ids, [0, 1, 2, 3])
    assert ref.shape == (9, 4, 32)
    for i in range(3):  # id L = input of decoder layer L
        assert torch.equal(ref[:, i], hs[i][0])
    # id N = the final state *before* the final norm; transformers' last entry is after it
    assert not torch.allclose(ref[:, 3], hs[3][0])
    torch.testing.assert_close(model.model.norm(ref[:, 3]), hs[3][0])


def test_vllm_id_conversions():
    assert vllm_aux_layer_ids([1, 8, 30]) == [1, 8, 30]
    assert vllm_draft_target_layer_ids([1, 15, 28]) == [0, 14, 27]  # vLLM's DSpark captures id+1
    with pytest.raises(ValueError, match="layer id 0"):
        vllm_draft_target_layer_ids([0, 5])


def test_data_tools_imports_no_training_code():
    import subprocess
    import sys

    code = (
        "import sys, data_tools.extract, data_tools.verify, dspark.formats.shard_format, dspark.formats.shard_rows; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed' or m in ('dspark.trainer', "
        "'dspark.model')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_spread_rule_reproduces_the_default_target_preset():
    default = TargetConfig()  # SmolLM2-135M, conf/target/smollm2_135m_cpu.yaml
    assert spread_layer_ids(default.num_hidden_layers) == default.layer_ids == [1, 8, 15, 22, 29]


@pytest.mark.parametrize(
    "layers, k, ids",
    [
        (36, 5, [1, 10, 18, 27, 35]),  # Qwen3-8B: halves round up
        (93, 5, [1, 24, 47, 69, 92]),  # the Kimi K3 preset keeps its own choice, [2, 23, 47, 71, 89]
        (8, 5, [1, 3, 4, 6, 7]),  # the tiny Qwen3 test target
        (4, 5, [1, 2, 3]),  # fewer layers than k: all of them
        (30, 1, [15]),  # one layer: the middle
        (30, 3, [1, 15, 29]),
        (1, 5, [0]),  # nothing but the embedding output
    ],
)
def test_spread_rule_covers_depth_with_increasing_ids(layers, k, ids):
    assert spread_layer_ids(layers, k) == ids
    TargetConfig(num_hidden_layers=layers, layer_ids=ids)  # a valid spec: increasing, below the final state


def test_spread_rule_refuses_nonsense():
    with pytest.raises(ValueError, match="num_hidden_layers >= 1 and k >= 1"):
        spread_layer_ids(30, 0)
