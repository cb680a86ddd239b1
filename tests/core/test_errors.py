"""User errors end a command with one line and exit status 2; a debug flag shows the traceback."""

import pytest

from data_tools.prompts import PromptFileError
from dspark.checkpoint_tags import CheckpointError
from dspark.core.config import ConfigError
from dspark.core.errors import UserError, exit_on_user_error
from dspark.core.shard_format import DatasetError
from dspark.core.target import TargetError
from dspark.export.vllm_format import ExportError
from eval.eval_set import EvalPromptError


@pytest.fixture
def no_debug(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("DSPARK_DEBUG", raising=False)


@pytest.mark.parametrize(
    "kind", [ConfigError, DatasetError, TargetError, CheckpointError, ExportError, PromptFileError, EvalPromptError]
)
def test_every_project_error_type_is_a_user_error(kind, no_debug, capsys):
    with pytest.raises(SystemExit) as stop, exit_on_user_error():
        raise kind("data.shards_dir=/x: no dataset there")
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: data.shards_dir=/x: no dataset there\n"


@pytest.mark.parametrize("name", ["HYDRA_FULL_ERROR", "DSPARK_DEBUG"])
def test_a_debug_flag_lets_the_error_through(name, no_debug, monkeypatch, capsys):
    monkeypatch.setenv(name, "1")
    with pytest.raises(DatasetError, match="no dataset"), exit_on_user_error():
        raise DatasetError("no dataset")
    assert capsys.readouterr().err == ""


def test_a_bug_is_not_a_user_error(no_debug):
    with pytest.raises(KeyError), exit_on_user_error():
        raise KeyError("a bug keeps its traceback")
    assert not issubclass(KeyError, UserError)
