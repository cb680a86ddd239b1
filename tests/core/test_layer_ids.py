"""The layer-id convention, pinned against transformers' output_hidden_states."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.core.layer_ids import reference_hidden_states, vllm_aux_layer_ids, vllm_draft_target_layer_ids


def test_reference_states_follow_output_hidden_states():
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
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
        "import sys, data_tools.extract, data_tools.verify, dspark.core.shard_format; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed' or m in ('dspark.trainer', "
        "'dspark.model')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
