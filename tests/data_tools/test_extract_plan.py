"""Work split and engine arguments (no vLLM engine started)."""

from pathlib import Path

from data_tools.extract import assign, default_rank_world, engine_kwargs


def test_shards_are_split_across_ranks_without_overlap():
    units = [("train", k) for k in range(7)] + [("val", 0)]
    parts = [assign(units, r, 3) for r in range(3)]
    assert sorted(sum(parts, [])) == sorted(units)
    assert parts[0] == [("train", 0), ("train", 3), ("train", 6)]


def test_rank_and_world_come_from_the_slurm_array(monkeypatch):
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    assert default_rank_world() == (0, 1)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "10")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    assert default_rank_world() == (2, 4)


def test_engine_kwargs_capture_every_layer_and_the_final_state(compose_config):
    cfg = compose_config(
        "+experiment=kimi_k3_gb300", "+data.vllm.engine_kwargs.nnodes=4", "+data.vllm.engine_kwargs.node_rank=1"
    )
    target = cfg.target
    ids = target.capture_layer_ids(93)
    kw = engine_kwargs(target, Path("/models/k3"), ids, cfg.data, Path("/tmp/w"))
    assert kw["tensor_parallel_size"] == 16 and kw["dtype"] == "bfloat16" and kw["trust_remote_code"]
    assert kw["nnodes"] == 4 and kw["node_rank"] == 1
    assert kw["speculative_config"]["method"] == "extract_hidden_states"
    assert kw["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2,
        23,
        47,
        71,
        89,
        93,
    ]
    assert kw["enable_chunked_prefill"] is False
    conn = kw["kv_transfer_config"]
    assert conn["kv_connector_extra_config"]["shared_storage_path"] == "/tmp/w"
    # no CUDA here: the CPU connector subclass is loaded by module path
    assert (
        conn["kv_connector"] == "CPUHiddenStatesConnector"
        and conn["kv_connector_module_path"] == "data_tools.cpu_connector"
    )
