"""The whole composed tree (:class:`RunConfig`, the schema ``conf/config.yaml`` starts from), its
checks across groups, and :func:`load_config`, which every entry point calls right after composing
and before any stage starts: unknown keys refused, the target's open fields read from its
checkpoint, every group's checks run, the typed :class:`RunConfig` returned."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from dspark.config.checks import ConfigError, _check, _choice, _unresolved
from dspark.config.data import DataConfig
from dspark.config.deepspeed import DeepSpeedConfig
from dspark.config.drafter import DSparkConfig, drafter_tag
from dspark.config.eval import EvalConfig
from dspark.config.export import ExportConfig
from dspark.config.logging_paths import LoggingConfig, PathsConfig
from dspark.config.serve_bench import ServeBenchConfig
from dspark.config.target import TargetConfig, resolve_target_config, target_name_from_path
from dspark.config.train import TrainConfig
from dspark.core.errors import closest_key, exit_on_user_error, renamed_key_message
from dspark.core.path_env import default_cache_dir
from dspark.families import FAMILIES

STAGES = ("extract", "train", "export", "eval", "serve_bench")
"""Every stage ``stages=[...]`` may name, in the order the main job runs them."""
DEFAULT_STAGES = ("extract", "train", "export", "eval")
"""What ``python train.py`` runs unless told: the serving benchmark (minutes per configuration
and concurrency level) is asked for by name."""


@dataclass
class RunConfig:
    """The whole composed tree, as every stage receives it."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DSparkConfig = field(default_factory=DSparkConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    tags: list[str] = field(default_factory=list)
    serve_bench: ServeBenchConfig = field(default_factory=ServeBenchConfig)
    stages: list[str] = field(default_factory=lambda: list(DEFAULT_STAGES))
    """What ``python train.py`` runs, in this order; e.g. stages=[train]; serve_bench is asked for
    by name (stages=[extract,train,export,eval,serve_bench]). A stage that reads the exports (eval,
    serve_bench) brings the export stage before it, a no-op when exports.json is up to date."""
    ablation_dir: Optional[str] = None
    """Set by :func:`load_config`: where this config's Markov-off ablation trains (its
    ``train.checkpoint_dir`` with drafter.markov_rank=0); None for a Markov-off run."""

    def __post_init__(self) -> None:
        for s in self.stages:
            _choice("stages[]", s, STAGES)
        _check(
            _unresolved(self.eval.gamma) or self.eval.gamma <= self.drafter.block_size,
            "eval.gamma",
            self.eval.gamma,
            f"expected at most drafter.block_size={self.drafter.block_size} (the drafter drafts that many per pass)",
        )
        init = self.train.init_from_target_layers
        _check(
            init is None or self.train.init_from is None,
            "train.init_from",
            self.train.init_from,
            f"expected null with train.init_from_target_layers={init} (one initialisation, not two)",
        )
        if init is not None:
            able = " or ".join(f"drafter.family={n}" for n, f in FAMILIES.items() if f.inits_from_target_layers)
            _check(
                FAMILIES[self.drafter.family].inits_from_target_layers,
                "train.init_from_target_layers",
                init,
                f"implemented for {able} only (a family whose layers take the target's decoder layers), "
                f"this drafter is {self.drafter.family!r}; expected null",
            )
            _check(
                len(init) == self.drafter.num_layers and min(init) >= 0,
                "train.init_from_target_layers",
                init,
                f"expected drafter.num_layers={self.drafter.num_layers} target layer ids >= 0",
            )
        _check(
            self.train.markov_init == "zeros" or self.drafter.markov_rank > 0,
            "train.markov_init",
            self.train.markov_init,
            "expected zeros with drafter.markov_rank=0 (this drafter has no Markov head to initialise)",
        )
        ctx = self.drafter.target_layer_ids
        if ctx is not None and self.target.layer_ids is not None:
            _check(
                set(ctx) <= set(self.target.layer_ids),
                "drafter.target_layer_ids",
                ctx,
                f"expected a subset of target.layer_ids={self.target.layer_ids}",
            )

        if self.data.mode == "online":
            self._check_online()
            _check(
                self.drafter.draft_vocab_size is None,
                "drafter.draft_vocab_size",
                self.drafter.draft_vocab_size,
                "expected null with data.mode=online: the draft vocabulary is built from the training split's "
                "answers before the first step, and a streamed run has none yet; train it offline or colocated",
            )
        if self.data.mode == "colocated":
            _check(
                self.train.target_topk == 0,
                "train.target_topk",
                self.train.target_topk,
                "expected 0 with data.mode=colocated (the target's distribution comes from the final states the "
                "colocated target computes every step; there is no stored dataset to cache it for); set "
                "train.target_topk=0",
            )
        elif self.data.engine == "transformers" and "train" in self.stages:
            _check(
                False,
                "data.engine",
                self.data.engine,
                f"writes token-id shards (no states), which data.mode={self.data.mode} cannot train on; expected "
                "data.mode=colocated, or data.engine=vllm to capture states",
            )

    def _check_online(self) -> None:
        mb, new = self.train.micro_batch_size, self.data.online.new_per_micro_batch
        if new is not None:
            _check(
                new <= mb,
                "data.online.new_per_micro_batch",
                new,
                f"expected at most train.micro_batch_size={mb} (the new sequences train in their micro batch)",
            )
        _check(
            self.data.online.window_size >= mb,
            "data.online.window_size",
            self.data.online.window_size,
            f"expected at least train.micro_batch_size={mb}",
        )

    def new_per_micro_batch(self) -> int:
        """Sequences entering the online window per micro batch (``data.online.new_per_micro_batch``)."""
        new = self.data.online.new_per_micro_batch
        return new if new is not None else (self.train.micro_batch_size + 1) // 2

    def context_layer_ids(self) -> list[int]:
        """The target layers the drafter reads as context, in fc input order."""
        return list(self.drafter.target_layer_ids or self.target.layer_ids or [])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def unknown_keys(node: Any, schema: type, prefix: str = "") -> list[str]:
    """Keys of ``node`` (a composed tree, unresolved) that ``schema``'s dataclass tree does not
    have: what ``+group.key=...`` adds and Hydra accepts (``+`` adds a key to any node). A field
    typed as a dict (engine kwargs, W&B settings) takes any key."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    out = []
    for key in node.keys() if OmegaConf.is_dict(node) else []:
        key = str(key)
        if key not in names:
            out.append(prefix + key)
            continue
        hint = hints[key]
        args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is not None else []
        sub = hint if dataclasses.is_dataclass(hint) else next((a for a in args if dataclasses.is_dataclass(a)), None)
        child = node._get_node(key)
        if sub is not None and OmegaConf.is_dict(child):
            out += unknown_keys(child, sub, f"{prefix}{key}.")
    return out


def _unknown_key_error(cfg: Any) -> Optional[ConfigError]:
    bad = unknown_keys(cfg, RunConfig)
    if not bad:
        return None
    moved = [m for m in map(renamed_key_message, bad) if m]
    if moved:
        return ConfigError("; ".join(moved))
    parts = []
    for key in bad:
        close = closest_key(cfg, key, exclude=bad)
        parts.append(f"{key} (did you mean {close}?)" if close else key)
    return ConfigError(
        f"unknown config key(s): {', '.join(parts)}; '+KEY=VALUE' adds a key Hydra does not check, and nothing "
        "reads it. Every key: python train.py --help"
    )


def load_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The composed tree -> a validated :class:`RunConfig` (every ``__post_init__`` check runs).
    Entry points call this before any stage starts; a bad value or a key the schema does not have
    (``+train.lrr=1``) raises :class:`ConfigError`."""
    if isinstance(cfg, RunConfig):
        return cfg
    err = _unknown_key_error(cfg)
    if err is not None:
        raise err
    if not OmegaConf.is_config(cfg) or OmegaConf.get_type(cfg) is not RunConfig:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    cfg = resolve_target_config(cfg)
    run = OmegaConf.to_object(cfg)
    assert isinstance(run, RunConfig)
    if run.drafter.markov_rank > 0:
        off = OmegaConf.merge(cfg, {"drafter": {"markov_rank": 0}})
        if off.train.checkpoint_dir != run.train.checkpoint_dir:  # a fixed train.run_name names both alike
            run.ablation_dir = str(off.train.checkpoint_dir)
    return run


def config_fingerprint(obj: Any) -> str:
    """A short stable hash of a JSON-able settings tree (what a cached result depends on)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_or_exit(cfg: DictConfig) -> RunConfig:
    """:func:`load_config` for a command's entry point: a bad value ends the command with exit
    status 2 and one line naming the key, the value and what is allowed, before any stage starts
    (:func:`~dspark.core.errors.exit_on_user_error`)."""
    with exit_on_user_error():
        return load_config(cfg)


def register_configs() -> None:
    """Register the root schema (``conf/config.yaml`` starts from it) and the resolvers."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    OmegaConf.register_new_resolver("drafter_tag", drafter_tag, replace=True)
    OmegaConf.register_new_resolver("dspark_cache_dir", default_cache_dir, replace=True)
    OmegaConf.register_new_resolver("dspark_target_name", target_name_from_path, replace=True)


register_configs()
