"""Training benchmark on the embedded target's heads (SmolLM2-135M, hidden 576), default drafter
(5 layers, gamma 7, Markov rank 256), fp32 on CPU:

1. DeepSpeed (ZeRO 0) step time and tokens/s against a plain torch loop (AdamW, clipping,
   same model, same batches);
2. time waiting for data (shard read + collate + anchor sampling) as a share of the step;
3. peak memory (max RSS on CPU, max allocated on GPU);
4. the anchor-batched forward+backward (all anchors, one block-sparse mask) against one
   forward+backward per anchor.

    .venv/bin/python benchmarks/train_bench.py [--steps 8] [--seq-len 512] [--out outputs/benchmarks/train.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]


def synthetic_shards(out: Path, heads, *, n: int, seq_len: int) -> None:
    """Random states in the real schema (timing does not depend on their values)."""
    from data_tools.shard_writer import finalize, write_shard
    from dspark.core.file_reads import file_sha256
    from dspark.formats.shard_format import Manifest

    g = torch.Generator().manual_seed(0)
    Manifest(
        target="smollm2-135m",
        target_path=str(heads.path),
        revision=None,
        architecture=heads.architecture,
        tokenizer_sha256=file_sha256(heads.path / "tokenizer.json"),
        chat_template_sha256="",
        layer_ids=[1, 8, 15, 22, 29, 30],
        num_hidden_layers=30,
        hidden_size=576,
        dtype="float32",
        compression="none",
    ).save(out)
    rows = [
        {
            "seq_id": f"s{i}",
            "num_tokens": seq_len,
            "input_ids": torch.randint(0, 49152, (seq_len,), generator=g).tolist(),
            "loss_mask": [0] * 64 + [1] * (seq_len - 64),
            "hidden_states": torch.randn(seq_len - 1, 6, 576, generator=g).numpy().tobytes(),
        }
        for i in range(n)
    ]
    write_shard(rows, out, "train", 0, "none", Counter())
    finalize(out, [("train", 0)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", type=Path, default=REPO / "outputs/benchmarks/train.json")
    args = ap.parse_args()
    torch.manual_seed(0)

    import dspark.config  # noqa: F401 - registers the schemas
    from dspark.config import TargetConfig
    from dspark.model import sample_anchors
    from dspark.recipe import build_trainer
    from dspark.target import load_target_heads, resolve_target

    heads = load_target_heads(resolve_target(TargetConfig()).path)
    work = Path(tempfile.mkdtemp(prefix="dspark-train-bench-"))
    synthetic_shards(work / "shards", heads, n=16, seq_len=args.seq_len)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "+experiment=smollm2_cpu_demo",
                f"data.shards_dir={work / 'shards'}",
                f"train.checkpoint_dir={work / 'ckpt'}",
                f"paths.output_dir={work}",
                "logging.wandb=false",
                "train.micro_batch_size=2",
                "train.optimizer=adamw",  # the fp32 AdamW step, as the plain model beside it runs
                "train.autocast=off",
                "train.anchors_per_seq=16",
                f"train.max_steps={10**6}",
                "train.log_every=1000000",
                "stages=[train]",
            ],
        )
    tr = build_trainer(cfg, heads)
    plain_model = copy.deepcopy(tr.engine.module)  # same weights, no DeepSpeed
    results: dict = {
        "seq_len": args.seq_len,
        "micro_batch": 2,
        "anchors_per_seq": 16,
        "gamma": 7,
        "trainable_params_M": tr.model.num_trainable_parameters() / 1e6,
        "threads": torch.get_num_threads(),
    }

    # 1+2. DeepSpeed steps (the trainer's own step) with the data wait measured inside
    for _ in range(2):
        tr.train_step()
    ds_times, data_times, tokens = [], [], 0.0
    for _ in range(args.steps):
        m, _ = tr.train_step()
        ds_times.append(m["step_s"])
        data_times.append(m["data_s"])
        tokens += m["tokens"]
    ds_step = sorted(ds_times)[len(ds_times) // 2]

    # plain torch loop on identical batches
    params = [p for p in plain_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    batches = [tr.batches.next() for _ in range(args.steps + 2)]
    torch_times = []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, 16, gen)
        out = plain_model(batch, anchors, valid)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            torch_times.append(time.perf_counter() - t0)
    torch_step = sorted(torch_times)[len(torch_times) // 2]
    results["deepspeed_vs_torch"] = {
        "deepspeed_step_s": ds_step,
        "torch_step_s": torch_step,
        "overhead": ds_step / torch_step - 1,
        "deepspeed_tokens_per_s": tokens / sum(ds_times),
        "torch_tokens_per_s": tokens / sum(ds_times) * ds_step / torch_step,
    }
    results["data_wait_fraction"] = sum(data_times) / sum(ds_times)
    results["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    # 4. anchor-batched vs one forward per anchor (forward + backward, same anchors)
    model = plain_model.drafter
    batch = batches[0]
    anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, 16, torch.Generator().manual_seed(1))

    def fwd_bwd(a: torch.Tensor, v: torch.Tensor, ctx_len: int | None = None) -> None:
        b = batch
        if ctx_len is not None:  # one anchor: the context it may see, nothing more
            b = copy.copy(batch)
            b.context_states = batch.context_states[:, :ctx_len]
        out = plain_model(b, a, v)
        out.loss.backward()

    def timed(fn) -> float:  # noqa: ANN001
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    batched = timed(lambda: fwd_bwd(anchors, valid))
    per_anchor = timed(lambda: [fwd_bwd(anchors[:, j : j + 1], valid[:, j : j + 1]) for j in range(anchors.shape[1])])
    model.zero_grad(set_to_none=True)
    results["anchor_batching"] = {
        "batched_fwd_bwd_s": batched,
        "per_anchor_fwd_bwd_s": per_anchor,
        "speedup": per_anchor / batched,
    }
    shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
