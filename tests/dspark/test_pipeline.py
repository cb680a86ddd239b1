"""The main job on the embedded target: runs the stages that exist and reports the rest."""

import logging

from dspark.pipeline import run


def test_main_job_loads_target_and_reports_pending_stages(smollm2_dir, compose_config, caplog):
    cfg = compose_config("+experiment=smollm2_cpu_demo")
    with caplog.at_level(logging.INFO):
        result = run(cfg)
    assert result.target.path == smollm2_dir
    assert result.target.hidden_size == 576 and result.drafter.block_size == 7
    assert result.stages_run == ["target"]
    assert "capture layers (transformers hidden_states ids): [1, 8, 15, 22, 29, 30]" in caplog.text
    for stage in result.stages_pending:
        assert f"stage {stage}" in caplog.text
