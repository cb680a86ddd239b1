"""The training loop runs on the parts it is given (dspark.trainer.TrainParts): here a stand-in
engine around a one-parameter model, scripted batches, and a checkpointer and a logger that
record what they are handed. No DeepSpeed, no drafter, no shards."""

from pathlib import Path

import pytest
import torch

from dspark.checkpoint import TrainState
from dspark.config import LossSettings
from dspark.data.batching import Batch, DataPosition
from dspark.loss import LossOutput, scalar_names
from dspark.recipe import loss_settings
from dspark.trainer import Trainer, TrainParts

BLOCK = 7


class Quadratic(torch.nn.Module):
    """loss = (w - 1)^2; reports it as every loss term and w's closeness as acceptance."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.0))
        self.positions, self.losses = 0, []

    def forward(self, batch: Batch, anchors: torch.Tensor, valid: torch.Tensor, loss: LossSettings) -> LossOutput:
        self.losses.append(loss)  # the loss settings the trainer hands each call
        loss = (self.w - 1.0) ** 2
        rate = torch.full((BLOCK,), float(1.0 - loss.detach()))
        d = loss.detach()
        self.positions += int(valid.sum())
        return LossOutput(loss, d, d, d, d, rate, rate, rate, num_positions=int(valid.sum()))


class StandInEngine:
    """The part of DeepSpeed's engine interface the loop uses."""

    device = torch.device("cpu")

    def __init__(self, module: torch.nn.Module):
        self.module, self.calls = module, 0
        self.opt = torch.optim.SGD(module.parameters(), lr=0.25)

    def __call__(self, batch, anchors, valid, loss):
        self.calls += 1
        return self.module(batch, anchors, valid, loss)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad()

    def zero_optimization(self):
        return False

    def is_gradient_accumulation_boundary(self):
        return True

    def get_global_grad_norm(self):
        return None

    def get_lr(self):
        return [0.25]

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()


class ScriptedBatches:
    def __init__(self):
        self.pos = DataPosition()

    def next(self) -> Batch:
        i = self.pos.index
        self.pos = DataPosition(epoch=0, index=i + 1)
        t = 12
        return Batch(
            seq_ids=[f"s{i}"],
            input_ids=torch.arange(t)[None],
            loss_mask=torch.arange(t)[None] >= 4,
            lengths=torch.tensor([t]),
            context_states=torch.zeros(1, t - 1, 4),
            final_states=torch.zeros(1, t - 1, 4),
        )


class RecordingCheckpointer:
    directory = Path("/nonexistent/ckpt")

    def __init__(self):
        self.saved, self.validations, self.closed = [], None, False

    def save(self, engine, state, anchor_gen):
        self.saved.append((state.step, state.data.index, engine.module.w.item()))
        return self.directory / f"step{state.step:08d}"

    def write_validations(self, validations):
        self.validations = validations

    def close(self):
        self.closed = True


class RecordingLogger:
    def __init__(self):
        self.logged, self.finished = [], []

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self, exit_code=None):
        self.finished.append(exit_code)


def _parts(compose_config, *overrides):
    cfg = compose_config("train.log_every=1", "train.save_every=2", *overrides)
    engine = StandInEngine(Quadratic())
    return TrainParts(
        cfg=cfg,
        engine=engine,
        loss=loss_settings(cfg),
        batches=ScriptedBatches(),
        val=None,
        context_index=[0],
        final_index=1,
        state=TrainState(),
        anchor_gen=torch.Generator().manual_seed(0),
        checkpointer=RecordingCheckpointer(),
        logger=RecordingLogger(),
    )


def test_the_loop_steps_logs_and_saves_through_the_parts_it_is_given(compose_config):
    parts = _parts(compose_config, "train.max_steps=4", "train.grad_accum_steps=2")
    state = Trainer(parts).train()
    # 4 optimizer steps of 2 micro batches: 8 batches drawn, w -> 1 by (1 - 0.5)^8 per SGD step on (w-1)^2
    assert state.step == 4 and parts.engine.calls == 8 and state.data == DataPosition(0, 8)
    assert parts.engine.module.w.item() == pytest.approx(1 - 0.5**8)
    assert [h["seq_ids"] for h in state.history] == [["s0", "s1"], ["s2", "s3"], ["s4", "s5"], ["s6", "s7"]]
    assert [(s, i) for s, i, _ in parts.checkpointer.saved] == [(2, 4), (4, 8)]  # save_every=2, at the data position
    assert parts.checkpointer.closed and parts.logger.finished == [None]
    steps = [s for s, d in parts.logger.logged if "train/loss" in d]
    assert steps == [1, 2, 3, 4]
    first = parts.logger.logged[0][1]
    # the step's loss is the mean over its two micro batches: (w0 - 1)^2 = 1 and (w1 - 1)^2 = 0.25
    assert first["train/loss"] == pytest.approx((1.0 + 0.25) / 2)
    assert {f"train/{k}" for k in scalar_names(BLOCK)} <= set(first)  # every scalar name, from one list
    assert state.predictions == parts.engine.module.positions > 0  # what the model reported, summed


def test_the_loop_stops_at_until_without_finishing_the_run(compose_config):
    parts = _parts(compose_config, "train.max_steps=6")
    state = Trainer(parts).train(until=3)
    assert state.step == 3 and parts.logger.finished == [] and parts.checkpointer.closed
    assert [s for s, _, _ in parts.checkpointer.saved] == [2]


def test_each_step_hands_the_loss_its_settings(compose_config):
    """The CE schedule's weight of each step goes to the loss with the call (nothing is written into
    the module); every micro batch of a step gets the same settings, and the log shows them."""
    parts = _parts(
        compose_config,
        "train.max_steps=4",
        "train.grad_accum_steps=2",
        "train.ce_weight_start=1.0",
        "train.ce_anneal_frac=0.5",
    )
    Trainer(parts).train()
    module = parts.engine.module
    assert [s.ce_weight for s in module.losses] == [1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert all(s == parts.loss.weights_at(i // 2, 4) for i, s in enumerate(module.losses))
    assert parts.loss.ce_weight_start == 1.0 and parts.loss.ce_weight == 0.0  # the recipe's, unchanged
    assert [d["train/ce_weight"] for _, d in parts.logger.logged if "train/ce_weight" in d] == [1.0, 0.5, 0.0, 0.0]
    assert not hasattr(module, "lcfg")
