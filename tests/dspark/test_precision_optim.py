"""issue #57's levers: bf16 autocast decided from the CPU's flags, Muon beside AdamW as one optimizer
(its split, its steps, its checkpoint), and both through the DeepSpeed trainer."""

import io

import pytest
import torch

from dspark.config import ConfigError, TrainConfig
from dspark.optim import MuonWithAdamW, build_optimizer, split_for_muon
from dspark.precision import cpu_flags, resolve_autocast
from dspark.recipe import build_trainer
from dspark.target import load_target_heads
from tests.toy import overrides, tiny_drafter, tiny_drafter_config

CPU = torch.device("cpu")


def test_cpu_flags_are_read_from_cpuinfo_and_nothing_is_assumed_without_it(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "sse", "avx2", "avx512f", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize(
    "flags, want, named",
    [
        ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, "avx512_bf16"),
        ({"avx2", "amx_bf16", "avx512_bf16"}, torch.bfloat16, "amx_bf16"),
        ({"avx2", "avx512f"}, None, "none of amx_bf16, avx512_bf16"),
        (set(), None, "none of amx_bf16, avx512_bf16"),
    ],
)
def test_auto_turns_bf16_on_only_where_the_cpu_multiplies_it_natively(flags, want, named):
    ac = resolve_autocast("auto", CPU, "float32", flags=flags)
    assert ac.dtype is want and named in ac.reason and "train.autocast=auto" in ac.reason
    assert ac.label == ("bfloat16 autocast" if want else "off")


def test_explicit_settings_and_bf16_weights_override_the_flags():
    assert resolve_autocast("off", CPU, "float32", flags={"avx512_bf16"}).dtype is None
    assert resolve_autocast("bfloat16", CPU, "float32", flags=set()).dtype is torch.bfloat16
    weights = resolve_autocast("auto", CPU, "bfloat16", flags={"avx512_bf16"})
    assert weights.dtype is None and "train.dtype=bfloat16" in weights.reason


def test_autocast_computes_products_in_bf16_and_keeps_fp32_weights_and_grads():
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64)
    with resolve_autocast("bfloat16", CPU, "float32").context():
        y = lin(x)
    assert y.dtype is torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.dtype is torch.float32 and lin.weight.grad.dtype is torch.float32
    with resolve_autocast("off", CPU, "float32").context():
        assert lin(x).dtype is torch.float32


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="train.autocast='fp8'"):
        TrainConfig(autocast="fp8")
    with pytest.raises(ConfigError, match="train.optimizer='sgd'"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ConfigError, match="train.muon_momentum=1.0"):
        TrainConfig(muon_momentum=1.0)


def _drafter():
    cfg = tiny_drafter_config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    return tiny_drafter(cfg, vocab_size=40)  # one layer, Markov rank 4, seed 0


def test_muon_gets_the_hidden_matrices_and_adamw_the_vocabulary_matrices_and_vectors():
    model = _drafter()
    muon, adamw = split_for_muon(model.named_parameters())
    muon_names, adamw_names = {n for n, _ in muon}, {n for n, _ in adamw}
    assert "fc.weight" in muon_names and "layers.0.self_attn.q_proj.weight" in muon_names
    assert "layers.0.mlp.down_proj.weight" in muon_names
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= adamw_names
    assert "confidence_head.proj.weight" in adamw_names  # a [1, N] row is no matrix
    assert all(p.ndim == 2 and min(p.shape) > 1 for _, p in muon)
    assert not {n for n, p in model.named_parameters() if not p.requires_grad} & (muon_names | adamw_names)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert muon_names | adamw_names == trainable and not muon_names & adamw_names


def _muon_cfg(**kw):
    return TrainConfig(optimizer="muon", lr=1e-2, muon_lr=0.05, **kw)


