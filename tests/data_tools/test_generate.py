"""data.engine=transformers: batched greedy answers from the target in this process, as token-id rows."""

import pytest
import torch

from data_tools.extract import Request
from data_tools.generate import TransformersAnswers, answer_of
from dspark.config import DataConfig, TargetConfig


def test_an_answer_ends_after_its_first_eos_or_at_its_limit():
    assert answer_of([5, 6, 2, 7, 2], [2], 10) == [5, 6, 2]  # the eos is kept, as vLLM's token_ids keep it
    assert answer_of([5, 6, 7, 8], [2, 9], 3) == [5, 6, 7]
    assert answer_of([5, 9, 2], [2, 9], 10) == [5, 9]  # any of the ids ends it


@pytest.fixture(scope="module")
def answers(tiny_target_and_shards) -> TransformersAnswers:
    target, _ = tiny_target_and_shards
    spec = TargetConfig(source="hf_dir", path=str(target), name="tiny", dtype="float32")
    return TransformersAnswers(target, spec, DataConfig(batch_size=4), device=torch.device("cpu"))


def test_batched_left_padded_answers_equal_one_at_a_time_and_keep_the_request_order(answers):
    g = torch.Generator().manual_seed(3)
    reqs = [
        Request(f"{i:08x}", torch.randint(100, 2000, (n,), generator=g).tolist(), None, limit)
        for i, (n, limit) in enumerate([(9, 12), (3, 5), (14, 12), (6, 1)])
    ]
    reqs.append(Request("given", [7, 8, 9], [10, 11], 1))  # a dataset's own answer is kept as it is
    batched = answers.rows(reqs)
    single = [answers.rows([r])[0] for r in reqs]
    assert [r["seq_id"] for r in batched] == [r.seq_id for r in reqs]
    assert batched == single
    for r, row in zip(reqs, batched):
        n_answer = row["num_tokens"] - len(r.prompt_ids)
        assert row["input_ids"][: len(r.prompt_ids)] == r.prompt_ids and row["hidden_states"] == b""
        assert row["loss_mask"] == [0] * len(r.prompt_ids) + [1] * n_answer
        assert 1 <= n_answer <= (r.max_new_tokens if r.answer_ids is None else len(r.answer_ids))
    assert batched[-1]["input_ids"] == [7, 8, 9, 10, 11]
    # greedy: the answer is the target's argmax continuation, token by token
    model = answers.model
    row = batched[0]
    with torch.no_grad():
        logits = model(torch.tensor([row["input_ids"]])).logits[0]
    n_prompt = len(reqs[0].prompt_ids)
    assert logits[n_prompt - 1 : -1].argmax(-1).tolist() == row["input_ids"][n_prompt:]
