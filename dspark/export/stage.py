"""The export stage: this run's checkpoints -> every layout vLLM can serve the drafter in, each
checked with vLLM's own classes, listed in ``<export.out_dir>/exports.json``.

    python train.py +experiment=smollm2_cpu_demo stages=[export]     # export (and check) a finished run
    python train.py +experiment=... stages=[export] export.checkpoint=PATH export.dtype=bfloat16

The record is what the eval, the serving benchmark and the other nodes of a multi-node engine read
(:func:`read_exports`): none of them exports. The stage is a no-op when the record already lists
exports of the same checkpoint files at the same settings, with their files as written; it holds
``export.out_dir`` while it writes, so a second export or an eval on it is refused naming the first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from dspark.checkpoint_tags import checkpoint_model_file, latest_tag
from dspark.checkpoint_weights import TrainingCheckpoint, load_training_checkpoint
from dspark.config import RunConfig, config_fingerprint
from dspark.core.atomic_files import atomic_write_json
from dspark.core.errors import UserError
from dspark.core.file_reads import read_json
from dspark.core.locks import holding
from dspark.core.waits import WaitTimedOut
from dspark.export import EXPORT_FILES, ExportSummary, existing_export, export, exported_layout
from dspark.export.vllm_format import CONFIG_FILE, EXPORT_FORMAT_VERSION, WEIGHTS_FILE, drafter_layouts

log = logging.getLogger(__name__)

RECORD_FILE = "exports.json"
RECORD_VERSION = 2  # 2: the windows the eval warns from
EXPORT_WAIT_S = 3600
"""How long the other nodes of a multi-node engine wait for node 0's export."""


class ExportRecordError(UserError):
    """No usable export record where a stage reads one: it names the file and the command."""


@dataclass
class ExportRecord:
    """What the export stage wrote and checked: ``exports[who][layout]`` for ``who`` in ours (this
    run's checkpoint) and ablation (its Markov-off run, when the eval compares it), the checkpoint
    each came from, and how each export was checked."""

    path: Path  # exports.json
    fingerprint: str
    sources: dict[str, Path]
    exports: dict[str, dict[str, ExportSummary]]
    checks: dict[str, str]  # export directory -> how it was checked
    files: dict[str, dict[str, Optional[list[int]]]] = field(default_factory=dict)
    """export directory -> file name -> [size, mtime_ns] as the stage wrote it"""
    windows: dict[str, list[Optional[int]]] = field(default_factory=dict)
    """who -> [drafter.attention_window, the train.max_seq_len it was trained on (None where its
    checkpoint does not say)]: what the eval's long-context warning reads"""

    def export_dir(self, who: str = "ours", layout: str = "dspark") -> Path:
        return self.exports[who][layout].out_dir

    def summary_line(self) -> str:
        n = sum(len(v) for v in self.exports.values())
        what = ", ".join(f"{who} {'+'.join(sorted(v))}" for who, v in self.exports.items())
        checked = sum(c.startswith("vLLM") for c in self.checks.values())
        return f"{n} exports ({what}), {checked} checked with vLLM's classes -> {self.path}"


# --- which checkpoints --------------------------------------------------------------------------


def export_checkpoint(cfg: RunConfig) -> Path:
    """``export.checkpoint``, or this run's ``train.checkpoint_dir``."""
    return Path(cfg.export.checkpoint or cfg.train.checkpoint_dir).expanduser()


def ablation_checkpoint(cfg: RunConfig) -> Optional[Path]:
    """``eval.ablation_checkpoint``: a path, null, or auto = the Markov-off run of this very
    config (``RunConfig.ablation_dir``: what ``python train.py +experiment=...
    drafter.markov_rank=0`` trains), when it has been trained."""
    value = cfg.eval.ablation_checkpoint
    if value is None or value in ("", "null", "none"):
        return None
    if value != "auto":
        return Path(value).expanduser()
    if cfg.ablation_dir is None:
        return None  # this run is the ablation
    path = Path(cfg.ablation_dir).expanduser()
    return path if latest_tag(path) is not None else None


