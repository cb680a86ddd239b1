"""AA-LCR-style eval prompts: the release loader, the prompt layout, and sizing to the window."""

import csv
import itertools
import json
import logging
import re

import pytest
from transformers import AutoTokenizer

from data_tools.prompts import LCR_TRAIN_QUESTIONS, bundled_conversations, bundled_lcr_conversations
from dspark.core.prompt_format import format_lcr_prompt
from eval.eval_set import EvalPromptError, eval_set_sha256, load_eval_set, save_eval_set
from eval.prompt_bins import OFFLINE_QUESTIONS
from eval.prompt_documents import load_aa_lcr, offline_documents
from eval.prompts import build_eval_set, main

HEADER = [
    "",
    "document_category",
    "document_set_id",
    "question_id",
    "question",
    "answer",
    "data_source_filenames",
    "data_source_urls",
    "input_tokens",
]
TRICKY_QUESTION = 'Which clauses, if any, mention "notice"?\nAnswer per document, then compare.'
BINS = [256, 512, 1024]


def _text(tag: str, sentences: int) -> str:
    """A document of numbered sentences, so a cut shows where it happened."""
    return " ".join(f"{tag} clause {i}: the party shall give notice within {i} days." for i in range(sentences))


DOCS = {
    ("Legal", "legal_a", "alpha.txt"): _text("Alpha", 120),
    ("Legal", "legal_a", "beta, revised.txt"): _text("Beta", 100),
    ("Company_Documents", "co_b", "gamma.txt"): _text("Gamma", 150),
    ("Company_Documents", "co_b", "delta.txt"): _text("Delta", 30),
}
ROWS = [
    # ';'-separated as in the release, ',' and newlines accepted; names with or without .txt,
    # and a name may hold a comma
    [
        "0",
        "Legal",
        "legal_a",
        "1",
        TRICKY_QUESTION,
        "Both, with 30 days' notice.",
        "alpha;beta, revised.txt",
        "https://a.example/1;https://a.example/2",
        "95000",
    ],
    [
        "1",
        "Company_Documents",
        "co_b",
        "2",
        "Which company grew fastest?",
        "Gamma",
        "gamma.txt, delta",
        "https://b.example/1",
        "80000",
    ],
    ["2", "Legal", "legal_a", "3", "Who gives notice?", "The party", "beta, revised\nalpha", "", "40000"],
]


def _write_release(root, rows=ROWS, header=HEADER):
    """The release's layout: a CSV and lcr/<category>/<set_id>/<file>.txt."""
    for (category, set_id, name), text in DOCS.items():
        path = root / "lcr" / category / set_id / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    csv_path = root / "AA-LCR_Dataset.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return csv_path


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_loader_reads_questions_answers_and_documents(tmp_path):
    csv_path = _write_release(tmp_path)
    questions = load_aa_lcr(csv_path, tmp_path / "lcr")
    assert load_aa_lcr(csv_path, tmp_path) == questions  # the directory holding lcr/ works too
    assert [q.question_id for q in questions] == ["1", "2", "3"]
    q1, q2, q3 = questions
    assert q1.question == TRICKY_QUESTION
    assert (q1.answer, q2.answer) == ("Both, with 30 days' notice.", "Gamma")
    assert (q2.document_category, q2.document_set_id) == ("Company_Documents", "co_b")
    assert [d.name for d in q1.documents] == ["alpha", "beta, revised.txt"]
    assert [d.text for d in q1.documents] == [
        DOCS["Legal", "legal_a", "alpha.txt"],
        DOCS["Legal", "legal_a", "beta, revised.txt"],
    ]
    assert [d.name for d in q2.documents] == ["gamma.txt", "delta"]
    assert [d.name for d in q3.documents] == ["beta, revised", "alpha"]
    assert q3.documents[0].text == DOCS["Legal", "legal_a", "beta, revised.txt"]


def test_prompt_layout_follows_aa_lcr():
    text = format_lcr_prompt(["first doc", "second doc"], TRICKY_QUESTION)
    assert text == (
        "BEGIN INPUT DOCUMENTS\n\n"
        "BEGIN DOCUMENT 1:\nfirst doc\nEND DOCUMENT 1\n\n"
        "BEGIN DOCUMENT 2:\nsecond doc\nEND DOCUMENT 2\n\n"
        "END INPUT DOCUMENTS\n\n"
        "Answer the following question using the input documents provided above.\n\n"
        f"START QUESTION\n\n{TRICKY_QUESTION}\n\nEND QUESTION\n"
    )