def _steps(model, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in model.parameters() if p.requires_grad)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_each_group_moves_by_its_own_rule_and_the_schedule_scales_both():
    model = _drafter()
    opt = build_optimizer(model, _muon_cfg(muon_weight_decay=0.0))
    assert isinstance(opt, MuonWithAdamW) and [g["use_muon"] for g in opt.param_groups] == [True, False]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.025, 0.005]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _steps(model, opt, 1, seed=0)
    sched.step()
    gate = dict(model.named_parameters())["layers.0.mlp.gate_proj.weight"]  # [32, 16]
    delta = (gate.detach() - before["layers.0.mlp.gate_proj.weight"]).double()
    # Muon's first update is the orthogonalised gradient (a Gaussian 32 x 16 one: every singular
    # value well away from 0): its singular values are all about the adjusted lr,
    # 0.025 x 0.2 x sqrt(32) = 0.0283 (Newton-Schulz in bf16 leaves them in ~[0.7, 1.2])
    sv = torch.linalg.svdvals(delta)
    assert 0.6 * 0.0283 < sv.min() and sv.max() < 1.3 * 0.0283
    w2 = dict(model.named_parameters())["markov_head.markov_w2.weight"]
    w2_delta = (w2.detach() - before["markov_head.markov_w2.weight"]).abs()
    # AdamW's first step moves every entry by lr (sign of the gradient): 0.005
    torch.testing.assert_close(w2_delta, torch.full_like(w2_delta, 0.005), rtol=1e-3, atol=1e-6)
    assert all(len(opt.state[p]) > 0 for g in opt.param_groups for p in g["params"])


def test_a_restored_optimizer_continues_exactly_as_the_uninterrupted_one():
    a, b = _drafter(), _drafter()
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = build_optimizer(a, _muon_cfg()), build_optimizer(b, _muon_cfg())
    _steps(a, opt_a, 2, seed=1)
    _steps(b, opt_b, 2, seed=1)
    saved = opt_b.state_dict()
    c = _drafter()
    c.load_state_dict(b.state_dict())
    opt_c = build_optimizer(c, _muon_cfg())
    buf = io.BytesIO()
    torch.save(saved, buf)  # through bytes, as a checkpoint holds it
    buf.seek(0)
    opt_c.load_state_dict(torch.load(buf, weights_only=True))
    _steps(a, opt_a, 2, seed=2)
    _steps(c, opt_c, 2, seed=2)
    for (n, pa), (_, pc) in zip(a.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pc), n


@pytest.fixture
def tiny(tiny_target_and_shards):
    return tiny_target_and_shards


def _trainer(compose_config, tiny, out, *extra):
    target, data = tiny
    return build_trainer(compose_config(*overrides(target, data, out, *extra)), load_target_heads(target))


def test_the_trainer_logs_its_precision_first_and_keeps_fp32_weights_under_autocast(
    compose_config, tiny, tmp_path, caplog
):
    with caplog.at_level("INFO"):
        tr = _trainer(compose_config, tiny, tmp_path, "train.max_steps=3", "train.autocast=bfloat16")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("precision:"))
    assert line == "precision: float32 weights, bfloat16 autocast (train.autocast=bfloat16)"
    state = tr.train()
    assert state.step == 3 and all(h["loss"] == h["loss"] for h in state.history)  # finite
    assert all(p.dtype is torch.float32 for p in tr.model.parameters())
    assert tr.state.validations and tr.state.validations[-1]["tau"] >= 1.0


@pytest.mark.slow  # four short trainings: the full suite runs it, the fast tier stays under 5 min
def test_a_muon_run_resumes_the_same_loss_curve_and_an_adamw_checkpoint_is_not_resumed_as_muon(
    compose_config, tiny, tmp_path
):
    muon = ("train.max_steps=6", "train.save_every=3", "train.optimizer=muon")
    full = _trainer(compose_config, tiny, tmp_path / "a", *muon).train()
    _trainer(compose_config, tiny, tmp_path / "b", *muon).train(until=3)
    resumed = _trainer(compose_config, tiny, tmp_path / "b", *muon)
    assert resumed.state.step == 3
    state = resumed.train()
    for x, y in zip(state.history, full.history):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
    adamw = _trainer(compose_config, tiny, tmp_path / "c", "train.max_steps=6", "train.save_every=3")
    adamw.train(until=3)
    with pytest.raises(Exception, match="train.optimizer: checkpoint 'adamw', now 'muon'"):
        _trainer(compose_config, tiny, tmp_path / "c", *muon)