def sources(cfg: RunConfig) -> dict[str, Path]:
    """The checkpoints this run exports: ours, and the ablation the eval compares beside it."""
    out = {"ours": export_checkpoint(cfg)}
    ablation = ablation_checkpoint(cfg)
    if ablation is not None:
        out["ablation"] = ablation
    return out


def is_drafter_dir(path: Path) -> bool:
    """A trained drafter's directory (our export, or a speculators DSpark checkpoint: a
    ``config.json`` beside its weights), not a DeepSpeed checkpoint."""
    return (path / CONFIG_FILE).is_file() and latest_tag(path) is None


def checkpoint_file(path: Path) -> Path:
    """The file a checkpoint's drafter is read from (what the record and the eval's fingerprint hash)."""
    return path / WEIGHTS_FILE if is_drafter_dir(path) else checkpoint_model_file(path)


def read_checkpoint(cfg: RunConfig, path: Path) -> TrainingCheckpoint:
    """A DeepSpeed checkpoint (its directory or a tag), or a trained drafter's directory
    (:func:`is_drafter_dir`), read as it is: its weights, block and context layers, served against
    this run's target (the export checks the layer ids against it, vLLM's loader the sizes)."""
    if not is_drafter_dir(path):
        return load_training_checkpoint(path)
    from dspark.export.speculators_format import read_drafter_dir

    d = read_drafter_dir(path)
    run_config = {
        "target": asdict(cfg.target),
        "train": {"dtype": "float32"},
        "paths": {"cache_dir": cfg.paths.cache_dir},
    }
    return TrainingCheckpoint(path, 0, d.drafter, d.dims, d.weights, run_config, 0, d.context_layer_ids)


def export_path(cfg: RunConfig, who: str, layout: str) -> Path:
    """Where the ``layout`` export of ``who`` goes ("ours" is written under the prefix "dspark",
    the ablation under "ablation"); multi-node serving nodes wait for it."""
    prefix = "dspark" if who == "ours" else who
    return Path(cfg.export.out_dir).expanduser() / f"{prefix}-{layout}"


def fingerprint(cfg: RunConfig, checkpoints: dict[str, Path]) -> str:
    """What the exports depend on: each checkpoint's file (path, size, mtime), the export's
    settings, the target, the draft tokens vLLM checks them at, and the export format."""
    files = {}
    for who, c in checkpoints.items():
        f = checkpoint_file(c)
        st = f.stat()
        files[who] = [str(f.resolve()), st.st_size, st.st_mtime_ns]
    return config_fingerprint(
        {
            "files": files,
            "dtype": cfg.export.dtype,
            "out_dir": str(Path(cfg.export.out_dir).expanduser().absolute()),
            "target": asdict(cfg.target),
            "gamma": cfg.eval.gamma,
            "format": [EXPORT_FORMAT_VERSION, RECORD_VERSION],
        }
    )


# --- the stage ------------------------------------------------------------------------------------