def test_missing_column_is_named(tmp_path):
    header = [h if h != "data_source_filenames" else "files" for h in HEADER]
    csv_path = _write_release(tmp_path, header=header)
    missing = r"AA-LCR_Dataset.csv: missing column\(s\) \['data_source_filenames'\]"
    with pytest.raises(EvalPromptError, match=missing):
        load_aa_lcr(csv_path, tmp_path)


def test_missing_document_names_file_row_field_and_path(tmp_path):
    rows = [ROWS[0], [*ROWS[1][:6], "gamma.txt;nope", *ROWS[1][7:]]]
    csv_path = _write_release(tmp_path, rows=rows)
    # row 1 spans lines 2-3 (its question holds a newline), so row 2 starts on line 4
    with pytest.raises(EvalPromptError) as err:
        load_aa_lcr(csv_path, tmp_path)
    message = str(err.value)
    assert f"{csv_path}:4 (question_id '2'): field 'data_source_filenames' names 'nope'" in message
    assert str(tmp_path / "lcr" / "Company_Documents" / "co_b" / "nope.txt") in message


def test_empty_question_is_named(tmp_path):
    csv_path = _write_release(tmp_path, rows=[[*ROWS[1][:4], "  ", *ROWS[1][5:]]])
    empty = r"AA-LCR_Dataset.csv:2 \(question_id '2'\): field 'question' is empty"
    with pytest.raises(EvalPromptError, match=empty):
        load_aa_lcr(csv_path, tmp_path)


def _check_bins(prompts, bins, per_bin):
    assert [p.bin for p in prompts] == [b for b in bins for _ in range(per_bin)]
    previous = 0
    for b in bins:
        for p in (p for p in prompts if p.bin == b):
            assert p.num_tokens == len(p.prompt_token_ids)
            assert max(previous, 0.75 * b) < p.num_tokens <= b, (p.prompt_id, p.num_tokens)
        previous = b


def test_offline_bins_fit_the_window(tokenizer):
    prompts = build_eval_set(tokenizer, context_bins=BINS, prompts_per_bin=2, max_new_tokens=64, window=1024 + 64)
    _check_bins(prompts, BINS, per_bin=2)
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    for p in prompts:
        assert p.source == "offline" and p.reference_answer is None
        assert len(p.document_names) >= 3  # the question reads across documents
        text = tokenizer.decode(p.prompt_token_ids)
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
        assert f"START QUESTION\n\n{p.question}\n\nEND QUESTION" in text
        assert f"END DOCUMENT {len(p.document_names)}\n\nEND INPUT DOCUMENTS" in text


def test_bin_past_the_window_is_refused(tokenizer):
    refused = r"context bin 1024 \+ max_new_tokens 64 = 1088 exceeds the target's window 1087"
    with pytest.raises(EvalPromptError, match=refused):
        build_eval_set(tokenizer, context_bins=BINS, prompts_per_bin=1, max_new_tokens=64, window=1087)


def test_offline_set_is_deterministic_and_disjoint_from_training(tokenizer):
    def build(seed):
        return build_eval_set(
            tokenizer, context_bins=[512, 1024], prompts_per_bin=2, max_new_tokens=64, window=2048, seed=seed
        )

    assert eval_set_sha256(build(0)) == eval_set_sha256(build(0))
    assert eval_set_sha256(build(0)) != eval_set_sha256(build(1))
    training = [turn for conv in bundled_conversations() for _, turn in conv.messages]
    documents = offline_documents()
    assert len(documents) > 100
    joined = "\n".join(training)
    assert not [d.name for d in documents if d.text.strip()[:200] in joined]
    # Reworded or re-wrapped copies too: no training prompt shares more than 10% of its
    # 8-word runs with the pool (pdb's docstring vs the "debugger" topic: 19%; a docstring
    # line urllib shares with a top-level module: 8%; the top-level sources: >50% for half).
    pool = set().union(*(_shingles(d.text) for d in documents))
    copied = [t[:80] for t in training if len(_shingles(t) & pool) > 0.1 * len(_shingles(t))]
    assert not copied
    # The long-context training prompts: other questions, other documents.
    assert not set(LCR_TRAIN_QUESTIONS) & set(OFFLINE_QUESTIONS)
    long_docs = {
        doc
        for conv in itertools.islice(bundled_lcr_conversations(), 300)
        for doc in re.findall(r"BEGIN DOCUMENT \d+:\n(.*?)\nEND DOCUMENT", conv.messages[0][1], re.S)
    }
    assert len(long_docs) > 500
    copied = [d[:80] for d in long_docs if len(_shingles(d) & pool) > 0.1 * max(len(_shingles(d)), 1)]
    assert not copied


