"""How far is TV on the target's cached top k from the exact TV? (``train.target_topk``)

Loads a trained drafter (any run's checkpoint: the config it was trained with plus these
overrides) and, on every validation sequence with the validation anchors, compares per
prediction the exact TV against the full target distribution with the top-k TV the cached
loss uses, for several k; also the target's probability mass outside its top k and how often
the greedy match differs (never: the top 1 is exact).

    .venv/bin/python benchmarks/topk_error.py +experiment=smollm2_cpu_ablate +recipe=baseline \\
        [--k 8 16 64 256] [--json outputs/benchmarks/topk_error.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides naming the run, as for train.py")
    p.add_argument("--k", type=int, nargs="+", default=[8, 16, 64, 256])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from hydra import compose, initialize_config_dir

    from dspark.config import load_config
    from dspark.data.batching import collate
    from dspark.loss import _targets, topk_tv
    from dspark.model import sample_anchors
    from dspark.recipe import build_trainer
    from dspark.target import prepare_target

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=[*args.overrides, "logging.wandb=false"]))
    heads, _ = prepare_target(cfg)
    tr = build_trainer(cfg, heads)  # resumes the run's latest checkpoint; trains nothing
    model, ds = tr.model.eval(), tr.parts.val
    gen = torch.Generator().manual_seed(12345)
    exact_all, approx = [], {k: [] for k in args.k}
    tail = {k: [] for k in args.k}
    with torch.no_grad():
        for i in range(0, len(ds), tr.t.micro_batch_size):
            seqs = [ds[j] for j in range(i, min(len(ds), i + tr.t.micro_batch_size))]
            b = collate(
                seqs, context_index=tr.parts.context_index, final_index=tr.parts.final_index, max_len=tr.t.max_seq_len
            )
            b = b.to("cpu", torch.float32)
            anchors, valid = sample_anchors(b.loss_mask, b.lengths, tr.t.anchors_per_seq, gen)
            out = model(b.input_ids, b.context_states, anchors)
            tg = _targets(
                out,
                input_ids=b.input_ids,
                anchor_positions=anchors,
                valid_anchors=valid,
                loss_mask=b.loss_mask,
                lengths=b.lengths,
                num_states=b.final_states.shape[1],
                position_decay=4.0,
            )
            bsz, a, k_pred, h = out.hidden.shape
            hidden = out.hidden.reshape(-1, h)[tg.idx]
            markov = out.markov_embed.reshape(bsz * a * k_pred, -1)[tg.idx] if out.markov_embed is not None else None
            fin = b.final_states.gather(1, tg.state_pos[..., None].expand(-1, -1, b.final_states.shape[-1]))
            fin = fin.view(bsz * a * k_pred, -1)[tg.idx]
            p_d = torch.softmax(model.draft_logits(hidden, markov), -1)
            p_t = torch.softmax(model.target_logits(fin), -1)
            exact_all.append(0.5 * (p_d - p_t).abs().sum(-1))
            for k in args.k:
                top = p_t.topk(k, -1)
                approx[k].append(topk_tv(p_d, top.indices, top.values))
                tail[k].append(1 - top.values.sum(-1))
    exact = torch.cat(exact_all)
    report = {"predictions": len(exact), "mean_tv": float(exact.mean()), "k": {}}
    print(f"{len(exact)} predictions on {len(ds)} validation sequences; mean exact TV {exact.mean():.4f}")
    print(f"{'k':>5} {'mean |TV_k - TV|':>17} {'max':>8} {'mean TV_k':>10} {'target tail mass':>17}")
    for k in args.k:
        err = (exact - torch.cat(approx[k])).abs()
        t = torch.cat(tail[k])
        report["k"][k] = {
            "mean_abs_err": float(err.mean()),
            "max_abs_err": float(err.max()),
            "mean_tv_k": float(torch.cat(approx[k]).mean()),
            "mean_tail_mass": float(t.mean()),
        }
        print(f"{k:>5} {err.mean():>17.5f} {err.max():>8.4f} {torch.cat(approx[k]).mean():>10.4f} {t.mean():>17.4f}")
    tr.close()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