def run_export(cfg: RunConfig, target_dir: Path) -> ExportRecord:
    """Export (and check) this run's checkpoints, unless ``exports.json`` already lists them at
    these settings with their files as written; write the record last."""
    out_dir = Path(cfg.export.out_dir).expanduser()
    checkpoints = sources(cfg)
    for who, c in checkpoints.items():
        if not c.exists():
            key = "export.checkpoint" if who == "ours" else "eval.ablation_checkpoint"
            raise ExportRecordError(
                f"export: no checkpoint at {c}; train it first (stages=[train]) or set {key} to a checkpoint "
                "or a drafter directory"
            )
    with holding(out_dir, key="export.out_dir", what="export"):
        fp = fingerprint(cfg, checkpoints)
        earlier = _read_record(out_dir / RECORD_FILE, quiet=True)
        if earlier is not None and earlier.fingerprint == fp and not _changed_files(earlier):
            log.info("export: %s is up to date (same checkpoint files and settings), skipped", earlier.path)
            return earlier
        t0 = time.perf_counter()
        exports, checks, windows = {}, {}, {}
        for who, c in checkpoints.items():
            if who == "ablation":
                log.info("Markov-off ablation: %s", c)
            exports[who], windows[who] = export_all(cfg, who, c, target_dir, checks)
        files = {
            str(s.out_dir): {n: _stat(s.out_dir / n) for n in EXPORT_FILES}
            for v in exports.values()
            for s in v.values()
        }
        record = ExportRecord(out_dir / RECORD_FILE, fp, checkpoints, exports, checks, files, windows)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(record.path, _record_json(record), indent=2)
        log.info("export: %s in %.1f s", record.summary_line(), time.perf_counter() - t0)
        return record


def export_all(
    cfg: RunConfig, who: str, ckpt_path: Path, target_dir: Path, checks: dict[str, str]
) -> tuple[dict[str, ExportSummary], list[Optional[int]]]:
    """Every layout the drafter can be served in (the dspark one always, the dflash one where the
    drafter has it), each checked with vLLM's own classes at ``eval.gamma`` draft tokens (where
    vLLM is installed). A drafter directory that is itself an export of ours is listed as it is,
    never exported again (into itself). Also the drafter's attention window and the sequence
    length it was trained on (:attr:`ExportRecord.windows`)."""
    ckpt = read_checkpoint(cfg, ckpt_path)
    trained = ((ckpt.run_config or {}).get("train") or {}).get("max_seq_len")
    window = [ckpt.drafter.attention_window, trained if isinstance(trained, int) else None]
    own = exported_layout(ckpt_path) if is_drafter_dir(ckpt_path) else None
    out = {}
    for layout in drafter_layouts(ckpt.drafter):
        if layout == own:
            s = existing_export(ckpt, layout)
            log.info("export.checkpoint=%s is a %s export: listed as it is, not exported again", ckpt_path, layout)
        else:
            s = export(
                ckpt, export_path(cfg, who, layout), layout=layout, dtype=cfg.export.dtype, target_dir=target_dir
            )
        log.info("%s", s.render())
        checks[str(s.out_dir)] = _check(s.out_dir, target_dir, cfg.eval.gamma)
        out[layout] = s
    return out, window


def _check(d: Path, target_dir: Path, gamma: int) -> str:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # a GPU node with torch and transformers only
        log.warning(
            "vLLM is not installed here: %s is not checked with vLLM's classes; check it where vLLM is: "
            "python -m dspark.export validate %s",
            d,
            d,
        )
        return "not checked: vLLM is not installed here"
    from dspark.export.validate import validate

    log.info("%s", validate(d, target_dir=target_dir, num_speculative_tokens=gamma).render())
    return f"vLLM classes, {gamma} draft tokens: ok"


# --- the record -----------------------------------------------------------------------------------


def read_exports(cfg: RunConfig) -> ExportRecord:
    """This run's export record, as the export stage last wrote it for these checkpoints and
    settings: what every reader of the exports starts from. One error, naming the file and the
    command, when there is none, it is unreadable, or it lists other checkpoint files."""
    path = Path(cfg.export.out_dir).expanduser() / RECORD_FILE
    record = _read_record(path)
    assert record is not None
    rerun = "run the export stage: python train.py +experiment=... stages=[export] (with the same settings)"
    checkpoints = sources(cfg)
    missing = [str(c) for c in checkpoints.values() if not c.exists()]
    if missing:
        raise ExportRecordError(f"{path}: the checkpoint {missing[0]} it should list is not there; {rerun}")
    if record.fingerprint != fingerprint(cfg, checkpoints):
        raise ExportRecordError(
            f"{path}: lists exports of other checkpoint files or settings than this run's "
            f"({', '.join(map(str, checkpoints.values()))}, export.dtype={cfg.export.dtype}); {rerun}"
        )
    changed = _changed_files(record)
    if changed:
        raise ExportRecordError(f"{path}: {changed}; {rerun}")
    return record