def _contains(ids, part):
    n = len(part)
    return any(ids[i : i + n] == part for i in range(len(ids) - n + 1))


def test_the_fixed_passage_set_holds_question_and_passage_fixed_and_adds_distractors(tokenizer):
    """Length without content (issue #47): prompt i of every bin asks the same question about the
    same passage, in the same place (first, middle, last by i), and a larger bin only adds more of
    the same distractors in the same order."""
    bins = [768, 1536, 3072]
    prompts = build_eval_set(
        tokenizer, context_bins=bins, prompts_per_bin=3, max_new_tokens=64, window=4096, source="fixed_passage"
    )
    assert [p.bin for p in prompts] == [768] * 3 + [1536] * 3 + [3072] * 3
    lowers = {768: 576, 1536: 1152, 3072: 2304}
    assert all(lowers[p.bin] <= p.num_tokens <= p.bin for p in prompts)
    assert not set(LCR_TRAIN_QUESTIONS) & {p.question for p in prompts}
    by_index = {i: [p for p in prompts if p.prompt_id.endswith(f"-{i}")] for i in range(3)}
    for i, group in by_index.items():
        assert [p.prompt_id for p in group] == [f"fixed-s0-b{b}-{i}" for b in bins]
        assert len({p.question for p in group}) == 1
        topic = next(
            n
            for n in group[0].document_names
            if n.startswith("pydoc_data.topics:") and n.split(":")[1] in group[0].question
        )
        from eval.prompt_bins import PASSAGE_TOKENS
        from eval.prompt_documents import offline_documents

        text = next(d.text for d in offline_documents() if d.name == topic)
        passage = tokenizer.encode(tokenizer.decode(tokenizer.encode(text)[:PASSAGE_TOKENS]), add_special_tokens=False)
        core = passage[5:-5]  # away from the joins, where the tokenizer may merge across the boundary
        assert all(_contains(p.prompt_token_ids, core) for p in group)
        places = [p.document_names.index(topic) for p in group]
        counts = [len(p.document_names) for p in group]
        want = {0: [0, 0, 0], 1: [(c - 1) // 2 for c in counts], 2: [c - 1 for c in counts]}[i]
        assert places == want, (i, places, counts)
        distractors = [[n for n in p.document_names if n != topic] for p in group]
        assert all(small == big[: len(small)] for small, big in zip(distractors, distractors[1:]))
        assert counts == sorted(counts) and counts[-1] > counts[0]
    again = build_eval_set(
        tokenizer, context_bins=bins, prompts_per_bin=3, max_new_tokens=64, window=4096, source="fixed_passage"
    )
    assert eval_set_sha256(again) == eval_set_sha256(prompts)


def _shingles(text, n=8):
    words = text.split()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_aa_lcr_cuts_documents_but_not_the_question(tmp_path, tokenizer):
    csv_path = _write_release(tmp_path)
    prompts = build_eval_set(
        tokenizer,
        context_bins=[256, 512],
        prompts_per_bin=2,
        max_new_tokens=64,
        window=1024,
        source="aa_lcr",
        aa_lcr_csv=csv_path,
        aa_lcr_texts=tmp_path,
    )
    _check_bins(prompts, [256, 512], per_bin=2)
    questions = {q.question_id: q for q in load_aa_lcr(csv_path, tmp_path)}
    for p in prompts:
        q = questions[p.prompt_id.split("-")[1]]
        assert (p.source, p.question, p.reference_answer) == ("aa_lcr", q.question, q.answer)
        assert p.document_names == [d.name for d in q.documents]
        text = tokenizer.decode(p.prompt_token_ids)
        assert f"START QUESTION\n\n{q.question}\n\nEND QUESTION" in text
        for i, doc in enumerate(q.documents, 1):
            block = text.split(f"BEGIN DOCUMENT {i}:\n")[1].split(f"\nEND DOCUMENT {i}")[0]
            assert 0 < len(block) < len(doc.text) and doc.text.startswith(block)


def test_save_load_round_trip_and_bad_line(tmp_path, tokenizer):
    prompts = build_eval_set(tokenizer, context_bins=[512], prompts_per_bin=2, max_new_tokens=64, window=1024)
    path = tmp_path / "eval" / "prompts.jsonl"
    save_eval_set(prompts, path)
    assert load_eval_set(path) == prompts
    record = json.loads(path.read_text().splitlines()[1])
    record["num_tokens"] += 1
    path.write_text(path.read_text().splitlines()[0] + "\n" + json.dumps(record) + "\n")
    bad = re.escape(f"{path}:2: prompt 'offline-s0-b512-1': num_tokens is")
    with pytest.raises(EvalPromptError, match=bad):
        load_eval_set(path)


def _one_prompt(**change) -> dict:
    rec = dict(
        prompt_id="p0", bin=512, prompt_token_ids=[1, 2, 3], num_tokens=3, source="mine", question="q",
        reference_answer=None, document_names=[],
    )  # fmt: skip
    return {**rec, **change}


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"eval.prompts_file=.*missing.jsonl: no such file"),
        (b"", r"eval.prompts_file=.*: no prompts in it"),
        (b"\n\n", r"eval.prompts_file=.*: no prompts in it"),
        (b"\xff\xfe{}\n", r"eval.prompts_file=.*: not UTF-8 text \(invalid start byte at byte 0\)"),
        (
            json.dumps(_one_prompt(prompt_token_ids=[1, 999999, 3], num_tokens=3)).encode(),
            r":1: field 'prompt_token_ids'\[1\] is 999999, expected a token id in \[0, 49152\)",
        ),
        (
            json.dumps(_one_prompt(prompt_token_ids=["1", "2"], num_tokens=2)).encode(),
            r":1: field 'prompt_token_ids'\[0\] is '1', expected a token id",
        ),
        (json.dumps(_one_prompt(bin="512")).encode(), r":1: field 'bin' is '512', expected int"),
        (json.dumps(_one_prompt(num_tokens=True)).encode(), r":1: field 'num_tokens' is True, expected int"),
        (json.dumps(_one_prompt(prompt_token_ids=[], num_tokens=0)).encode(), r":1: field 'prompt_token_ids' is empty"),
        (b'{"prompt_id": "p0", "bin": }\n', r":1: not valid JSON \(Expecting value at column 28\)"),
    ],
    ids=["missing", "empty", "blank", "not-utf8", "out-of-vocab", "string-ids", "bin-type", "bool", "no-ids", "json"],
)
def test_a_prompts_file_is_checked_line_by_line_with_one_clear_error(tmp_path, content, message):
    path = tmp_path / ("missing.jsonl" if content is None else "p.jsonl")
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(EvalPromptError, match=message):
        load_eval_set(path, vocab_size=49152, window=8192, max_new_tokens=128)


