"""Shared test data and model builders (import as ``from tests.toy import ...``)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.formats.shard_format import Manifest, scale_granularity_of

if TYPE_CHECKING:  # the heavy imports stay inside the builders: most tests need none of them
    import torch
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    from dspark.config import DSparkConfig, RunConfig
    from dspark.model import DSparkDrafter
    from dspark.target import TargetHeads
    from dspark.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


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
    from dspark.core.ports import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        script,
        *args,
    ]


def two_rank_train(target: Path, data: Path, out: Path, steps: int, *extra: str) -> str:
    """``train.py`` on two ranks (:func:`torchrun`, gloo on CPU) for ``steps`` steps of micro batch 2
    on the tiny target's run (:func:`overrides` into ``out``, then ``extra``): its log, once the run
    ended with status 0, having logged both ranks and its last step and saved that step's tag."""
    import subprocess

    cmd = torchrun(
        "train.py",
        *overrides(target, data, out, f"train.max_steps={steps}", "train.micro_batch_size=2", *extra),
        f"hydra.run.dir={out}/run",
    )
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "2 rank(s)" in log and f"step {steps}/{steps}" in log
    assert (out / "ckpt" / f"step{steps:08d}").is_dir()
    return log


# --- tiny models ------------------------------------------------------------------------------
# Every hand-built model of the tests comes from here: a random transformers target, a drafter
# on one (or on made-up frozen pieces), and the tiny target with its shards that the trainer,
# online and eval-fault tests train on (built once per session by tests/conftest.py).

TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""The smallest target the layer-id and verify tests need; each caller replaces what it needs."""

TINY_QWEN3: dict[str, Any] = dict(  # head_dim 32: vLLM's CPU attention takes head sizes 32, 64, 80, ... only
    vocab_size=49152,  # SmolLM2's tokenizer, saved beside the weights
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,  # more than the 5 spread layers, so the spread rule has to choose
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
"""The second architecture's target (tests/conftest.py ``tiny_qwen3_dir``; part of its cache key)."""

TINY_DRAFTER: dict[str, Any] = dict(num_layers=1, block_size=4, intermediate_size=64, markov_rank=4)
"""The tests' drafter: one layer, gamma 4, MLP 64, a rank-4 Markov head; width and heads the
target's unless given."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

TINY_LAYERS = [1, 2]
"""The layers the tiny target's shards capture, besides its final state 4."""


def _random_lm(model_cls, config, seed: int | None):
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    return model_cls(config).float().eval()


