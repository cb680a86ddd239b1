"""The import rule, for every module of the project (docs/architecture.md):

    dspark.core  ->  data_tools (stage 1) | dspark (stage 2)  ->  eval (stage 3)  ->  train.py

Stage 2 has two wings: dspark.data (what the trainer reads) stands on the core alone; dspark.export
(checkpoint -> the served formats) reads the rest of stage 2.

Each layer imports only the layers left of it (and itself); nothing imports train.py; there is no
import cycle between modules, counting imports inside functions too. DeepSpeed stays out of the
core, extraction and eval; outside extraction (which runs inside vLLM) vLLM is imported only in
the functions that start an engine, never at module level.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dspark", "data_tools", "eval")

LAYERS = {  # layer -> the layers it may import
    "core": {"core"},
    "data_tools": {"core", "data_tools"},
    "data": {"core", "data"},  # dspark/data/: stage 2's data wing
    "dspark": {"core", "data", "dspark", "export"},  # recipe's train.init_from reads an export
    "export": {"core", "data", "dspark", "export"},  # dspark/export/: stage 2's export wing
    "eval": {"core", "data", "dspark", "export", "eval"},
    "entry": {"core", "data_tools", "data", "dspark", "export", "eval"},
}
NEVER = {  # layer -> third-party packages it must not import anywhere
    "core": {"deepspeed"},
    "data_tools": {"deepspeed"},
    "eval": {"deepspeed"},
}


def layer_of(module: str) -> str:
    if module == "train":
        return "entry"
    for package, layer in (("dspark.core", "core"), ("dspark.data", "data"), ("dspark.export", "export")):
        if module == package or module.startswith(package + "."):
            return layer
    return module.split(".")[0]


def project_modules() -> dict[str, Path]:
    mods = {"train": REPO / "train.py"}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def imports_of(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str], set[str]]:
    """(project modules imported anywhere, third-party top-level names imported anywhere,
    third-party names imported at module level)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    toplevel = {id(n) for n in tree.body}
    ours, third, third_top = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            root = name.split(".")[0]
            if root in PACKAGES or name == "train":
                # the longest prefix that is a module of ours (``from x import name`` may name a function)
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name:
                    ours.add(name)
            else:
                third.add(root)
                if id(node) in toplevel:
                    third_top.add(root)
    return ours, third, third_top


MODULES = project_modules()
GRAPH = {m: imports_of(p, MODULES) for m, p in MODULES.items()}


def test_the_tree_has_the_three_stages_and_the_core():
    layers = {layer_of(m) for m in MODULES}
    assert layers == set(LAYERS), layers
    assert len(MODULES) > 30  # every module is checked, not a hand-picked few


def test_the_core_is_imported_without_stage_2():
    """dspark/core stays under dspark/ (docs/architecture.md says why): that holds while
    importing ``dspark.core.*`` runs nothing of stage 2, i.e. ``dspark/__init__.py`` imports
    nothing."""
    import subprocess
    import sys

    tree = ast.parse((REPO / "dspark" / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    core = sorted(m for m in MODULES if layer_of(m) == "core")
    code = f"import sys\nfor m in {core!r}: __import__(m)\n" + (
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dspark', 'data_tools', 'eval') "
        "and not m.startswith('dspark.core') and m != 'dspark'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"  # every core module loaded, nothing of a stage


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_one_way(module):
    ours, third, third_top = GRAPH[module]
    layer = layer_of(module)
    wrong = sorted(m for m in ours if layer_of(m) not in LAYERS[layer] and m != module.split(".")[0])
    assert not wrong, f"{module} ({layer}) imports {wrong}; {layer} may import only {sorted(LAYERS[layer])}"
    assert "train" not in ours or module == "train"
    banned = sorted(third & NEVER.get(layer, set()))
    assert not banned, f"{module} ({layer}) imports {banned}"
    if layer != "data_tools":  # stage 1 runs inside vLLM (its connector plugin subclasses vLLM's)
        assert "vllm" not in third_top, f"{module} imports vllm at module level; import it where the engine starts"


def test_no_import_cycles():
    edges = {m: {d for d in GRAPH[m][0] if d != m} for m in MODULES}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_rule_catches_a_violation(tmp_path):
    """The checker itself: an eval-style import inside a core module is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from eval.run import run_eval\n    import deepspeed\n")
    ours, third, _ = imports_of(bad, MODULES)
    assert ours == {"eval.run"} and "deepspeed" in third
    assert layer_of("eval.run") not in LAYERS["core"]
