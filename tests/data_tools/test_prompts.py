"""Prompt sources, dedupe/split and fitting prompts to the window."""

import json

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
from dspark.core.config import DataConfig

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


def test_missing_file(tmp_path):
    with pytest.raises(PromptFileError, match=r"nope.jsonl: missing file"):
        list(load_source(str(tmp_path / "nope.jsonl")))


def test_parquet_and_saved_dataset_sources(tmp_path):
    import datasets

    pq.write_table(pa.Table.from_pylist([OPENAI, OPENAI]), tmp_path / "p.parquet")
    assert [c.messages for c in load_source(str(tmp_path / "p.parquet"))] == [
        (("system", "be brief"), ("user", "hi"), ("assistant", "hello"))
    ] * 2
    datasets.Dataset.from_list([SHAREGPT]).save_to_disk(str(tmp_path / "ds"))
    assert [c.messages for c in load_source(str(tmp_path / "ds"))] == [(("user", "hi"), ("assistant", "hello"))]


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