def tiny_llama_target(*, seed: int | None = 0, **config: Any) -> LlamaForCausalLM:
    """A random-weight transformers Llama (fp32, eval mode): :data:`TINY_LLAMA` with ``config``
    replaced, its weights drawn right after ``torch.manual_seed(seed)`` (None: from the global
    generator as it stands)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _random_lm(LlamaForCausalLM, LlamaConfig(**{**TINY_LLAMA, **config}), seed)


def tiny_qwen3_target(*, seed: int | None = 0, **config: Any) -> Qwen3ForCausalLM:
    """A random-weight transformers Qwen3 (fp32, eval mode): :data:`TINY_QWEN3` with ``config``
    replaced, seeded as :func:`tiny_llama_target`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _random_lm(Qwen3ForCausalLM, Qwen3Config(**{**TINY_QWEN3, **config}), seed)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer and chat template files of ``src`` (those it has) copied into ``dst``."""
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def save_target(model, path: Path, tokenizer_from: Path | None = None, **save_kwargs: Any) -> Path:
    """``model`` saved as a transformers directory at ``path`` (``save_pretrained(**save_kwargs)``),
    with the tokenizer files of ``tokenizer_from`` beside it when given."""
    model.save_pretrained(str(path), **save_kwargs)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, path)
    return path


def tiny_drafter_config(**fields: Any) -> DSparkConfig:
    """A DSparkConfig: :data:`TINY_DRAFTER` with ``fields`` replaced."""
    from dspark.config import DSparkConfig

    return DSparkConfig(**{**TINY_DRAFTER, **fields})


def tiny_drafter(
    cfg: DSparkConfig,
    *,
    target=None,
    vocab_size: int | None = None,
    num_context_layers: int = 1,
    mask_token_id: int = 0,
    embed_tokens: torch.Tensor | None = None,
    lm_head: torch.Tensor | None = None,
    target_norm_eps: float = 1e-6,
    seed: int | None = 0,
    d2t: torch.Tensor | None = None,
) -> DSparkDrafter:
    """A DSparkDrafter for ``cfg`` (train mode, as constructed).

    On ``target`` (a transformers causal LM): its config, vocabulary, embedding, LM head and final
    norm. Otherwise on a made-up target as wide as ``cfg.hidden_size`` with ``vocab_size`` tokens:
    ``embed_tokens`` and ``lm_head`` as given, else N(0, 1) (drawn in that order), a final norm of
    ones. ``seed``: ``torch.manual_seed`` before anything random is drawn (None: the global
    generator as it stands). ``d2t``: the draft vocabulary's map (``cfg.draft_vocab_size`` set)."""
    import torch

    from dspark.model import DSparkDrafter, resolve_dims

    if seed is not None:
        torch.manual_seed(seed)
    if target is not None:
        target_config, vocab_size = target.config.to_dict(), target.config.vocab_size
        embed_tokens = target.model.embed_tokens.weight.detach()
        lm_head, target_norm = target.lm_head.weight.detach(), target.model.norm.weight.detach()
    else:
        hidden = cfg.hidden_size
        target_config, target_norm = {"hidden_size": hidden}, torch.ones(hidden)
        embed_tokens = torch.randn(vocab_size, hidden) if embed_tokens is None else embed_tokens
        lm_head = torch.randn(vocab_size, hidden) if lm_head is None else lm_head
    dims = resolve_dims(
        cfg,
        target_config=target_config,
        vocab_size=vocab_size,
        num_context_layers=num_context_layers,
        mask_token_id=mask_token_id,
    )
    return DSparkDrafter(
        cfg,
        dims,
        embed_tokens=embed_tokens,
        lm_head=lm_head,
        target_norm=target_norm,
        target_norm_eps=target_norm_eps,
        d2t=d2t,
    )


def build_target_and_shards(root: Path, smollm2_dir: Path, *, n_train=12, n_val=3, nan_in=None) -> tuple[Path, Path]:
    """The tiny target (a random Llama: 4 layers, hidden 64, SmolLM2's vocabulary and tokenizer,
    a peaked final norm) at ``root/target`` and a dataset of its own greedy answers at
    ``root/shards``: ``n_train`` train and ``n_val`` val rows of 32 tokens (6 prompt, 26 answer)
    capturing :data:`TINY_LAYERS` and the final state 4, in fp32; ``nan_in=(split, i)`` puts a NaN
    in that row's states. tests/conftest.py's ``tiny_target_and_shards`` is the default one, built
    once per session."""
    from collections import Counter

    import torch
    from transformers import AutoTokenizer

    from data_tools.shard_writer import finalize, write_shard
    from dspark.core.file_reads import file_sha256, text_sha256
    from dspark.core.layer_ids import reference_hidden_states

    target = root / "target"
    model = tiny_llama_target(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, tie_word_embeddings=True
    )
    model.model.norm.weight.data.fill_(8.0)  # peaked next-token distributions, like a trained LM's
    save_target(model, target, smollm2_dir)
    data = root / "shards"
    Manifest(
        target="tiny",
        target_path=str(target),
        revision=None,
        architecture="LlamaForCausalLM",
        tokenizer_sha256=file_sha256(target / "tokenizer.json"),
        chat_template_sha256=text_sha256(AutoTokenizer.from_pretrained(str(target)).chat_template),
        layer_ids=TINY_LAYERS + [4],
        num_hidden_layers=4,
        hidden_size=64,
        dtype="float32",
        compression="none",
    ).save(data)
    g = torch.Generator().manual_seed(1)
    for split, n in (("train", n_train), ("val", n_val)):
        rows = []
        for i in range(n):
            prompt = torch.randint(100, 2000, (6,), generator=g)
            with torch.no_grad():  # on-policy: the target's own greedy answer
                ids = model.generate(
                    prompt[None], max_new_tokens=26, do_sample=False, min_new_tokens=26, pad_token_id=0
                )[0]
            hs = reference_hidden_states(model, ids[:-1], TINY_LAYERS + [4])
            if nan_in == (split, i):
                hs[3, 0, 0] = float("nan")
            rows.append(
                {
                    "seq_id": f"{split}-{i:02d}",
                    "num_tokens": len(ids),
                    "input_ids": ids.tolist(),
                    "loss_mask": [0] * 6 + [1] * (len(ids) - 6),
                    "hidden_states": hs.numpy().tobytes(),
                }
            )
        write_shard(rows, data, split, 0, "none", Counter())
    finalize(data, [("train", 0), ("val", 0)])
    return target, data


