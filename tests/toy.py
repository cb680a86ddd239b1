"""Shared test data builders (import as ``from tests.toy import ...``)."""

from __future__ import annotations

import sys
from typing import Any

from dspark.core.shard_format import Manifest, scale_granularity_of


def toy_manifest(**fields: Any) -> Manifest:
    """A dataset manifest for a made-up 4-layer Llama target (layers [1, 4], hidden 8, fp32),
    with ``fields`` replaced; the fp8 scale layout follows ``dtype`` unless given."""
    base: dict[str, Any] = dict(
        target="toy",
        target_path="/x",
        revision=None,
        architecture="LlamaForCausalLM",
        tokenizer_sha256="t",
        chat_template_sha256="c",
        layer_ids=[1, 4],
        num_hidden_layers=4,
        hidden_size=8,
        dtype="float32",
        compression="zstd",
    )
    base.update(fields)
    base.setdefault("scale_granularity", scale_granularity_of(base["dtype"]))
    return Manifest(**base)


SHORT_QUESTIONS = [
    "Name three uses of a hash table.",
    "What does the Python keyword 'yield' do?",
    "Write one sentence about the sea.",
    "Explain recursion to a child.",
    "What is the capital of France?",
    "Give an example of a list comprehension.",
]
"""Six short chat prompts the embedded target answers quickly: the real-vLLM tests' common start
(each appends what it needs: a too-long prompt, a duplicate, more questions)."""


def torchrun(script: str, *args: str, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` with ``args`` on ``nproc`` local ranks,
    at a free rendezvous port."""
    from dspark.core.files import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        script,
        *args,
    ]
