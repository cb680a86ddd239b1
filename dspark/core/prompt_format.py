"""The AA-LCR prompt format, shared by the training prompts (``data_tools.prompts``) and the
eval set (``eval.prompts``), so both stages ask in the same words."""

from __future__ import annotations

from typing import Sequence


def format_lcr_prompt(documents: Sequence[str], question: str) -> str:
    """The AA-LCR user message: the documents in order, then the question."""
    blocks = "\n\n".join(f"BEGIN DOCUMENT {i}:\n{text}\nEND DOCUMENT {i}" for i, text in enumerate(documents, 1))
    return (
        f"BEGIN INPUT DOCUMENTS\n\n{blocks}\n\nEND INPUT DOCUMENTS\n\n"
        "Answer the following question using the input documents provided above.\n\n"
        f"START QUESTION\n\n{question}\n\nEND QUESTION\n"
    )