TINY_K3_TEXT: dict[str, Any] = dict(
    model_type="kimi_linear",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    num_experts=4,
    num_experts_per_token=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 16, "num_heads": 4},
)
"""A Kimi K3-shaped text config at the tiny target's sizes: KimiLinear (KDA layers 1 and 3, MLA
layers 2 and 4, routed experts from layer 1) with MLA sizes a drafter as wide copies."""


def build_tiny_k3_target(root: Path, like: Path) -> Path:
    """A random-weight directory in Kimi K3's layout (``KimiK3ForConditionalGeneration``: the text
    model under ``text_config`` and ``language_model.``, an image processor config) at
    :data:`TINY_K3_TEXT`'s sizes, whose embedding, final norm and LM head are those of the target
    at ``like`` (tests/conftest.py's tiny target), so that target's captured states are this
    one's. Only what a drafter reads is there: neither vLLM on CPU nor transformers runs a K3
    (KDA and MoE kernels), so its states come from ``like``."""
    import json

    from safetensors.torch import save_file

    from dspark.target import load_target_heads

    heads = load_target_heads(like)
    root.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(like, root)
    save_file(
        {
            "language_model.embed_tokens.weight": heads.embed_tokens.contiguous(),
            "language_model.norm.weight": heads.final_norm.contiguous(),
            "language_model.lm_head.weight": heads.lm_head.clone().contiguous(),
        },
        str(root / "model.safetensors"),
    )
    text = {**TINY_K3_TEXT, "rms_norm_eps": heads.rms_norm_eps}
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text}
    (root / "config.json").write_text(json.dumps(config, indent=2))
    media = {  # what vLLM's K3 processor reads when it builds the target's ModelConfig
        "merge_kernel_size": 2,
        "temporal_merge_kernel_size": 4,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": 14,
        "in_patch_limit": 4096,
        "patch_limit_on_one_side": 512,
        "fixed_output_tokens": None,
        "in_patch_limit_each_frame": 4096,
    }
    (root / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media}, indent=2))
    return root


def overrides(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """The Hydra overrides of a run on the tiny target of :func:`build_target_and_shards` (a
    1-layer drafter, gamma 4; checkpoints under ``out/ckpt``), then ``extra``."""
    return [
        "target.source=hf_dir",
        f"target.path={target}",
        "target.name=tiny",
        "target.hidden_size=64",
        "target.num_hidden_layers=4",
        f"target.layer_ids={TINY_LAYERS}",
        "drafter.num_layers=1",
        "drafter.intermediate_size=128",
        "drafter.markov_rank=16",
        "drafter.block_size=4",
        f"data.shards_dir={data}",
        f"train.checkpoint_dir={out}/ckpt",
        f"paths.output_dir={out}",
        "logging.wandb=false",
        "train.micro_batch_size=4",
        "train.anchors_per_seq=8",
        "train.max_seq_len=64",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.log_every=1",
        "train.eval_every=1000",
        "train.save_every=1000",
        "stages=[train]",
        *extra,
    ]


def train_drafter(cfg: RunConfig, heads: TargetHeads) -> Any:
    """Train ``cfg``'s drafter in this process (to ``train.max_steps``; its final state back): the
    tests' one in-process training outside the trainer's own tests (tests/dspark/test_trainer*.py),
    so that a change of the trainer's API is made here once."""
    from dspark.recipe import build_trainer

    return build_trainer(cfg, heads).train()


def make_trainer(compose_config: Any, tiny: tuple[Path, Path], out: Path, *extra: str) -> Trainer:
    """The trainer of a run on ``tiny`` (the ``tiny`` fixture's target and shards: :func:`overrides`
    into ``out``, then ``extra``), built in this process; ``compose_config``: the fixture."""
    from dspark.recipe import build_trainer
    from dspark.target import load_target_heads

    target, data = tiny
    return build_trainer(compose_config(*overrides(target, data, out, *extra)), load_target_heads(target))
