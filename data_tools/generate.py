"""On-policy answers from the target in transformers (``data.engine=transformers``): token-id
shards for ``data.mode=colocated``, without vLLM.

The extract stage plans the same requests for either engine (chat template, window, overlong
rule: :func:`data_tools.extract.plan_requests`); this engine answers them with batched
``generate`` on the local device (the GPU when there is one) and writes rows of ids and loss mask
only: the manifest's ``layer_ids`` is ``[]`` and ``hidden_states`` is empty, so the rows cost
bytes per token, not kilobytes, and travel where states cannot (a device call carries 64 MiB).

Stop rules are vLLM's: an answer ends after the first of the target's end-of-sequence ids (the
generation config's and the tokenizer's; the id is kept in the answer, as vLLM's ``token_ids``
keep it) or at the request's ``max_new_tokens`` (``data.max_new_tokens``, cut to the window).
Greedy by default (``data.temperature=0``); sampled answers are seeded by ``data.seed`` and the
batch's first sequence id. A batch is left-padded with an attention mask, its sequences sorted by
prompt length so that little of it is padding; rows come back in request order.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from dspark.config import TORCH_DTYPES, DataConfig, TargetConfig

log = logging.getLogger(__name__)


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends an answer: the generation config's ``eos_token_id`` (an id or a list)
    and the tokenizer's, as vLLM stops on both."""
    ids: list[int] = []
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def answer_of(generated: list[int], eos: list[int], limit: int) -> list[int]:
    """The answer in one generated continuation: up to and including the first end-of-sequence id,
    at most ``limit`` tokens (what follows in a batch is padding)."""
    out = generated[:limit]
    for k, t in enumerate(out):
        if t in eos:
            return out[: k + 1]
    return out


class TransformersAnswers:
    """The target in this process, answering planned requests in batches (token-id rows)."""

    def __init__(
        self, target_dir: Path, target: TargetConfig, data: DataConfig, *, device: Optional[torch.device] = None
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = TORCH_DTYPES[target.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            str(target_dir), dtype=self.dtype, trust_remote_code=target.trust_remote_code
        )
        self.model = self.model.to(self.device).eval().requires_grad_(False)
        tok = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=target.trust_remote_code)
        self.eos = eos_ids(self.model, tok)
        if not self.eos:
            raise ValueError(f"{target_dir}: no eos_token_id in generation_config.json or the tokenizer")
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos[0]
        self.data = data
        log.info("transformers engine: %s on %s (%s), stops on ids %s", target_dir, self.device, self.dtype, self.eos)

    @torch.no_grad()
    def rows(self, requests: list) -> list[dict[str, Any]]:  # list[data_tools.extract.Request]
        """Shard rows (no states) for ``requests``, in their order; given answers are kept as they are."""
        answers: dict[int, list[int]] = {}
        todo = [i for i, r in enumerate(requests) if r.answer_ids is None]
        todo.sort(key=lambda i: len(requests[i].prompt_ids))
        if todo:
            answers = self._generate([requests[i] for i in todo])
            answers = {todo[k]: a for k, a in answers.items()}
        rows = []
        for i, r in enumerate(requests):
            answer = r.answer_ids if r.answer_ids is not None else answers[i]
            ids = r.prompt_ids + answer
            rows.append(
                {
                    "seq_id": r.seq_id,
                    "num_tokens": len(ids),
                    "input_ids": ids,
                    "loss_mask": [0] * len(r.prompt_ids) + [1] * len(answer),
                    "hidden_states": b"",
                }
            )
        return rows

    def _generate(self, requests: list) -> dict[int, list[int]]:
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad, dtype=torch.long)
        mask = torch.zeros(len(requests), width, dtype=torch.long)
        for i, r in enumerate(requests):  # left padding: every prompt ends where generation starts
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        sample = self.data.temperature > 0
        if sample:
            torch.manual_seed(self.data.seed + int(requests[0].seq_id[:8], 16))
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=max(r.max_new_tokens for r in requests),
            do_sample=sample,
            temperature=self.data.temperature if sample else None,
            top_p=None,
            top_k=None,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        new = out[:, width:].tolist()
        return {i: answer_of(new[i], self.eos, r.max_new_tokens) for i, r in enumerate(requests)}

    def close(self) -> None:
        del self.model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
