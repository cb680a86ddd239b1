"""The storage bill of an extraction, shown before it starts (the shards of a large target fill
disks before training begins: 86 KB per token for Kimi K3 in bf16).

    python -m data_tools.storage +experiment=kimi_k3_gb300 [--prompt-tokens 8192]

The extract stage logs the same line from the sampled prompt set; this command needs neither
vLLM, the target nor the prompts: the layout comes from the config (``target.layer_ids`` plus
the final state, ``target.hidden_size``, ``data.store_dtype``) and each sequence is taken as
``--prompt-tokens`` + ``data.max_new_tokens`` (capped at ``data.max_seq_len``), or as the full
window when the prompt length is not given (an upper bound).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dspark.formats.shard_format import bytes_per_token

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StorageEstimate:
    """Raw bytes before Parquet compression (zstd takes little off fp activations)."""

    bytes_per_token: int
    tokens_per_prompt: float
    num_prompts: int

    @property
    def bytes_per_1k_prompts(self) -> float:
        return self.bytes_per_token * self.tokens_per_prompt * 1000

    @property
    def total_bytes(self) -> float:
        return self.bytes_per_token * self.tokens_per_prompt * self.num_prompts

    def line(self) -> str:
        return (
            f"storage estimate: {self.bytes_per_token} bytes/token, about {self.bytes_per_1k_prompts / 1e9:.1f} GB "
            f"per 1k prompts, about {self.total_bytes / 1e12:.2f} TB for this run's {self.num_prompts} prompts "
            f"(~{self.tokens_per_prompt:.0f} tokens per sequence)"
        )


def sequence_tokens(prompt_tokens: float, answer_tokens: Optional[float], *, max_new_tokens: int, window: int) -> float:
    """Tokens one sequence stores: the prompt plus its given answer, or plus ``max_new_tokens``
    when the target writes it (an upper bound: answers may stop early), within the window."""
    return min(prompt_tokens + (max_new_tokens if answer_tokens is None else answer_tokens), window)


def storage_estimate(
    *, dtype: str, n_layers: int, hidden: int, num_prompts: int, tokens_per_prompt: float
) -> StorageEstimate:
    """The bill for ``num_prompts`` sequences of ``tokens_per_prompt`` tokens in ``dtype``
    (fp8: values plus one fp32 scale per token and layer)."""
    return StorageEstimate(bytes_per_token(dtype, n_layers=n_layers, hidden=hidden), tokens_per_prompt, num_prompts)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_tools.storage", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=None, help="mean prompt length (default: the full window)")
    args, overrides = ap.parse_known_args(argv)
    from hydra import compose, initialize_config_dir

    from dspark.config import load_config

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=overrides))
    data = cfg.data
    tokens = (
        float(data.max_seq_len)
        if args.prompt_tokens is None
        else sequence_tokens(args.prompt_tokens, None, max_new_tokens=data.max_new_tokens, window=data.max_seq_len)
    )
    est = storage_estimate(
        dtype=data.store_dtype,
        n_layers=len(cfg.target.layer_ids) + 1,  # + the final state
        hidden=cfg.target.hidden_size,
        num_prompts=data.num_prompts,
        tokens_per_prompt=tokens,
    )
    print(f"{cfg.target.name}, data.store_dtype={data.store_dtype}: {est.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
