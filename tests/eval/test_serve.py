"""`python -m eval.serve` refuses wrong paths with rc 2 and one `error:` line before vLLM starts
(serving itself is tested in test_vllm_parity.py)."""

from pathlib import Path

import pytest

from eval.serve import main


def model_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def serve_args(target: Path, prompts: Path, *extra: str) -> list[str]:
    return ["--target", str(target), "--prompts", str(prompts), "--gamma", "4", "--max-model-len", "512", *extra]


def exit_and_error(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


def test_help_shows_out_as_required(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert "(--out OUT | --headless)" in " ".join(usage.split())  # no [ ]: one of them is required
    code, err = exit_and_error(capsys, serve_args(Path("t"), Path("p"), "--method", "ngram"))
    assert code == 2 and "error: one of the arguments --out --headless is required" in err


def test_wrong_paths_are_named_before_vllm_starts(tmp_path, capsys):
    target, draft = model_dir(tmp_path / "target"), model_dir(tmp_path / "export")
    prompts, out = tmp_path / "eval_set.jsonl", str(tmp_path / "x.json")
    cases = [
        (
            serve_args(tmp_path / "nope", prompts, "--method", "ngram", "--out", out),
            f"error: --target {tmp_path / 'nope'}: no config.json there, expected the target's model directory\n",
        ),
        (
            serve_args(target, prompts, "--method", "dspark", "--out", out),
            "error: --method dspark needs --draft, an export directory (python -m dspark.export export CKPT --out "
            "DIR)\n",
        ),
        (
            serve_args(target, prompts, "--method", "dflash", "--draft", str(tmp_path / "e2"), "--out", out),
            f"error: --draft {tmp_path / 'e2'}: no config.json there, expected an export directory; python -m "
            f"dspark.export export CHECKPOINT --out {tmp_path / 'e2'}\n",
        ),
        (
            serve_args(target, prompts, "--method", "dspark", "--draft", str(draft), "--out", out),
            f"error: --prompts {prompts}: missing file, expected an eval set JSONL; python -m eval.prompts "
            f"--tokenizer {target} --out {prompts}\n",
        ),
    ]
    for argv, message in cases:
        assert exit_and_error(capsys, argv) == (2, message)
    prompts.write_text("")
    assert exit_and_error(capsys, serve_args(target, prompts, "--method", "ngram", "--out", out)) == (
        2,
        f"error: --prompts {prompts}: no prompts in it, expected one JSON object per line\n",
    )
    prompts.write_text('{"prompt_id": "a"}\n')
    code, err = exit_and_error(capsys, serve_args(target, prompts, "--method", "ngram", "--out", out))
    assert code == 2 and err.startswith(f"error: --prompts {prompts}:1: expected an object with fields [")
    assert not Path(out).exists()
