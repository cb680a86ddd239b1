"""A non-editable install carries every package of the source tree: the wheel is built from the
project's own pyproject.toml (no build isolation: the registry is not needed) and its contents are
compared with the packages on disk."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = ("dspark", "data_tools", "eval")


def source_packages() -> set[str]:
    return {".".join(init.parent.relative_to(REPO).parts) for top in TOP for init in (REPO / top).rglob("__init__.py")}


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_module(tmp_path):
    # a copy of what the build reads, so that no earlier build's build/ or *.egg-info fills the gaps
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for top in TOP:
        shutil.copytree(REPO / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (wheel,) = tmp_path.glob("dspark_train-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    in_wheel = {n.rpartition("/")[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert "dspark.families" in source_packages()  # the package issue #39 found missing
    assert in_wheel == source_packages()
    modules = {str(p.relative_to(REPO)) for top in TOP for p in (REPO / top).rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert "dspark/py.typed" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "outputs/")) for n in names)
