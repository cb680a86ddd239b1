"""Work split and engine arguments (no vLLM engine started)."""

import json
from pathlib import Path

import pytest

from data_tools.extract import assign, default_rank_world, engine_kwargs, open_dataset_dir, prompt_settings
from dspark.config import DataConfig
from dspark.formats.shard_format import DatasetError, Manifest
from tests.toy import toy_manifest


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


def _manifest(data, prompt_set: str, *, settings: bool = True) -> Manifest:
    return toy_manifest(prompt_set_sha256=prompt_set, prompt_settings=prompt_settings(data) if settings else {})


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_changed_prompt_set_is_refused_naming_the_settings_and_what_to_do(tmp_path):
    out = tmp_path / "data"
    old = DataConfig(num_prompts=128, max_seq_len=512)
    open_dataset_dir(out, _manifest(old, "4e91" * 16))
    (out / "train").mkdir()
    (out / "train" / "shard-00000.parquet").write_bytes(b"rows")
    before = _files(out)
    new = DataConfig(num_prompts=256, max_seq_len=512, source="prompts.txt")
    with pytest.raises(DatasetError) as err:
        open_dataset_dir(out, _manifest(new, "f51a" * 16))
    assert str(err.value) == (
        f"{out}: refusing to resume into a dataset made differently: data.num_prompts: directory has 128, this run "
        "has 256; data.source: directory has 'bundled', this run has 'prompts.txt'. To extract with this run's "
        f"settings, pass data.shards_dir=<a new directory>, or delete {out} first"
    )
    assert _files(out) == before  # nothing extracted is touched
    open_dataset_dir(out, _manifest(DataConfig(num_prompts=300, max_seq_len=512), "4e91" * 16))  # same prompts: resumes
    assert _files(out) == before


def test_same_settings_other_prompts_and_old_manifests_are_explained(tmp_path):
    data = DataConfig(max_seq_len=512)
    open_dataset_dir(tmp_path / "a", _manifest(data, "4e91" * 16))
    with pytest.raises(
        DatasetError,
        match=r"prompt_set_sha256: directory has '4e914e91\.\.\.', this run has 'f51af51a\.\.\.' with the same "
        r"settings: the prompts that data.source='bundled' gives have changed \(another file under the same name, "
        r"or other installed packages for the bundled sources\)\. To extract with this run's settings, pass "
        r"data.shards_dir=<a new directory>, or delete .*/a first",
    ):
        open_dataset_dir(tmp_path / "a", _manifest(data, "f51a" * 16))
    open_dataset_dir(tmp_path / "old", _manifest(data, "4e91" * 16, settings=False))  # written before they were kept
    with pytest.raises(
        DatasetError,
        match=r"prompt_set_sha256: directory has '4e914e91\.\.\.', this run has 'f51af51a\.\.\.' \(the directory's "
        r"manifest does not record which settings made it; any of data.source, data.hf_split, data.num_prompts, "
        r".*data.on_overlong or the prompts in data.source may have changed\)\. To extract with this run's settings",
    ):
        open_dataset_dir(tmp_path / "old", _manifest(data, "f51a" * 16))
    raw = json.loads((tmp_path / "old" / "manifest.json").read_text())
    del raw["prompt_settings"]  # a manifest from before the field existed still loads
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(raw))
    assert Manifest.load(tmp_path / "old").prompt_settings == {}


def test_a_window_past_the_targets_is_refused_before_vllm_starts(compose_config, smollm2_dir, tmp_path):
    """data.max_seq_len up to the target's window (issue #47): vLLM's capture generates one token, so
    8191 is SmolLM2's longest; 8192 gets one line naming the field, the file and the bound."""
    from data_tools.extract import extract
    from dspark.config import ConfigError

    cfg = compose_config("+experiment=smollm2_cpu_demo", f"paths.output_dir={tmp_path}", "data.max_seq_len=8192")
    with pytest.raises(ConfigError, match=r"data.max_seq_len=8192: expected at most 8191, the target's window of 8192"):
        extract(cfg, target_dir=smollm2_dir)
    assert not list((tmp_path / "data").rglob("*.parquet"))
