"""Issue #48: the eval writes only into a directory it made or an earlier eval's, never over a
user's files, never over its own input, and a refused run leaves no directory behind."""

import json
from types import SimpleNamespace

import pytest

from eval.eval_set import EvalPromptError
from eval.out_dir import OUT_DIR_MARKER, OutDirInUseError, claim_out_dir
from eval.prompts import run_eval_set

HEADS = SimpleNamespace(vocab_size=49152, config={"max_position_embeddings": 8192}, tokenizer=None)


def _prompt(pid: str, n: int) -> str:
    return json.dumps(
        dict(
            prompt_id=pid,
            bin=512,
            prompt_token_ids=[5] * n,
            num_tokens=n,
            source="mine",
            question="q",
            reference_answer=None,
            document_names=[],
        )  # fmt: skip
    )


def test_a_users_directory_is_refused_with_its_files_kept_and_nothing_created(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "eval_set.jsonl").write_text("my prompts\n")
    with pytest.raises(OutDirInUseError) as err:
        claim_out_dir(mine, key="eval.out_dir", stage="eval", earlier=("results.json", "parts"))
    assert str(err.value) == (
        f"eval.out_dir={mine}: holds eval_set.jsonl, which no earlier eval wrote (no {OUT_DIR_MARKER}); refusing to "
        "write into it: set eval.out_dir to a new or empty directory"
    )
    assert (mine / "eval_set.jsonl").read_text() == "my prompts\n" and sorted(mine.iterdir()) == [
        mine / "eval_set.jsonl"
    ]
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutDirInUseError, match="a file, expected a directory for the eval's output or nothing"):
        claim_out_dir(tmp_path / "file", key="eval.out_dir", stage="eval", earlier=())
    new = tmp_path / "new" / "eval"
    claim_out_dir(new, key="eval.out_dir", stage="eval", earlier=())
    assert not new.parent.exists()  # claimed, not created
    for earlier in (OUT_DIR_MARKER, "results.json"):  # marked, or an eval's from before markers
        d = tmp_path / f"earlier-{earlier}"
        d.mkdir()
        (d / earlier).write_text("{}")
        (d / "report.md").write_text("")
        claim_out_dir(d, key="eval.out_dir", stage="eval", earlier=("results.json", "parts"))


def test_a_rerun_on_an_earlier_evals_own_set_never_rewrites_it(tmp_path, compose_config):
    """Issue #48: prompts_file=OUT/eval_set.jsonl with out_dir=OUT rewrote it with only the prompts
    that fit the window: one prompt lost."""
    out = tmp_path / "out"
    out.mkdir()
    (out / OUT_DIR_MARKER).touch()
    given = out / "eval_set.jsonl"
    text = _prompt("fits", 100) + "\n" + _prompt("too-long", 9000) + "\n"
    given.write_text(text)
    cfg = compose_config(f"eval.prompts_file={given}", f"eval.out_dir={out}", "eval.max_new_tokens=16")
    prompts, used = run_eval_set(cfg, HEADS, out)
    assert [p.prompt_id for p in prompts] == ["fits"]
    assert given.read_text() == text  # the input as the user gave it
    assert used == out / "eval_set.used.jsonl"
    assert [json.loads(x)["prompt_id"] for x in used.read_text().splitlines()] == ["fits"]


def test_a_bad_prompts_file_leaves_no_directory_behind(tmp_path, compose_config):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt_id": "p0", "bin": }\n')
    out = tmp_path / "outputs" / "eval"
    cfg = compose_config(f"eval.prompts_file={bad}", f"eval.out_dir={out}")
    with pytest.raises(EvalPromptError, match="not valid JSON"):
        run_eval_set(cfg, HEADS, out)
    assert not (tmp_path / "outputs").exists()
    good = tmp_path / "good.jsonl"
    good.write_text(_prompt("p0", 10) + "\n")
    cfg = compose_config(f"eval.prompts_file={good}", f"eval.out_dir={out}", "eval.max_new_tokens=16")
    _, used = run_eval_set(cfg, HEADS, out)
    assert used == out / "eval_set.jsonl" and (out / OUT_DIR_MARKER).is_file()


def test_a_second_eval_on_a_held_output_is_refused_naming_the_first(tmp_path):
    """Issue #58 item 5: two evals on one out_dir at once both finished rc 0; the second replaced
    the first's export while the first was still reading it."""
    import os
    import subprocess
    import sys

    from dspark.core.locks import InUseError, holding

    out = tmp_path / "eval" / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time; from dspark.core.locks import holding\n"
            f"with holding({str(out)!r}, key='eval.out_dir', what='eval'):\n"
            "    print('held', flush=True); time.sleep(60)\n"
        )],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(InUseError) as err:
            with holding(out, key="eval.out_dir", what="eval"):
                pass
        assert str(err.value).startswith(f"eval.out_dir={out}: in use by another eval (host ")
        assert f"pid {holder.pid})" in str(err.value)
        assert not out.exists()  # held, not created
    finally:
        holder.kill()
        holder.wait()
    with holding(out, key="eval.out_dir", what="eval"):  # the holder died: its lock went with it
        assert os.getpid()