def test_prompts_over_the_window_are_left_out_and_counted(tmp_path, caplog):
    path = tmp_path / "p.jsonl"
    long = _one_prompt(prompt_id="long", prompt_token_ids=[5] * 9000, num_tokens=9000)
    path.write_text(json.dumps(_one_prompt()) + "\n" + json.dumps(long) + "\n")
    with caplog.at_level(logging.WARNING, logger="eval.eval_set"):
        got = load_eval_set(path, vocab_size=49152, window=8192, max_new_tokens=128)
    assert [p.prompt_id for p in got] == ["p0"]
    assert "1 of 2 prompts left out" in caplog.text and "window of 8192 (the longest has 9000 tokens)" in caplog.text
    path.write_text(json.dumps(long) + "\n")
    with pytest.raises(EvalPromptError, match=r"every prompt's tokens \+ eval.max_new_tokens=128 exceed"):
        load_eval_set(path, vocab_size=49152, window=8192, max_new_tokens=128)


def test_cli_prints_a_table_per_bin(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "set.jsonl"
    main(["--tokenizer", str(smollm2_dir), "--bins", "256", "512", "--per-bin", "1", "--out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["bin", "prompts", "min", "mean", "max", "docs"]
    assert [line.split()[:2] for line in lines[1:3]] == [["256", "1"], ["512", "1"]]
    assert lines[3] == f"sha256 {eval_set_sha256(load_eval_set(out))}"
