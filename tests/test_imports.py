"""The package's import graph: no cycles, no forbidden arrows, no private names across modules.

Every ``import`` statement counts, wherever it is (module level, inside a function, under
``if TYPE_CHECKING``): a lazy import is still a dependency. The graph is read from the source
with ``ast``, so nothing is imported to check it.

Layering (DESIGN.md, STYLE.md):

* ``jaxrlhf.losses`` imports only jax, numpy, jaxtyping (and the standard library), so
  research code can take it alone;
* ``jaxrlhf.models`` never imports sharding, generation or train;
* sharding, generation and data never import train;
* data never imports models or rewards;
* and the arrows that follow from the layering (``FORBIDDEN``): rewards sit above data,
  models and sharding but below train; the platform module imports nothing of the package,
  and the kernels package nothing but itself.

Importing ``jaxrlhf.a.b`` also runs ``jaxrlhf/a/__init__.py``: the graph has that edge too,
so a cycle through a package's ``__init__`` is caught.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxrlhf"

FORBIDDEN = {
    "jaxrlhf.models": (
        "jaxrlhf.sharding",
        "jaxrlhf.generation",
        "jaxrlhf.train",
        "jaxrlhf.rewards",
        "jaxrlhf.data",
    ),
    "jaxrlhf.sharding": ("jaxrlhf.train", "jaxrlhf.generation", "jaxrlhf.rewards"),
    "jaxrlhf.generation": ("jaxrlhf.train", "jaxrlhf.rewards"),
    "jaxrlhf.data": ("jaxrlhf.train", "jaxrlhf.models", "jaxrlhf.rewards"),
    "jaxrlhf.rewards": ("jaxrlhf.train", "jaxrlhf.generation"),
    "jaxrlhf.platform": ("jaxrlhf.",),  # below every layer: nothing of the package
}
# Hand-written kernels sit below every layer too: nothing of the package but themselves.
FORBIDDEN["jaxrlhf.kernels"] = tuple(
    f"jaxrlhf.{p.stem}"
    for p in PACKAGE.iterdir()
    if p.stem not in ("kernels", "__init__") and (p.suffix == ".py" or (p / "__init__.py").exists())
)
LOSSES_MAY_IMPORT = {"jax", "numpy", "jaxtyping"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]], list[str]]:
    """``(edges, external, private)`` of the package at ``root``: the package modules each
    module imports, the top-level outside packages it imports, and every ``from jaxrlhf.x
    import _name`` of another module's private name (``module: statement``)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}
    external: dict[str, set[str]] = {m: set() for m in files}
    private: list[str] = []
    top = root.name
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package upwards
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                targets = [(base, a.name) for a in node.names]
            else:
                continue
            for name, attr in targets:
                if name.split(".")[0] != top:
                    external[module].add(name.split(".")[0])
                    continue
                full = f"{name}.{attr}" if attr else name
                target = full if full in files else name
                parent = target.rpartition(".")[0]  # its package's __init__ runs first
                while parent and parent != module and parent in files:
                    if not module.startswith(parent + "."):  # a package's own modules
                        edges[module].add(parent)
                    parent = parent.rpartition(".")[0]
                if attr and attr.startswith("_") and not attr.startswith("__") and name != module:
                    private.append(f"{module}: from {name} import {attr}")
                if target != module and target in files:
                    edges[module].add(target)
    return edges, external, private


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def forbidden_arrows(edges: dict[str, set[str]], external: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layering of the module docstring."""
    bad = []
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for module, targets in sorted(edges.items()):
        for layer, banned in FORBIDDEN.items():
            if module == layer or module.startswith(layer + "."):
                bad += [f"{module} -> {t}" for t in sorted(targets) if t.startswith(banned)]
        if module == "jaxrlhf.losses" or module.startswith("jaxrlhf.losses."):
            bad += [
                f"{module} -> {t}" for t in sorted(targets) if not t.startswith("jaxrlhf.losses")
            ]
            outside = external[module] - stdlib - LOSSES_MAY_IMPORT
            bad += [f"{module} -> {t}" for t in sorted(outside)]
    return bad


def test_no_import_cycles():
    edges, _, _ = read_graph(PACKAGE)
    assert len(edges) > 50  # the whole package was read
    cycle = find_cycle(edges)
    assert cycle is None, " -> ".join(cycle)


def test_no_forbidden_arrows():
    edges, external, _ = read_graph(PACKAGE)
    assert forbidden_arrows(edges, external) == []


def test_no_module_imports_another_modules_private_names():
    _, _, private = read_graph(PACKAGE)
    assert private == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    """A made-up package with a cycle through a lazy import, a forbidden arrow, a losses
    module importing flax, and a private import: each check reports it."""
    pkg = tmp_path / "jaxrlhf"
    for sub in ("models", "train", "losses", "data", "rewards"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "a.py").write_text("def f():\n    from jaxrlhf.train import b\n")
    (pkg / "train" / "b.py").write_text("from jaxrlhf.models.a import f, _helper\n")
    (pkg / "losses" / "c.py").write_text("import flax\nimport numpy\nimport math\n")
    (pkg / "data" / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxrlhf import rewards\n"
    )
    edges, external, private = read_graph(pkg)
    assert find_cycle(edges) == ["jaxrlhf.models.a", "jaxrlhf.train.b", "jaxrlhf.models.a"]
    assert forbidden_arrows(edges, external) == [
        "jaxrlhf.data.d -> jaxrlhf.rewards",
        "jaxrlhf.losses.c -> flax",
        "jaxrlhf.models.a -> jaxrlhf.train",  # importing train.b runs train/__init__.py
        "jaxrlhf.models.a -> jaxrlhf.train.b",
    ]
    assert private == ["jaxrlhf.train.b: from jaxrlhf.models.a import _helper"]


def _loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return set(json.loads(out.stdout))


@pytest.mark.slow
def test_config_import_is_light():
    """``import jaxrlhf.config`` (the CLI's --help, config tools, planners) loads neither Flax,
    optax, Orbax, transformers nor the model code: the configs are plain dataclasses."""
    loaded = _loaded_after("import jaxrlhf.config")
    heavy = {m for m in loaded if m.split(".")[0] in ("flax", "optax", "orbax", "transformers")}
    assert heavy == set()
    ours = {m for m in loaded if m.startswith("jaxrlhf.")}
    assert {m for m in ours if m.startswith("jaxrlhf.models.")} <= {"jaxrlhf.models.axes"}
    assert {m for m in ours if m.startswith("jaxrlhf.train.")} == {
        "jaxrlhf.train.config",
        "jaxrlhf.train.rl_config",
    }
    assert not {m for m in ours if m.startswith(("jaxrlhf.generation", "jaxrlhf.rewards"))}


@pytest.mark.slow
def test_losses_import_alone():
    loaded = _loaded_after("import jaxrlhf.losses")
    assert {m for m in loaded if m.startswith("jaxrlhf.")} == {
        m for m in loaded if m.startswith("jaxrlhf.losses")
    }
    assert not {m for m in loaded if m.split(".")[0] in ("flax", "optax", "torch")}
