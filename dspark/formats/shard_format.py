"""The hidden-state shard format, declared once. ``data_tools.shard_writer`` writes it,
``dspark.data.shards`` reads it, ``data_tools.verify`` checks it. Here: the layout, the Parquet
schema, the manifest and its checks, and the names of the files derived from a shard; a row's
cells and a shard file's checks: :mod:`dspark.formats.shard_rows`.

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

Token-id shards (``data.engine=transformers``, for ``data.mode=colocated``) are the same
format with no captured layer: the manifest's ``layer_ids`` is ``[]`` and every
``hidden_states`` cell is empty.

fp8 dtypes (``float8_e4m3``, ``float8_e5m2``; manifest ``scale_granularity: token_layer``) store
the same cell as the fp8 values [T-1, n_layers, H] followed by their fp32 scales [T-1, n_layers]
(:mod:`dspark.core.fp8`): the Parquet schema is unchanged, so 16/32-bit shards written before
fp8 existed read as before, and a row is still one contiguous cell that loads without a copy
until it is dequantized.

Imports pyarrow, torch and the stdlib only, so it runs in a vLLM-only environment.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from dspark import config
from dspark.config import TORCH_DTYPES
from dspark.core import fp8
from dspark.core.atomic_files import atomic_write_text
from dspark.core.errors import UserError
from dspark.core.file_reads import read_json

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
STORE_DTYPES = {
    name: (fp8.FORMATS[name].torch_dtype if name in fp8.FORMATS else TORCH_DTYPES[name]).itemsize
    for name in config.STORE_DTYPES
}
"""Store dtype (:data:`dspark.config.STORE_DTYPES`) -> bytes per stored value."""
SCALE_GRANULARITIES = {"none": 0, "token_layer": fp8.SCALE_BYTES}
"""Scale layout -> scale bytes per (token, captured layer); fp8 dtypes need ``token_layer``."""
COMPRESSIONS = config.COMPRESSIONS

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
    scale_granularity: str = "none"
    """``token_layer`` for fp8 dtypes (an fp32 scale per token and captured layer after the
    values, :mod:`dspark.core.fp8`), ``none`` otherwise and in manifests written before fp8."""
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
        "scale_granularity",
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

    @property
    def bytes_per_token(self) -> int:
        """Raw bytes of one token's states, scales included (the floor compression works from)."""
        return bytes_per_token(self.dtype, n_layers=len(self.layer_ids), hidden=self.hidden_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise DatasetError(f"{path}: missing file; not a dataset directory written by data_tools.extract")
        data = read_json(path, expected="expected the manifest data_tools.extract writes", error=DatasetError)
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            found = data.get("schema_version") if isinstance(data, dict) else type(data).__name__
            raise DatasetError(f"{path}: field 'schema_version' is {found!r}, this code reads {SCHEMA_VERSION}")
        problem = manifest_problem(data)
        if problem:
            raise DatasetError(f"{path}: {problem}")
        try:
            data["shards"] = [ShardInfo(**s) for s in data.get("shards", [])]
            manifest = cls(**data)
        except TypeError as e:
            raise DatasetError(f"{path}: fields do not match this code's manifest ({e})") from None
        bad = manifest.format_problem()
        if bad:
            raise DatasetError(f"{path}: {bad}")
        return manifest

    def format_problem(self) -> Optional[str]:
        """What is wrong with the recorded value format (dtype and scale layout), or None."""
        if self.dtype not in STORE_DTYPES:
            return f"field 'dtype' is {self.dtype!r}, this code reads {list(STORE_DTYPES)}"
        want = scale_granularity_of(self.dtype)
        if self.scale_granularity != want:
            return (
                f"field 'scale_granularity' is {self.scale_granularity!r}, dtype {self.dtype!r} is stored with {want!r}"
            )
        return None

    def save(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(directory) / MANIFEST, self.to_json())


_STR, _INT = (str,), (int,)
MANIFEST_FIELDS: dict[str, tuple[tuple[type, ...], Optional[int]]] = {
    # field: (JSON types, minimum for integers)
    "target": (_STR, None),
    "target_path": (_STR, None),
    "revision": ((str, type(None)), None),
    "architecture": (_STR, None),
    "tokenizer_sha256": (_STR, None),
    "chat_template_sha256": (_STR, None),
    "layer_ids": ((list,), None),
    "num_hidden_layers": (_INT, 1),
    "hidden_size": (_INT, 1),
    "dtype": (_STR, None),
    "compression": (_STR, None),
    "scale_granularity": (_STR, None),
    "prompt_set_sha256": (_STR, None),
    "rows_per_shard": (_INT, 0),
    "prompt_settings": ((dict,), None),
    "layer_id_convention": (_STR, None),
    "schema_version": (_INT, None),
    "shards": ((list,), None),
    "complete": ((bool,), None),
}
SHARD_FIELDS: dict[str, tuple[tuple[type, ...], Optional[int]]] = {
    "split": (_STR, None),
    "name": (_STR, None),
    "rows": (_INT, 0),  # a shard whose prompts were all left out is written, empty
    "tokens": (_INT, 0),
    "bytes": (_INT, 1),
    "sha256": (_STR, None),
    "skipped": ((dict,), None),
}
_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def field_problem(where: str, key: str, value: Any, types: tuple[type, ...], minimum: Optional[int]) -> Optional[str]:
    """A JSON field's value against its types (a bool is no integer) and, for integers, a minimum."""
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        want = " or ".join("null" if t is type(None) else {"str": "a string", "int": "an integer"}.get(
            t.__name__, f"a {t.__name__}") for t in types)  # fmt: skip
        return f"{where}'{key}' is {value!r:.60}, expected {want}"
    if minimum is not None and value < minimum:
        return f"{where}'{key}' is {value}, expected an integer >= {minimum}"
    return None


def layer_ids_problem(where: str, ids: list[Any], key: str = "layer_ids") -> Optional[str]:
    """Captured layer ids must be integers >= 0 ([] for token-id shards)."""
    if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return None
    return f"{where}'{key}' is {ids!r:.80}, expected a list of integers >= 0"


def manifest_problem(data: dict[str, Any]) -> Optional[str]:
    """What is wrong with a manifest read as JSON, checked as data before any of it is used (None:
    nothing): each field's type and range, layer ids as integers, and every shard entry's, whose
    name must be a plain name inside the dataset (no path separators, no ``..``, not hidden: a
    name is joined to the dataset directory to read the shard and to write its cache)."""
    for key, (types, minimum) in MANIFEST_FIELDS.items():
        if key in data:
            problem = field_problem("field ", key, data[key], types, minimum)
            if problem:
                return problem
    problem = layer_ids_problem("field ", data.get("layer_ids", []))
    if problem:
        return problem
    seen: dict[tuple[str, str], int] = {}
    for n, shard in enumerate(data.get("shards", [])):
        where = f"shards[{n}]."
        if not isinstance(shard, dict):
            return f"shards[{n}] is {shard!r:.60}, expected an object"
        for key, (types, minimum) in SHARD_FIELDS.items():
            if key not in shard and key != "skipped":
                return f"{where}'{key}' missing"
            if key in shard:
                problem = field_problem(where, key, shard[key], types, minimum)
                if problem:
                    return problem
        if shard["split"] not in SPLITS:
            return f"{where}'split' is {shard['split']!r}, expected one of {list(SPLITS)}"
        if not _SHARD_NAME.fullmatch(shard["name"]) or ".." in shard["name"]:
            return (
                f"{where}'name' is {shard['name']!r}, expected a plain file name inside the dataset (letters, digits, "
                "'_', '.', '-'; no path separators or '..'), as data_tools.extract writes: shard-00000"
            )
        if not _SHA256.fullmatch(shard["sha256"]):
            return f"{where}'sha256' is {shard['sha256']!r:.80}, expected 64 lowercase hex digits"
        key = (shard["split"], shard["name"])
        if key in seen:  # one file read twice would train on its sequences twice
            return (
                f"{where}'name' is {shard['name']!r} in split {shard['split']!r}, already listed as "
                f"shards[{seen[key]}]; expected each shard listed once"
            )
        seen[key] = n
    return None


CACHE_DIR = ".arrow_cache"


def cache_path(directory: Path, info: ShardInfo) -> Path:
    """Where a shard's Arrow cache is: named by the SHA-256 its shard was verified against."""
    return Path(directory) / CACHE_DIR / info.split / f"{info.name}-{info.sha256[:16]}.verified.arrow"


def shard_source(info: ShardInfo) -> str:
    """A shard's identity, as the records of the files derived from it name it
    (:mod:`dspark.core.derived_files`'s ``source``): its path in the dataset and its SHA-256."""
    return f"{info.path} sha256 {info.sha256}"


ARROW_CACHE_BUILDER = "Arrow IPC cache of the verified shard, record batches of 16 rows"


def arrow_cache_source(info: ShardInfo) -> str:
    """What a shard's Arrow cache must have been built from: the shard and the builder."""
    return f"{shard_source(info)}; {ARROW_CACHE_BUILDER}"


def topk_source(info: ShardInfo, *, k: int, rule: str, head_id: str) -> str:
    """A target top-k cache's source (:mod:`dspark.data.target_topk`): the shard, and the target head
    and positions its top k came from."""
    return f"{shard_source(info)}; target top-{k} at the {rule} positions, head {head_id}"


TOPK_NAME = re.compile(
    r"^(?P<shard>.+)-(?P<sha>[0-9a-f]{12})-k(?P<k>[0-9]+)-(?P<rule>[a-z]+)-(?P<head>.+)\.safetensors$"
)
"""A top-k cache's file name (``TargetTopK.path``: NAME-SHA12-kK-RULE-HEAD.safetensors), read back by
``data_tools.verify`` to find the shard it must be bound to."""


def stale_caches(directory: Path, manifest: Manifest) -> list[Path]:
    """Arrow caches under the dataset that no shard of ``manifest`` would read: another version of a
    shard, or a cache built before shards were verified (``NAME-SHA12.arrow``)."""
    wanted = {cache_path(directory, info) for info in manifest.shards}
    root = Path(directory) / CACHE_DIR
    return sorted(p for p in root.rglob("*.arrow") if p not in wanted) if root.is_dir() else []


def _recorded(settings: dict[str, Any], key: str) -> str:
    return repr(settings[key]) if key in settings else "(not recorded)"


def scale_granularity_of(dtype: str) -> str:
    return "token_layer" if dtype in fp8.FORMATS else "none"


def bytes_per_token(dtype: str, *, n_layers: int, hidden: int) -> int:
    """Bytes one token's states take in a row: values, then the scales of fp8 dtypes."""
    return n_layers * (hidden * STORE_DTYPES[dtype] + SCALE_GRANULARITIES[scale_granularity_of(dtype)])
