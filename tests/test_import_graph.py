"""The import graph of the whole ``titan_ds`` package has no cycles.

How the graph is built (from the source, with ``ast``; nothing is imported):

* Nodes are the modules of ``titan_ds`` (a package is its ``__init__``).
* Every ``import``/``from ... import`` statement counts, **wherever it is**: module level, inside a function
  (a lazy import) or under ``if``/``try``. A function-level import only delays the cycle to the first call; it
  was being used to hide one (``comm.compressor`` <-> ``comm.tgss``/``comm.hge``), so it is an edge like any
  other. ``importlib.import_module("titan_ds.x")`` with a literal string counts too. Names resolved from
  tables at run time (``engine.PILLARS``, ``cli.PILLAR_MODULES``) are not followed: they are looked up by
  ``initialize`` after the package has been imported.
* ``from P import n`` is an edge to ``P.n`` when that is a module, else to ``P``.
* Importing ``a.b.c`` also executes the packages ``a`` and ``a.b``: those are edges too, except the packages
  that contain the importing module (Python imports them before the importer's body runs, so reaching them
  again runs nothing). An explicit ``from .. import name`` of an enclosing package still counts.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "titan_ds"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every module under the package directory ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _literal_import_module(node: ast.Call) -> Optional[str]:
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def _targets(node: ast.AST, me: str, is_pkg: bool, modules: dict[str, Path]) -> list[str]:
    """The modules one statement names (before the implicit parent packages are added)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.Call):
        name = _literal_import_module(node)
        return [name] if name else []
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        pkg = me.split(".") if is_pkg else me.split(".")[:-1]
        base = pkg[:len(pkg) - (node.level - 1)]
        base_name = ".".join(base + ([node.module] if node.module else []))
    else:
        base_name = node.module or ""
    return [f"{base_name}.{a.name}" if f"{base_name}.{a.name}" in modules else base_name for a in node.names]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring for what counts)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for me, path in modules.items():
        is_pkg = path.name == "__init__.py"
        own = set(_ancestors(me)) | ({me} if is_pkg else set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, me, is_pkg, modules):
                while target and target not in modules:  # "import a.b.C" where C is not a module
                    target = target.rpartition(".")[0]
                if not target:
                    continue
                graph[me].add(target)
                graph[me].update(a for a in _ancestors(target) if a in modules and a not in own)
        graph[me].discard(me)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One cycle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_titan_ds_import_graph_has_no_cycle():
    graph = import_graph(PACKAGE_ROOT)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in titan_ds (lazy imports count): " + " -> ".join(cycle)


def test_graph_sees_the_package():
    """The graph is not vacuous: known edges of every kind are found."""
    graph = import_graph(PACKAGE_ROOT)
    assert len(graph) > 30
    assert "titan_ds.config" in graph["titan_ds.hms.install"]         # from ..config import X
    assert "titan_ds.config" in graph["titan_ds"]                     # a package's __init__
    assert "titan_ds.kernels._guard" in graph["titan_ds.cli"]          # import_module("...") in a function
    assert "titan_ds.comm" in graph["titan_ds.optim.asdt"]            # entering a package runs its __init__


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / "pkg" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("files, cycle", [
    # a lazy (function-level) import hiding a cycle, as comm.compressor did with comm.tgss
    ({"__init__.py": "", "a.py": "def f():\n    from .b import g\n", "b.py": "from .a import f\n"},
     ["pkg.a", "pkg.b", "pkg.a"]),
    # a cycle through a package's __init__ entered from outside it
    ({"__init__.py": "", "x/__init__.py": "from .m import v\n", "x/m.py": "from ..y import w\nv = 1\n",
      "y.py": "import pkg.x.m\nw = 2\n"},
     ["pkg.x", "pkg.x.m", "pkg.y", "pkg.x"]),
    # importlib with a literal name
    ({"__init__.py": "", "a.py": "import importlib\nimportlib.import_module('pkg.b')\n", "b.py": "from . import a\n"},
     ["pkg.a", "pkg.b", "pkg.a"]),
    # no cycle: a child importing its own package's names, and a plain chain
    ({"__init__.py": "from .a import f\n", "a.py": "from .b import g\ndef f(): pass\n", "b.py": "def g(): pass\n"},
     None),
])
def test_find_cycle_on_small_packages(tmp_path, files, cycle):
    assert find_cycle(import_graph(_write(tmp_path, files))) == cycle
