"""The hidden-state shard format, declared once. ``data_tools.shard_writer`` writes it,
``dspark.shards`` reads it, ``data_tools.verify`` checks it.

Layout of a dataset directory::

    manifest.json                  dataset header + one entry per complete shard
    train/shard-00000.parquet      one row per sequence (schema below)
    train/shard-00000.json         sidecar written after the shard: rows, tokens, sha256, bytes
    val/...

A row holds one sequence of ``num_tokens`` = T token ids (prompt + answer, chat template
applied) and the target states for its first T-1 positions: row t of ``hidden_states`` is the
state after reading ``input_ids[:t+1]``; the last token has no successor to predict, so it
needs no state. ``hidden_states`` is raw little-endian bytes of shape [T-1, n_layers, H] in
the manifest's ``dtype`` (raw bytes decode ~5x faster than Parquet list columns and load
zero-copy into torch). ``loss_mask`` is 1 where the token is part of the answer.

Imports pyarrow, torch and the stdlib only, so it runs in a vLLM-only environment.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import torch

from dspark.core.config import TORCH_DTYPES
from dspark.core.errors import UserError
from dspark.core.files import atomic_write_text

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
STORE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
COMPRESSIONS = ("none", "zstd")

SCHEMA = pa.schema(
    [
        pa.field("seq_id", pa.string(), nullable=False),  # stable id of the prompt (content hash)
        pa.field("num_tokens", pa.int32(), nullable=False),  # T
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),  # [T]
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),  # [T], 1 on answer tokens
        pa.field("hidden_states", pa.large_binary(), nullable=False),  # [T-1, n_layers, H] raw bytes
    ],
    metadata={"dspark_schema_version": str(SCHEMA_VERSION)},
)


class DatasetError(UserError):
    """A dataset directory that is missing, damaged or made differently; the message names the
    directory or file, what is wrong and the command that fixes it."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


@dataclass
class ShardInfo:
    split: str
    name: str
    rows: int
    tokens: int
    bytes: int
    sha256: str
    skipped: dict[str, int] = field(default_factory=dict)
    """Prompts of this shard's slice left out, by reason."""

    @property
    def path(self) -> str:
        return f"{self.split}/{self.name}.parquet"


@dataclass
class Manifest:
    """What a dataset was made from. Resume refuses a directory whose header differs."""

    target: str
    target_path: str
    revision: Optional[str]
    architecture: str
    tokenizer_sha256: str
    chat_template_sha256: str
    layer_ids: list[int]
    """Captured ids, final state last (``layer_id_convention``)."""
    num_hidden_layers: int
    hidden_size: int
    dtype: str
    compression: str
    prompt_set_sha256: str = ""
    """Hash of the ordered prompt ids per split and the generation settings: a resume with
    other prompts would assign different prompts to the same shard names."""
    rows_per_shard: int = 0
    prompt_settings: dict[str, Any] = field(default_factory=dict)
    """The ``data.*`` settings that pick and answer the prompts (what ``prompt_set_sha256``
    depends on besides the source's content), so a refusal can say which one changed. Empty in
    manifests written before they were recorded."""
    layer_id_convention: str = "hf_hidden_states"
    schema_version: int = SCHEMA_VERSION
    shards: list[ShardInfo] = field(default_factory=list)
    complete: bool = False

    HEADER_FIELDS = (
        "schema_version",
        "target",
        "architecture",
        "tokenizer_sha256",
        "chat_template_sha256",
        "layer_ids",
        "layer_id_convention",
        "num_hidden_layers",
        "hidden_size",
        "dtype",
        "prompt_set_sha256",
        "rows_per_shard",
    )

    def header_differences(self, other: "Manifest") -> list[str]:
        """What differs from ``other`` (the directory's manifest), one entry per field; a changed
        prompt set is told by the settings that changed it, where both manifests record them."""
        out = []
        for k in self.HEADER_FIELDS:
            if getattr(self, k) == getattr(other, k):
                continue
            if k == "prompt_set_sha256":
                out += self.prompt_set_differences(other)
            else:
                out.append(f"{k}: directory has {getattr(other, k)!r}, this run has {getattr(self, k)!r}")
        return out

    def prompt_set_differences(self, other: "Manifest") -> list[str]:
        """Why the prompt set differs from ``other``'s: the recorded settings that changed, else
        the hashes and what can change them."""
        old, new = other.prompt_settings, self.prompt_settings
        changed = [
            f"{k}: directory has {_recorded(old, k)}, this run has {_recorded(new, k)}"
            for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)
        ]
        if old and changed:
            return changed
        hashes = (
            f"prompt_set_sha256: directory has '{other.prompt_set_sha256[:8]}...', "
            f"this run has '{self.prompt_set_sha256[:8]}...'"
        )
        if not old:
            return [
                f"{hashes} (the directory's manifest does not record which settings made it; any of "
                f"{', '.join(new) or 'the data.* settings'} or the prompts in data.source may have changed)"
            ]
        return [
            f"{hashes} with the same settings: the prompts that data.source={new.get('data.source')!r} gives have "
            "changed (another file under the same name, or other installed packages for the bundled sources)"
        ]

    @property
    def bytes_per_value(self) -> int:
        return STORE_DTYPES[self.dtype]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise DatasetError(f"{path}: missing file; not a dataset directory written by data_tools.extract")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetError(
                f"{path}: not valid JSON ({e}), expected the manifest data_tools.extract writes"
            ) from None
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            found = data.get("schema_version") if isinstance(data, dict) else type(data).__name__
            raise DatasetError(f"{path}: field 'schema_version' is {found!r}, this code reads {SCHEMA_VERSION}")
        try:
            data["shards"] = [ShardInfo(**s) for s in data.get("shards", [])]
            return cls(**data)
        except TypeError as e:
            raise DatasetError(f"{path}: fields do not match this code's manifest ({e})") from None

    def save(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(directory) / MANIFEST, self.to_json())


def _recorded(settings: dict[str, Any], key: str) -> str:
    return repr(settings[key]) if key in settings else "(not recorded)"


def check_row(row: dict[str, Any], *, n_layers: int, hidden_size: int, bytes_per_value: int) -> Optional[str]:
    """Return what is wrong with one decoded row, or None."""
    t = row["num_tokens"]
    if len(row["input_ids"]) != t or len(row["loss_mask"]) != t:
        return f"input_ids/loss_mask length {len(row['input_ids'])}/{len(row['loss_mask'])} != num_tokens {t}"
    expected = (t - 1) * n_layers * hidden_size * bytes_per_value
    if len(row["hidden_states"]) != expected:
        return (
            f"hidden_states has {len(row['hidden_states'])} bytes, expected {expected} = "
            f"({t}-1)x{n_layers}x{hidden_size}x{bytes_per_value}"
        )
    return None


def decode_hidden_states(
    buf: memoryview | bytes | pa.Buffer, *, dtype: str, n_layers: int, hidden: int
) -> torch.Tensor:
    """Raw little-endian bytes -> [T-1, L, H] without copying (the result must not be written)."""
    with warnings.catch_warnings():  # torch warns that the buffer is read-only; we never write it
        warnings.simplefilter("ignore", UserWarning)
        flat = (
            torch.frombuffer(buf, dtype=TORCH_DTYPES[dtype]) if len(buf) else torch.empty(0, dtype=TORCH_DTYPES[dtype])
        )
    return flat.view(-1, n_layers, hidden)
