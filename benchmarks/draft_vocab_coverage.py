"""Would a reduced draft vocabulary (EAGLE-3's draft-to-target map) cut what answers copy?

A draft vocabulary of the N most frequent training tokens makes the draft LM head, its softmax
and the Markov output N/V as expensive, but a token outside it can never be drafted: each
occurrence in an answer ends the accepted run there. This measures, for several N, the share
of tokens inside the top N (by frequency over the training answers, prompts counted too) in:
the validation answers, the eval prompts (the documents answers copy from) and the target's
own greedy answers to the eval prompts (generated here with transformers).

    .venv/bin/python benchmarks/draft_vocab_coverage.py --shards outputs/data/smollm2-135m-ablate \\
        --eval-set outputs/eval/smollm2-135m/markov256/eval_set.jsonl [--answers 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from dspark.config import TargetConfig
from dspark.core.file_reads import read_jsonl
from dspark.data.shards import ShardDataset
from dspark.target import resolve_target

SIZES = (4096, 8192, 16384, 32768)
VOCAB = 49152  # SmolLM2-135M


def coverage(tokens: list[int], vocab: set[int]) -> float:
    return sum(t in vocab for t in tokens) / max(1, len(tokens))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=Path, required=True)
    p.add_argument("--eval-set", type=Path, required=True, help="eval_set.jsonl written by the eval stage")
    p.add_argument("--answers", type=int, default=8, help="eval prompts to answer greedily (0: none)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    freq: Counter[int] = Counter()
    train = ShardDataset(args.shards, "train")
    for i in range(len(train)):
        freq.update(train.read(i).input_ids.tolist())
    val = ShardDataset(args.shards, "val")
    val_answers: list[int] = []
    for i in range(len(val)):
        seq = val.read(i)
        val_answers += seq.input_ids[seq.loss_mask].tolist()
    prompts = [r for _, r in read_jsonl(args.eval_set)]
    docs = [t for r in prompts for t in r["prompt_token_ids"]]
    eval_answers: list[int] = []
    if args.answers:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(resolve_target(TargetConfig()).path)).eval()
        for r in prompts[: args.answers]:
            ids = torch.tensor([r["prompt_token_ids"]])
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
            eval_answers += out[0, ids.shape[1] :].tolist()
    by_freq = [t for t, _ in freq.most_common()]
    seen = set(by_freq)
    # then the tokenizer's own order: BPE ids rise with merge rank, roughly falling frequency
    rankings = {"train frequency": by_freq, "+ BPE order": by_freq + [t for t in range(VOCAB) if t not in seen]}
    rows = []
    print(f"{len(freq)} distinct tokens in {len(train)} training sequences; vocabulary {VOCAB}")
    print(f"{'ranking':>16} {'N':>6} {'val answers':>12} {'eval prompts':>13} {'eval answers':>13}")
    for name, ranked in rankings.items():
        for n in SIZES:
            vocab = set(ranked[:n])
            row = {
                "ranking": name,
                "n": n,
                "val_answers": coverage(val_answers, vocab),
                "eval_prompts": coverage(docs, vocab),
                "eval_answers": coverage(eval_answers, vocab) if eval_answers else None,
            }
            rows.append(row)
            ea = f"{row['eval_answers']:.4f}" if eval_answers else "-"
            print(f"{name:>16} {n:>6} {row['val_answers']:>12.4f} {row['eval_prompts']:>13.4f} {ea:>13}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"distinct_train_tokens": len(freq), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
