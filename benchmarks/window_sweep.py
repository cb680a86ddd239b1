"""Greedy acceptance of several drafters on one long-context eval set, with one target pass for all
of them (issue #47, items 2 and 3): the target decodes each prompt once, greedily, keeping its
context states; each drafter then runs the reference loop's steps (eval/reference.py,
``speculative_generate`` with temperature 0) against that fixed continuation, so a drafter costs its
own forwards only. Under greedy decoding a step accepts the longest prefix of the block that equals
the target's own next tokens, so the counts are the reference loop's (the target's states come from
one-token decode forwards instead of the verify forwards: the same numbers to fp32 rounding; the
check below runs both on a few prompts and prints the difference).

    python benchmarks/window_sweep.py --eval-set EVAL_SET.jsonl --target-dir TARGET_DIR \\
        --drafter NAME=EXPORT_DIR[@W] ... [--out DIR] [--check 3]

``@W`` serves that export with attention window W (``drafter.attention_window``) whatever it was
trained with (``@none``: full attention): what a window does before any training matches it.
Writes DIR/results.json (each row's counts per prompt) and DIR/tokens_per_step_per_bin.png, prints a
Markdown table: tokens/step per bin and overall with 95 % intervals over prompts, pos-1, and the
fade (longest bin over shortest, paired over prompts on a fixed_passage set).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def target_pass(
    model: torch.nn.Module, layer_ids: list[int], prompt: list[int], tokens: int
) -> tuple[list[int], torch.Tensor]:
    """The target's greedy continuation of ``prompt`` (``tokens`` of it, EOS not stopping it: a
    verify step compares drafts past the answer's end too) and its context states for every
    position of prompt + continuation but the last: ([tokens], [len(prompt) + tokens - 1, C])."""
    from eval.reference import TargetRunner

    tr = TargetRunner(model, layer_ids)
    tr.reset()
    logits, states = tr.forward(prompt)
    out, chunks = [int(torch.argmax(logits[-1]))], [states]
    while len(out) < tokens:
        logits, states = tr.forward([out[-1]])
        out.append(int(torch.argmax(logits[-1])))
        chunks.append(states)
    return out, torch.cat(chunks).cpu()


def simulate(
    drafter: torch.nn.Module,
    prompt_len: int,
    greedy: list[int],
    states: torch.Tensor,
    gamma: int,
    max_new: int,
    eos: set[int],
):  # noqa: ANN201
    """The reference loop's greedy steps for one prompt against the target's fixed continuation:
    its :class:`~eval.acceptance.AcceptanceCounts`, the tokens it outputs and the seconds its draft
    passes took (the block's forward and heads, as ``DraftRunner.propose`` runs them)."""
    from eval.acceptance import AcceptanceCounts
    from eval.reference import DraftRunner, _finish

    dr = DraftRunner(drafter)
    dr.reset()
    dr.extend(states[:prompt_len])
    counts, out, draft_s = AcceptanceCounts(gamma), [greedy[0]], 0.0
    gen = torch.Generator().manual_seed(0)
    while True:
        out, done = _finish(out, max_new, eos)
        if done:
            break
        i = len(out)  # the next token's index in the continuation; the anchor is out[-1]
        t0 = time.perf_counter()
        drafts, _, _ = dr.propose(out[-1], gamma, 0.0, gen)
        draft_s += time.perf_counter() - t0
        n = 0
        while n < len(drafts) and i + n < len(greedy) and drafts[n] == greedy[i + n]:
            n += 1
        if i + n >= len(greedy):
            raise ValueError(f"the target's continuation ({len(greedy)} tokens) is too short for a block at {i}")
        counts.add_step(len(drafts), n)
        a = prompt_len + i - 1  # the anchor's position
        dr.extend(states[a : a + n + 1])
        out += greedy[i : i + n + 1]
    return counts, out, draft_s


def _load(spec: str, heads: Any, device: str) -> tuple[str, torch.nn.Module, list[int], Optional[int]]:
    from dspark.export.speculators_format import read_drafter_dir
    from dspark.export.vllm_format import load_drafter

    name, _, rest = spec.partition("=")
    path, _, window = rest.partition("@")
    exp = read_drafter_dir(Path(path))
    w = exp.drafter.attention_window
    if window:
        w = None if window == "none" else int(window)
        exp = replace(exp, drafter=replace(exp.drafter, attention_window=w))
    return name, load_drafter(exp, heads).to(device).eval(), exp.context_layer_ids, w


def plot(rows: list, bins: list[int], path: Path) -> None:
    from matplotlib.figure import Figure

    from eval.acceptance import TOKENS_PER_STEP, AcceptanceCounts

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for r in rows:
        ys = [AcceptanceCounts.from_dict(r.per_bin[str(b)]).tokens_per_step for b in bins]
        lo = [r.interval(TOKENS_PER_STEP.stat, str(b))[0] for b in bins]
        hi = [r.interval(TOKENS_PER_STEP.stat, str(b))[1] for b in bins]
        ax.plot(bins, ys, marker="o", label=r.name)
        ax.fill_between(bins, lo, hi, alpha=0.12)
    ax.set(
        xscale="log",
        xlabel="context tokens (bin)",
        ylabel="tokens per target step",
        title="Tokens/step per context length (fixed passage, greedy)",
    )
    ax.set_xticks(bins, [f"{b // 1024}k" if b % 1024 == 0 else str(b) for b in bins])
    ax.minorticks_off()  # the log axis's own minor labels collide with the bins'
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eval-set", type=Path, required=True, help="JSONL from python -m eval.prompts --out")
    ap.add_argument("--target-dir", type=Path, required=True)
    ap.add_argument("--drafter", action="append", default=[], help="NAME=EXPORT_DIR[@W|@none]")
    ap.add_argument(
        "--layer-ids",
        type=int,
        nargs="+",
        help="the target layers to keep (default: the drafters'); "
        "without --drafter, only the target pass runs (cached under --out for the drafters to come)",
    )
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "window_sweep")
    ap.add_argument(
        "--check", type=int, default=0, help="prompts on which to run the reference loop itself, for the first drafter"
    )
    args = ap.parse_args(argv)
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from dspark.target import load_target_heads
    from eval.acceptance import per_bin_summary
    from eval.checks import interval_text
    from eval.eval_set import load_eval_set
    from eval.report import fmt
    from eval.results import DrafterResult

    torch.manual_seed(0)
    heads = load_target_heads(args.target_dir)
    prompts = load_eval_set(args.eval_set, vocab_size=heads.vocab_size, key=None)
    model = AutoModelForCausalLM.from_pretrained(str(args.target_dir), dtype=torch.float32).eval()
    eos = {heads.tokenizer.eos_token_id} - {None}
    drafters = [_load(s, heads, "cpu") for s in args.drafter]
    layer_ids = args.layer_ids or (drafters[0][2] if drafters else None)
    if layer_ids is None:
        raise SystemExit("error: give --drafter NAME=EXPORT_DIR, or --layer-ids for the target pass alone")
    if any(d[2] != layer_ids for d in drafters):
        raise SystemExit("error: the drafters read different target layers; one target pass serves one set of layers")
    cache = args.out / "target_pass"
    cache.mkdir(parents=True, exist_ok=True)
    passes = {}
    want = args.max_new_tokens + args.gamma + 1  # the answer and one block past its end
    target = str(args.target_dir.resolve())

    def key(p: Any) -> str:  # a cached pass is this target's on these very tokens, whatever the id says
        return hashlib.sha256(json.dumps([target, p.prompt_token_ids]).encode()).hexdigest()

    t0 = time.perf_counter()
    for p in tqdm(prompts, desc="target pass", unit="prompt"):
        f = cache / f"{p.prompt_id}.pt"
        if f.is_file():
            passes[p.prompt_id] = torch.load(f)
            kept = passes[p.prompt_id]
            if (kept.get("layer_ids"), kept.get("key"), len(kept["greedy"])) == (layer_ids, key(p), want):
                continue
        greedy, states = target_pass(model, layer_ids, p.prompt_token_ids, want)
        passes[p.prompt_id] = {"greedy": greedy, "states": states, "layer_ids": layer_ids, "key": key(p)}
        torch.save(passes[p.prompt_id], f.with_suffix(".tmp"))
        f.with_suffix(".tmp").rename(f)
    target_s = time.perf_counter() - t0
    if not drafters:
        print(f"target pass: {len(prompts)} prompts in {target_s:.0f} s, cached in {cache}", file=sys.stderr)
        return 0
    rows = []
    for name, drafter, _, w in drafters:
        t1 = time.perf_counter()
        counts, per_prompt = [], []
        for p in tqdm(prompts, desc=name, unit="prompt"):
            tp = passes[p.prompt_id]
            c, _, draft_s = simulate(
                drafter, p.num_tokens, tp["greedy"], tp["states"], args.gamma, args.max_new_tokens, eos
            )
            counts.append(c)
            per_prompt.append({"prompt_id": p.prompt_id, "bin": p.bin, **asdict(c), "draft_s": draft_s})
        overall, per_bin = per_bin_summary([p.bin for p in prompts], counts, args.gamma)
        rows.append(
            DrafterResult(name, "reference", "dspark", overall, per_bin, per_prompt=per_prompt, notes=f"window {w}")
        )
        print(f"{name}: {time.perf_counter() - t1:.0f} s", file=sys.stderr)
    if args.check:
        from eval.reference import DecodeConfig, DraftRunner, TargetRunner, speculative_generate

        name, drafter, ids, _ = drafters[0]
        dcfg = DecodeConfig(gamma=args.gamma, max_new_tokens=args.max_new_tokens)
        for p, want in zip(prompts[: args.check], rows[0].per_prompt):
            g = speculative_generate(
                TargetRunner(model, ids), DraftRunner(drafter), p.prompt_token_ids, dcfg, eos, torch.Generator()
            )
            print(
                f"check {name} {p.prompt_id}: reference loop accepted {g.counts.num_accepted} in "
                f"{g.counts.num_steps} steps, this sweep {want['num_accepted']} in {want['num_steps']}",
                file=sys.stderr,
            )
    bins = sorted({p.bin for p in prompts})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "eval_set": str(args.eval_set),
                "gamma": args.gamma,
                "max_new_tokens": args.max_new_tokens,
                "target_pass_s": round(target_s, 1),
                "rows": [{**asdict(r), "fade": r.fade()[0], "fade_interval": list(r.fade()[1])} for r in rows],
            },
            indent=1,
        )
        + "\n"
    )
    plot(rows, bins, args.out / "tokens_per_step_per_bin.png")
    from eval.acceptance import TOKENS_PER_STEP, AcceptanceCounts
    from eval.intervals import STATS, ratio_interval

    print("| drafter | " + " | ".join(f"@{b}" for b in bins) + f" | all | pos-1 | fade @{bins[-1]}/@{bins[0]} |")
    print("|---|" + "---|" * (len(bins) + 3))
    for r in rows:
        cells = [
            fmt(AcceptanceCounts.from_dict(r.per_bin[str(b)]).tokens_per_step)
            + interval_text(r.interval(TOKENS_PER_STEP.stat, str(b)))
            for b in bins
        ]
        fade, fi = r.fade()
        pos1 = AcceptanceCounts.from_dict(r.overall).accept_per_pos[0]
        every = fmt(r.tokens_per_step) + interval_text(r.interval(TOKENS_PER_STEP.stat))
        print(f"| {r.name} | " + " | ".join(cells) + f" | {every} | {fmt(pos1)} | {fmt(fade)}{interval_text(fi)} |")
    first = rows[0]
    print(f"\nEach row over {first.name}, tokens/step per bin, paired over the same prompts (95 %):\n")
    print("| drafter | " + " | ".join(f"@{b}" for b in bins) + " | all |")
    print("|---|" + "---|" * (len(bins) + 1))
    for r in rows[1:]:
        cells = []
        for b in [*map(str, bins), None]:
            mine = {
                p["prompt_id"]: AcceptanceCounts.from_dict(p) for p in r.per_prompt if b is None or str(p["bin"]) == b
            }
            theirs = {p["prompt_id"]: AcceptanceCounts.from_dict(p) for p in first.per_prompt if p["prompt_id"] in mine}
            ids = sorted(mine)
            num, den = AcceptanceCounts(args.gamma), AcceptanceCounts(args.gamma)
            for k in ids:
                num.merge(mine[k])
                den.merge(theirs[k])
            stat = STATS[TOKENS_PER_STEP.stat]
            ci = ratio_interval([mine[k] for k in ids], [theirs[k] for k in ids], stat, paired=True)
            cells.append(fmt(num.tokens_per_step / den.tokens_per_step) + interval_text(ci))
        print(f"| {r.name} | " + " | ".join(cells) + " |")
    print("\nDraft pass per step (ms, the block's forward and heads in PyTorch on this machine), per bin:\n")
    print("| drafter | " + " | ".join(f"@{b}" for b in bins) + f" | @{bins[-1]} / @{bins[0]} |")
    print("|---|" + "---|" * (len(bins) + 1))
    for r in rows:
        ms = []
        for b in bins:
            recs = [p for p in r.per_prompt if p["bin"] == b]
            ms.append(1000 * sum(p["draft_s"] for p in recs) / max(1, sum(p["num_steps"] for p in recs)))
        print(f"| {r.name} | " + " | ".join(f"{m:.1f}" for m in ms) + f" | {ms[-1] / ms[0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
