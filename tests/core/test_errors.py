"""User errors end a command with one line and exit status 2; a debug flag shows the traceback."""

import pytest

from data_tools.prompts import PromptFileError
from dspark.checkpoint_tags import CheckpointError
from dspark.config import ConfigError
from dspark.core.errors import UserError, exit_on_user_error
from dspark.export.vllm_format import ExportError
from dspark.formats.shard_format import DatasetError
from dspark.target import TargetError
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


def test_an_os_error_a_users_path_causes_is_one_line_naming_the_path(tmp_path, capsys):
    """Issue #58 item 8: export --out with a 300-character name ended in an OSError traceback."""
    from dspark.core.errors import USER_ERROR_EXIT, exit_on_user_error

    long = tmp_path / ("x" * 300)
    with pytest.raises(SystemExit) as done:
        with exit_on_user_error():
            long.mkdir()
    assert done.value.code == USER_ERROR_EXIT
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {str(long)[:100]}... (") and "a name longer than the filesystem allows" in line
    with pytest.raises(FileNotFoundError):  # not one a path a user gave causes: the traceback stays
        with exit_on_user_error():
            (tmp_path / "missing" / "file").read_text()


def test_a_directory_or_a_fifo_where_a_file_belongs_is_named_for_what_it_is(tmp_path):
    """Issue #58 item 12: a prompts file that was a directory or a FIFO was reported as "no such file"."""
    import os

    from eval.eval_set import load_eval_set

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for path, says in (
        (tmp_path, "a directory, not a file"),
        (fifo, "a named pipe (FIFO), not a regular file"),
        (tmp_path / "none.jsonl", "no such file"),
    ):
        with pytest.raises(EvalPromptError) as err:
            load_eval_set(path, vocab_size=10)
        assert str(err.value) == f"eval.prompts_file={path}: {says}, expected JSONL with one prompt object per line"
    from data_tools.prompts import load_source

    with pytest.raises(PromptFileError, match="a named pipe \\(FIFO\\), not a regular file"):
        load_source(str(fifo))


def test_ctrl_c_is_one_line_saying_what_was_kept_and_exit_130(capsys):
    """Issue #58 item 13: Ctrl-C printed a traceback during training (three during extraction)."""
    from dspark.core.errors import INTERRUPTED_EXIT, exit_on_user_error

    with pytest.raises(SystemExit) as done:
        with exit_on_user_error():
            raise KeyboardInterrupt
    assert done.value.code == INTERRUPTED_EXIT == 130
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: interrupted (Ctrl-C). Kept: every complete shard, the last checkpoint tag")
    assert line.endswith("the same command resumes from them")


def test_an_interrupt_during_an_engine_call_is_noted_and_still_raised():
    """The driver tells a Ctrl-C that reached vLLM's engine core first from an engine death; a
    process that ignores SIGINT (a background job) is left ignoring it."""
    import os
    import signal

    from dspark.serving.vllm_engine import _noting_interrupts

    before = signal.getsignal(signal.SIGINT)
    try:
        # a terminal's foreground process: Python's own Ctrl-C handler (a job started in the
        # background, as CI may run pytest, inherits SIGINT ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt):
            with _noting_interrupts() as noted:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(100):  # the handler runs between bytecodes
                    pass
        assert noted.is_set() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with _noting_interrupts() as noted:
            os.kill(os.getpid(), signal.SIGINT)
        assert not noted.is_set()
    finally:
        signal.signal(signal.SIGINT, before)
