"""Prompt sources, dedupe/split and fitting prompts to the window."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_tools.prompts import (
    LCR_TRAIN_QUESTIONS,
    Conversation,
    PromptFileError,
    bundled_conversations,
    bundled_lcr_conversations,
    dedupe_and_split,
    load_source,
)
from dspark.config import DataConfig

OPENAI = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
}
SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}


def _jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_openai_and_sharegpt_are_read_alike(tmp_path):
    convs = list(load_source(str(_jsonl(tmp_path / "p.jsonl", [OPENAI, SHAREGPT]))))
    assert convs[0].messages == (("system", "be brief"), ("user", "hi"), ("assistant", "hello"))
    assert convs[1].messages == (("user", "hi"), ("assistant", "hello"))
    assert convs[1].prompt_and_answer(regenerate=True) == ([{"role": "user", "content": "hi"}], None)
    assert convs[1].prompt_and_answer(regenerate=False) == ([{"role": "user", "content": "hi"}], "hello")


def test_malformed_line_is_named(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [OPENAI, SHAREGPT, '{"messages": [', OPENAI])
    with pytest.raises(PromptFileError, match=rf"{path}:3: not valid JSON"):
        list(load_source(str(path)))


@pytest.mark.parametrize(
    "record, message",
    [
        ({"text": "x"}, r"p.jsonl:1: expected a field 'messages' \(OpenAI\) or 'conversations' \(ShareGPT\)"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"p.jsonl:1: turn 0 field 'role' is 'robot'"),
        ({"conversations": [{"from": "human"}]}, r"p.jsonl:1: turn 0 must be an object with 'from' and 'value'"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, r"p.jsonl:1: no user turn"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, record, message):
    with pytest.raises(PromptFileError, match=message):
        list(load_source(str(_jsonl(tmp_path / "p.jsonl", [record]))))


@pytest.fixture
def no_hub(monkeypatch):
    """datasets.load_dataset replaced: a test fails if anything reaches for the Hub."""
    import datasets

    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return [OPENAI]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


ACCEPTED = (
    r"one of: 'bundled' \| 'bundled_lcr' \| 'bundled_lcr_short' \| 'bundled_lcr_long' \| "
    r"a \.jsonl/\.json chat file .* \| a \.txt file \(one prompt per "
    r"line, blank lines skipped\) \| a directory written by datasets' save_to_disk \| a Hugging Face Hub dataset name"
)


@pytest.mark.parametrize("name", ["nope.jsonl", "prompts.txt", "./prompts", "~/nope", "x.csv", "a/b/c", "data/prompts"])
def test_a_missing_local_looking_source_is_an_error_not_a_hub_lookup(tmp_path, monkeypatch, no_hub, name):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data").mkdir()  # so data/prompts is a path here, not a Hub name
    with pytest.raises(PromptFileError) as err:
        load_source(name)  # fails when called, before any work starts
    assert str(err.value).startswith(f"data.source={name!r}: no such file or directory ({tmp_path}/")
    assert re.search("expected " + ACCEPTED, str(err.value))
    assert no_hub == []


def test_hub_names_go_to_the_hub(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    for name in ("org/name", "teknium/OpenHermes-2.5", "squad"):  # no local org/ directory here
        assert [c.messages[1] for c in load_source(name, split="test")] == [("user", "hi")]
    assert no_hub == [("org/name", "test"), ("teknium/OpenHermes-2.5", "test"), ("squad", "test")]
    (tmp_path / "org").mkdir()
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([SHAREGPT]).save_to_disk(str(tmp_path / "org" / "name"))
    assert [c.messages for c in load_source("org/name")] == [(("user", "hi"), ("assistant", "hello"))]
    assert len(no_hub) == 3  # a local directory of that name wins over the Hub


def test_a_hub_failure_names_the_source_and_the_accepted_forms(monkeypatch):
    import datasets

    def offline(name, split):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        PromptFileError,
        match=r"data.source='org/missing': no such local file or directory, and the Hub dataset 'org/missing' could "
        r"not be loaded \(ConnectionError: Couldn't reach the Hub\); expected " + ACCEPTED,
    ):
        load_source("org/missing")


def test_plain_text_one_prompt_per_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("What is a monad?\n\n   \n  Explain RoPE briefly.  \nlast line without newline", encoding="utf-8")
    assert [c.messages for c in load_source(str(path))] == [
        (("user", "What is a monad?"),),
        (("user", "Explain RoPE briefly."),),
        (("user", "last line without newline"),),
    ]
    path.write_bytes(b"ok\n\xff\xfe bad\n")
    with pytest.raises(
        PromptFileError, match=r"prompts.txt: not UTF-8 text \(invalid start byte\), expected one prompt"
    ):
        list(load_source(str(path)))


def test_unsupported_files_and_directories_list_the_accepted_forms(tmp_path, no_hub):
    (tmp_path / "prompts.csv").write_text("a,b\n")
    with pytest.raises(
        PromptFileError, match=r"prompts.csv: unsupported file type '.csv'; data.source expects " + ACCEPTED
    ):
        load_source(str(tmp_path / "prompts.csv"))
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(
        PromptFileError,
        match=r"plain_dir: a directory without state.json or dataset_dict.json, not one written by datasets' "
        r"save_to_disk; data.source expects one of: 'bundled'",
    ):
        load_source(str(tmp_path / "plain_dir"))
    assert no_hub == []


def test_parquet_and_saved_dataset_sources(tmp_path):
    import datasets

    pq.write_table(pa.Table.from_pylist([OPENAI, OPENAI]), tmp_path / "p.parquet")
    assert [c.messages for c in load_source(str(tmp_path / "p.parquet"))] == [
        (("system", "be brief"), ("user", "hi"), ("assistant", "hello"))
    ] * 2
    datasets.Dataset.from_list([SHAREGPT]).save_to_disk(str(tmp_path / "ds"))
    assert [c.messages for c in load_source(str(tmp_path / "ds"))] == [(("user", "hi"), ("assistant", "hello"))]
    datasets.DatasetDict({"train": datasets.Dataset.from_list([OPENAI])}).save_to_disk(str(tmp_path / "dd"))
    assert len(list(load_source(str(tmp_path / "dd")))) == 1
    with pytest.raises(PromptFileError, match=r"dd: data.hf_split='test' is not among the saved splits \['train'\]"):
        load_source(str(tmp_path / "dd"), split="test")


def test_dedupe_and_split_is_deterministic_and_order_free():
    convs = [Conversation((("user", f"question {i}"),)) for i in range(400)]
    a = dedupe_and_split(convs + convs[:50], val_fraction=0.1)
    b = dedupe_and_split(list(reversed(convs)), val_fraction=0.1)
    assert len(a["train"]) + len(a["val"]) == 400  # duplicates dropped
    assert {c.seq_id for c in a["val"]} == {c.seq_id for c in b["val"]}
    assert 15 <= len(a["val"]) <= 70  # ~10% by hash
    assert not {c.seq_id for c in a["val"]} & {c.seq_id for c in a["train"]}


def test_bundled_default_is_offline_and_varied():
    convs = dedupe_and_split(bundled_conversations(), val_fraction=0.05)
    texts = [c.messages[0][1] for c in convs["train"] + convs["val"]]
    assert len(texts) >= 200
    kinds = {t.split("\n")[0][:25] for t in texts}
    assert len(kinds) >= 8  # several task templates
    assert any("```python" in t for t in texts) and any("package" in t for t in texts)
    assert not any("dspark-train" in t for t in texts)  # our own README would change the set every commit


def test_bundled_lcr_is_long_multi_document_and_seeded():
    import itertools
    import re

    first = list(itertools.islice(load_source("bundled_lcr"), 200))
    assert [c.seq_id for c in first] == [c.seq_id for c in itertools.islice(bundled_lcr_conversations(), 200)]
    assert [c.seq_id for c in first] != [c.seq_id for c in itertools.islice(bundled_lcr_conversations(seed=1), 200)]
    for conv in first:
        ((role, text),) = conv.messages
        assert role == "user" and text.startswith("BEGIN INPUT DOCUMENTS")
        docs = re.findall(r"BEGIN DOCUMENT (\d+):\n(.*?)\nEND DOCUMENT \1", text, re.S)
        assert 2 <= len(docs) <= 4 and [int(n) for n, _ in docs] == list(range(1, len(docs) + 1))
        assert all(d.strip() for _, d in docs)
        assert sum(len(d) for _, d in docs) <= 6500
        assert text.split("START QUESTION\n\n")[1].split("\n\nEND QUESTION")[0] in LCR_TRAIN_QUESTIONS
    sizes = sorted(len(c.messages[0][1]) for c in first)
    assert sizes[20] > 1500 and sizes[-20] > 5000  # spread over the range, not all short
    kept = dedupe_and_split(first, val_fraction=0.05)
    assert len(kept["train"]) + len(kept["val"]) >= 195


@pytest.mark.parametrize(
    "source, lo, hi",
    [("bundled_lcr_short", 550, 1200), ("bundled_lcr_long", 900, 8500)],
)
@pytest.mark.slow  # a subprocess or several: 4-6 s, kept out of the 5-minute fast tier
def test_named_lcr_sources_yield_as_many_as_asked_in_their_range_never_the_evals_documents(smollm2_dir, source, lo, hi):
    import itertools

    from transformers import AutoTokenizer

    from eval.prompt_documents import offline_documents

    asked = 6000  # more than the 4,096 the source once stopped at
    got = dedupe_and_split(load_source(source), val_fraction=0.05, limit=asked)
    assert len(got["train"]) + len(got["val"]) == asked
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    sample = list(itertools.islice(load_source(source), 100))
    lengths = sorted(len(tok(c.messages[0][1]).input_ids) for c in sample)
    assert lengths[5] >= lo and lengths[-5] <= hi, lengths  # the 5th from either end: a few outliers
    if source == "bundled_lcr_long":  # spread over the range, not bunched at its low end
        assert lengths[50] > 3000 and lengths[-5] > 6000, lengths
    # the documents come from the training side of the pool (tests/eval/test_prompts.py checks that
    # pool against the eval's by 8-word runs): no eval document's opening is in a prompt
    heads = [d.text.strip()[:200] for d in offline_documents()]
    assert not [c.seq_id for c in sample if any(h in c.messages[0][1] for h in heads)]


def test_overlong_prompts_are_skipped_or_truncated(smollm2_dir):
    from transformers import AutoTokenizer

    from data_tools.extract import plan_requests

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    convs = [Conversation((("user", "short question"),)), Conversation((("user", "word " * 400),))]
    data = DataConfig(max_seq_len=128, max_new_tokens=32, regenerate=True, on_overlong="skip")
    reqs, skipped = plan_requests(convs, tok, data)
    assert [r.seq_id for r in reqs] == [convs[0].seq_id] and skipped == {"prompt longer than window": 1}
    assert reqs[0].max_new_tokens == 32
    data.on_overlong = "truncate"
    reqs, skipped = plan_requests(convs, tok, data)
    assert len(reqs) == 2 and not skipped
    long = reqs[1]
    assert len(long.prompt_ids) + long.max_new_tokens <= 128 and long.max_new_tokens == 32
    # the end of the prompt (generation prompt) survives truncation
    assert tok.decode(long.prompt_ids).endswith("<|im_start|>assistant\n")


@pytest.mark.slow  # a subprocess or several: 4-6 s, kept out of the 5-minute fast tier
def test_bundled_prompts_ignore_packages_put_on_sys_path_at_run_time(tmp_path, monkeypatch):
    """wandb puts its vendored packages on sys.path when it starts; the prompt set must not change
    mid-process (a multirun's second job refused the dataset its first job extracted)."""
    from data_tools.prompts import bundled_conversations

    before = [c.seq_id for c in bundled_conversations()]
    dist = tmp_path / "vendored_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vendored-pkg\nVersion: 1.0\nSummary: " + "a vendored package " * 20 + "\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [c.seq_id for c in bundled_conversations()] == before


@pytest.mark.slow  # among the fast tier's longest: the full suite runs it, the fast tier stays under 5 min
def test_extraction_refuses_a_missing_prompt_file_in_one_line_with_exit_status_2(tmp_path, smollm2_dir):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_tools.extract",
            f"data.source={tmp_path / 'missing.txt'}",
            f"paths.output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "DSPARK_DEBUG")},
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines()[-1].startswith(
        f"error: data.source='{tmp_path / 'missing.txt'}': no such file or directory ({tmp_path / 'missing.txt'}); "
        "expected one of: 'bundled' | 'bundled_lcr' |"
    )
    assert "Traceback" not in out.stderr and not (tmp_path / "data").exists()
