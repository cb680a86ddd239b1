"""Typed configuration: every config group's schema and the one home of every default.

:class:`RunConfig` is the schema of the whole Hydra tree (``conf/config.yaml`` starts from it), so
a typo or a wrong type fails when Hydra composes, naming the key. Ranges and choices are checked by
:func:`load_config`, which every entry point calls right after composing and before any stage
starts; it returns the typed :class:`RunConfig` that the stages receive. The yaml files in
``conf/`` list only what a preset changes.

One module per config group, as ``conf/`` has them, each group's keys with their defaults,
docstrings and checks: :mod:`.target`, :mod:`.drafter` (composed from every drafter family's
fields, :mod:`dspark.families`), :mod:`.data` (with its extraction engine's and the online
stream's), :mod:`.train` (the loss's settings and the trainer's), :mod:`.deepspeed`, :mod:`.export`, :mod:`.eval`,
:mod:`.serve_bench`, :mod:`.logging_paths`; the checks they share in :mod:`.checks`; the whole
tree, its checks across groups and :func:`load_config` in :mod:`.run`. Everything is imported
from here (``from dspark.config import RunConfig``); importing this package registers the
schema with Hydra. Beside the schema: :mod:`.compose` (``python -m dspark.config.compose``: a
run's config composed and checked, running nothing) and :mod:`.wandb_run` (the W&B run each stage
opens from it), neither imported here.
"""

from dspark.config.checks import (
    DTYPES,
    FP8_STORE_DTYPES,
    STORE_DTYPES,
    TORCH_DTYPES,
    ConfigError,
    _at_least,
    _check,
    _choice,
    _compute_dtype,
    _dir_name,
    _refuse_fp8,
    _unresolved,
)
from dspark.config.data import (
    COMPRESSIONS,
    DATA_ENGINES,
    DATA_MODES,
    ON_OVERLONG,
    DataConfig,
    ExtractEngineConfig,
    OnlineConfig,
)
from dspark.config.deepspeed import DeepSpeedConfig, ZeroConfig
from dspark.config.drafter import _TAG_NAMES, _TAG_SPELLED, MARKOV_HEAD_TYPES, DSparkConfig, drafter_tag
from dspark.config.eval import (
    EVAL_PARTS,
    EVAL_SOURCES,
    GGUF_TYPES,
    LLAMA_CPP_TARGETS,
    LLAMA_CPP_USE,
    REFERENCE_PROPOSERS,
    SERVE_EXPORT,
    EvalConfig,
    eval_fields,
)
from dspark.config.export import ExportConfig
from dspark.config.logging_paths import WANDB_MODES, LoggingConfig, PathsConfig
from dspark.config.run import (
    DEFAULT_STAGES,
    STAGES,
    RunConfig,
    _unknown_key_error,
    config_fingerprint,
    load_config,
    load_or_exit,
    register_configs,
    unknown_keys,
)
from dspark.config.serve_bench import ServeBenchConfig
from dspark.config.target import (
    TARGET_SOURCES,
    TargetConfig,
    _config_int,
    _layer_ids_or_spread,
    resolve_target_config,
    target_name_from_path,
)
from dspark.config.train import FINAL_NORM_INITS, MARKOV_INITS, SUPERVISE, LossSettings, TrainConfig
from dspark.core.path_env import default_cache_dir

__all__ = [
    # the whole tree and its loading
    "RunConfig",
    "load_config",
    "load_or_exit",
    "register_configs",
    "unknown_keys",
    "config_fingerprint",
    "resolve_target_config",
    "target_name_from_path",
    "STAGES",
    "DEFAULT_STAGES",
    # the groups
    "TargetConfig",
    "TARGET_SOURCES",
    "DSparkConfig",
    "MARKOV_HEAD_TYPES",
    "drafter_tag",
    "DataConfig",
    "ExtractEngineConfig",
    "OnlineConfig",
    "COMPRESSIONS",
    "DATA_ENGINES",
    "DATA_MODES",
    "ON_OVERLONG",
    "LossSettings",
    "TrainConfig",
    "FINAL_NORM_INITS",
    "MARKOV_INITS",
    "SUPERVISE",
    "DeepSpeedConfig",
    "ZeroConfig",
    "ExportConfig",
    "EvalConfig",
    "EVAL_PARTS",
    "eval_fields",
    "EVAL_SOURCES",
    "GGUF_TYPES",
    "LLAMA_CPP_TARGETS",
    "LLAMA_CPP_USE",
    "REFERENCE_PROPOSERS",
    "SERVE_EXPORT",
    "ServeBenchConfig",
    "LoggingConfig",
    "PathsConfig",
    "WANDB_MODES",
    "default_cache_dir",
    # shared by the groups
    "ConfigError",
    "DTYPES",
    "FP8_STORE_DTYPES",
    "STORE_DTYPES",
    "TORCH_DTYPES",
    # private, importable from here as they were from the single module (tests read some)
    "_TAG_NAMES",
    "_TAG_SPELLED",
    "_at_least",
    "_check",
    "_choice",
    "_compute_dtype",
    "_config_int",
    "_dir_name",
    "_layer_ids_or_spread",
    "_refuse_fp8",
    "_unknown_key_error",
    "_unresolved",
]
