"""The import rule, for every module of the project (docs/architecture.md):

    dspark's lower wings  ->  data_tools (stage 1) | dspark (stage 2)  ->  eval (stage 3)  ->  train.py

The lower wings are subpackages of dspark/ that every stage may use, on floors, each importing
only the floors below it:

    dspark.core (errors, files, waits, ...)  ->  dspark.serving  ->  dspark.families  ->  dspark.config
        ->  dspark.formats | dspark.target

Stage 2 has two wings of its own: dspark.data (what the trainer reads) stands on the lower wings
alone; dspark.export (checkpoint -> the served formats) reads the rest of stage 2.

Each layer imports only the layers it is allowed (below it, and itself); nothing imports train.py;
there is no import cycle between modules, counting imports inside functions too. DeepSpeed stays
out of the lower wings, extraction and eval; outside extraction (which runs inside vLLM) vLLM is
imported only in the functions that start an engine, never at module level.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dspark", "data_tools", "eval")

FLOORS = (("core",), ("serving",), ("families",), ("config",), ("formats", "target"))
"""dspark's lower wings (``dspark/<wing>/``), bottom up; a wing imports the floors below its own.
Two wings on one floor import neither each other."""
WINGS = tuple(w for floor in FLOORS for w in floor)
LOWER = set(WINGS)


def _below(wing: str) -> set[str]:
    floor = next(i for i, f in enumerate(FLOORS) if wing in f)
    return {w for f in FLOORS[:floor] for w in f} | {wing}


LAYERS = {  # layer -> the layers it may import
    **{wing: _below(wing) for wing in WINGS},
    "data_tools": LOWER | {"data_tools"},
    "data": LOWER | {"data"},  # dspark/data/: stage 2's data wing
    "dspark": LOWER | {"data", "dspark", "export"},  # recipe's train.init_from reads an export
    "export": LOWER | {"data", "dspark", "export"},  # dspark/export/: stage 2's export wing
    "eval": LOWER | {"data", "dspark", "export", "eval"},
    "entry": LOWER | {"data_tools", "data", "dspark", "export", "eval"},
}
NEVER = {  # layer -> third-party packages it must not import anywhere
    **{wing: {"deepspeed"} for wing in WINGS},
    "data_tools": {"deepspeed"},
    "eval": {"deepspeed"},
}


def layer_of(module: str) -> str:
    if module == "train":
        return "entry"
    parts = module.split(".")
    if parts[0] == "dspark" and len(parts) > 1 and parts[1] in LAYERS and parts[1] not in ("dspark", "entry"):
        return parts[1]  # dspark/<wing>/: a lower wing, or stage 2's data or export wing
    return parts[0]


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


def test_the_tree_has_the_three_stages_and_the_wings():
    layers = {layer_of(m) for m in MODULES}
    assert layers == set(LAYERS), layers
    assert len(MODULES) > 30  # every module is checked, not a hand-picked few


def test_the_lower_wings_import_one_way():
    """The table itself: below each lower wing only lower floors, so no two wings may import each
    other, and stage 1 is allowed no layer of stage 2 (data_tools never imports the trainer, model,
    export or recipe)."""
    for a in LAYERS:
        for b in LAYERS[a] - {a}:
            if {a, b} != {"dspark", "export"}:  # stage 2's top and its export wing: one way module by module
                assert a not in LAYERS[b], f"{a} and {b} may import each other"
    assert LAYERS["data_tools"] & {"data", "dspark", "export", "eval"} == set()


def test_each_lower_wing_is_imported_without_what_is_above_it():
    """The wings stay under dspark/ (docs/architecture.md says why): that holds while importing
    ``dspark.<wing>.*`` runs nothing of stage 2, i.e. ``dspark/__init__.py`` imports nothing. In one
    process, bottom up: importing each wing's modules loads no module of a layer that wing may not
    import (what the layers below it loaded already is not counted again)."""
    import subprocess
    import sys

    tree = ast.parse((REPO / "dspark" / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    wings = {w: sorted(m for m in MODULES if layer_of(m) == w and not m.endswith(".__main__")) for w in WINGS}
    code = (
        "import sys\n"
        "def ours():\n"
        "    return {m for m in sys.modules if m.split('.')[0] in ('dspark', 'data_tools', 'eval') and m != 'dspark'}\n"
        f"for wing, mods in {wings!r}.items():\n"
        "    before = ours()\n"
        "    for m in mods: __import__(m)\n"
        "    print(wing, sorted(ours() - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert sorted(loaded) == sorted(WINGS), out.stdout
    for wing, mods in loaded.items():
        wrong = [m for m in ast.literal_eval(mods) if layer_of(m) not in LAYERS[wing]]
        assert not wrong, f"importing dspark.{wing} loaded {wrong}"


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
    """The checker itself: an eval-style import inside a core module is reported, and so is a lower
    wing reaching up a floor (the config reading the shard format) or across its own."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f():\n    from eval.run import run_eval\n    import deepspeed\n"
        "    from dspark.formats.shard_format import Manifest\n"
    )
    ours, third, _ = imports_of(bad, MODULES)
    assert ours == {"eval.run", "dspark.formats.shard_format"} and "deepspeed" in third
    assert layer_of("eval.run") not in LAYERS["core"]
    assert layer_of("dspark.formats.shard_format") == "formats"
    assert "formats" not in LAYERS["config"] and "target" not in LAYERS["formats"]
    assert layer_of("dspark.config.run") == "config" and "config" not in LAYERS["serving"]
    assert layer_of("dspark.model") == "dspark" and "dspark" not in LAYERS["data_tools"]