def _record_json(record: ExportRecord) -> dict[str, Any]:
    def summary(s: ExportSummary) -> dict[str, Any]:
        d = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(s).items()}
        d["files"] = record.files.get(str(s.out_dir), {})
        d["check"] = record.checks.get(str(s.out_dir), "")
        return d

    return {
        "record_version": RECORD_VERSION,
        "fingerprint": record.fingerprint,
        "sources": {who: str(p) for who, p in record.sources.items()},
        "exports": {who: {layout: summary(s) for layout, s in v.items()} for who, v in record.exports.items()},
        "windows": record.windows,
    }


def _stat(path: Path) -> Optional[list[int]]:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


_SUMMARY_FIELDS = {f.name for f in fields(ExportSummary)}


def _read_record(path: Path, *, quiet: bool = False) -> Optional[ExportRecord]:
    """``exports.json`` read back; ``quiet``: None where there is none or it is unreadable (the
    stage writes it again), else one :class:`ExportRecordError` naming the file and the field."""
    rerun = "run the export stage first: python train.py +experiment=... stages=[export]"
    if not path.is_file():
        if quiet:
            return None
        raise ExportRecordError(f"{path}: no export record (nothing exported there yet); {rerun}")
    try:
        d = read_json(path, expected="the export stage's record", error=ExportRecordError)
        if not isinstance(d, dict) or d.get("record_version") != RECORD_VERSION:
            raise ExportRecordError(
                f"{path}: field 'record_version' is {d.get('record_version') if isinstance(d, dict) else d!r}; "
                f"expected {RECORD_VERSION}; {rerun}"
            )
        exports, checks, files = {}, {}, {}
        for who, layouts in d["exports"].items():
            exports[who] = {}
            for layout, s in layouts.items():
                kw = {k: v for k, v in s.items() if k in _SUMMARY_FIELDS}
                kw["out_dir"], kw["source"] = Path(kw["out_dir"]), Path(kw["source"])
                exports[who][layout] = ExportSummary(**kw)
                checks[str(kw["out_dir"])] = str(s.get("check", ""))
                files[str(kw["out_dir"])] = dict(s.get("files") or {})
        sources_ = {w: Path(p) for w, p in d["sources"].items()}
        windows = {str(w): list(v) for w, v in (d.get("windows") or {}).items()}
        record = ExportRecord(path, str(d["fingerprint"]), sources_, exports, checks, files, windows)
    except (KeyError, TypeError, AttributeError) as e:
        if quiet:
            log.warning("export: %s is unreadable (%s: %s): written again", path, type(e).__name__, e)
            return None
        raise ExportRecordError(f"{path}: unreadable field {e}; {rerun}") from None
    except ExportRecordError:
        if quiet:
            log.warning("export: %s is unreadable: written again", path)
            return None
        raise
    return record


def _changed_files(record: ExportRecord) -> Optional[str]:
    """The first export file that is not as the record wrote it (missing, other size or mtime)."""
    for d, files in record.files.items():
        for name, was in files.items():
            if was is not None and _stat(Path(d) / name) != list(was):
                return f"{Path(d) / name} is not the file the export stage wrote (missing or changed since)"
    return None


def wait_for_export(path: Path, *, poll_s: float = 10.0) -> None:
    """Nodes 1..n-1: wait until node 0 has written (and checked) the export at ``path``."""
    deadline = time.time() + EXPORT_WAIT_S
    while not (path / "export.json").is_file():
        if time.time() > deadline:
            raise WaitTimedOut(f"{path} did not appear within an hour; did node 0 fail?")
        time.sleep(poll_s)
