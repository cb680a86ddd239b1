"""The ``deepspeed`` group (``conf/deepspeed/zero*.yaml``): what ``deepspeed.initialize`` gets
besides what the trainer adds from ``train``. Nothing here imports DeepSpeed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from dspark.config.checks import _choice


@dataclass
class ZeroConfig:
    """DeepSpeed's ``zero_optimization`` section; None leaves a knob at DeepSpeed's default."""

    stage: int = 0
    overlap_comm: Optional[bool] = None
    contiguous_gradients: Optional[bool] = None
    reduce_scatter: Optional[bool] = None
    reduce_bucket_size: Optional[float] = None
    allgather_bucket_size: Optional[float] = None
    stage3_prefetch_bucket_size: Optional[float] = None
    stage3_param_persistence_threshold: Optional[float] = None
    stage3_gather_16bit_weights_on_model_save: Optional[bool] = None

    def __post_init__(self) -> None:
        _choice("deepspeed.zero_optimization.stage", self.stage, (0, 1, 2, 3))


@dataclass
class DeepSpeedConfig:
    """What ``deepspeed.initialize(config=...)`` gets, after the trainer adds batch sizes, clipping
    and precision from ``train``."""

    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other key of DeepSpeed's config, passed as is (e.g. ``{activation_checkpointing: ...}``)."""

    def to_dict(self) -> dict[str, Any]:
        zero = {k: v for k, v in asdict(self.zero_optimization).items() if v is not None}
        return {**self.extra, "zero_optimization": zero}
