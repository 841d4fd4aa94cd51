"""The tree is the architecture (README "Layout"): layers import downward only, no import circles.

Read with `ast` (nothing is imported or run). Every `import` counts: module level, inside functions, and
under `if TYPE_CHECKING:` (a deferred import that hides a circle is still a circle). Importing a module's
own parent package (`from .. import __version__`) does not count: Python has imported it already.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Each unit of neuron_runtime/ and its rank: a module may import a unit of a lower rank, or its own unit.
RANKS = {
    "_config": 0,
    "_profiling": 0,      # profiler ranges (imports nothing of the package, nor torch)
    "_version": 0,        # the version and the package's directory (the root imports every layer)
    "_native": 1,         # the C++ layer and host-memory relabelling, under everything that touches memory
    "signatures": 2,      # what a call is, as data: shared by aten/, executables/ and compiler/
    "cache": 3,           # with `cache.envelope`, the entry format
    "compiler": 3,
    "executables": 4,
    "aten": 5,
    "graphs": 6,
    "distributed": 6,
    "device": 7,
    "kernels": 7,         # custom kernels as operators: a kernel's executable is a graphs.CompiledGraph
    # Faces: the package itself, its CLIs and tools; they may import anything, each other included.
    "": 8, "_stats": 8, "collect_env": 8, "demo": 8, "cli": 8, "conformance": 8,
}
FACE = 8
MAX_TOP = 8  # modules directly in neuron_runtime/ (besides __init__ and __main__)
# aten/ reaches the executables through executables/ alone (README's drawing), never the layers below it.
SKIPS = {"aten": ("cache", "compiler")}
# Imports of another package's private module (`from ..signatures import _ops`) that may remain, each
# with a reason in a comment at the import. A package's face (its __init__) is what the others use.
MAX_REACH_INS = 20


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports. `from X import a` imports `X.a` where that is a
    module, else `X` (whose __init__ then runs): `from .. import _config` does not import the root."""
    files = {module_name(root, p): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}  # generated code (`_proto`) is not read

    def known(t: str) -> str:
        while t and t not in files:
            t = t.rsplit(".", 1)[0] if "." in t else ""
        return t

    for m, p in files.items():
        if "_proto" in p.parts:
            continue
        base = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    b = base[: len(base) - (node.level - 1)]
                    prefix = ".".join(b + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in files else known(prefix)
                           for a in node.names]
            else:
                continue
            edges[m].update(t for t in targets if t and t != m)
    return edges


def private_reach_ins(root: Path) -> list[str]:
    """`module:line -> target` for each import of another package's private module (a name starting with
    `_` below the package, e.g. `neuron_runtime.aten._runtime`), per import statement."""
    out = []
    for p in sorted((root / "neuron_runtime").rglob("*.py")):
        m = module_name(root, p)
        base = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom):
                prefix = (base[: len(base) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                          if node.level else (node.module or "").split("."))
                targets = [prefix + [a.name] for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".") for a in node.names]
            else:
                continue
            for t in targets:
                if t[0] != "neuron_runtime" or len(t) < 3 or unit(".".join(t)) == unit(m):
                    continue
                private = [i for i in range(2, len(t)) if t[i].startswith("_") and not t[i].startswith("__")]
                hit = next((".".join(t[: i + 1]) for i in private
                            if (root.joinpath(*t[: i + 1]).with_suffix(".py").exists()
                                or root.joinpath(*t[: i + 1]).is_dir())), None)
                if hit:
                    out.append(f"{m}:{node.lineno} -> {hit}")
                    break
    return out


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, targets in sorted(edges.items()):
        if not m.startswith("neuron_runtime"):
            continue
        for t in sorted(targets):
            if not t.startswith("neuron_runtime"):
                continue
            a, b = unit(m), unit(t)
            if a != b and RANKS[a] < FACE and RANKS[b] >= RANKS[a]:
                bad.append(f"{m} ({a or 'neuron_runtime'}, rank {RANKS[a]}) imports {t} "
                           f"({b or 'neuron_runtime'}, rank {RANKS[b]})")
            elif b in SKIPS.get(a, ()):
                bad.append(f"{m} ({a}) skips a layer: imports {t} ({b})")
            elif t == "neuron_runtime" and m.count(".") > 1:
                bad.append(f"{m} imports the package root (which imports every layer)")
    return bad


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return import_graph(REPO, ("neuron_runtime", "cache_server"))


def test_no_import_circle(edges: dict[str, set[str]]) -> None:
    assert circles(edges) == []


def test_layers_import_downward_only(edges: dict[str, set[str]]) -> None:
    units = {unit(m) for m in edges if m.startswith("neuron_runtime")}
    assert units <= set(RANKS), f"units without a rank in RANKS: {sorted(units - set(RANKS))}"
    assert upward_imports(edges) == []


def test_packages_are_used_through_their_faces() -> None:
    found = private_reach_ins(REPO)
    assert len(found) <= MAX_REACH_INS, "\n".join(found)


def test_few_modules_at_the_top() -> None:
    top = sorted(p.name for p in (REPO / "neuron_runtime").glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= MAX_TOP, top


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    """A circle hidden in a function and under TYPE_CHECKING, and an upward import, are found."""
    pkg = tmp_path / "neuron_runtime"
    for sub in ("aten", "executables", "signatures"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "aten" / "_a.py").write_text("def f():\n    from . import _b\n")
    (pkg / "aten" / "_b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._a import f\n")
    (pkg / "executables" / "_r.py").write_text("from ..aten import _a\nfrom .. import __version__\n")
    (pkg / "signatures" / "_s.py").write_text("from ..signatures import _s as again\nfrom .. import _config\n")
    (pkg / "_config.py").write_text("")
    (pkg / "cache").mkdir()
    (pkg / "cache" / "__init__.py").write_text("")
    (pkg / "aten" / "_c.py").write_text("from ..cache import CacheMissError\n")
    e = import_graph(tmp_path, ("neuron_runtime",))
    assert circles(e) == [["neuron_runtime.aten._a", "neuron_runtime.aten._b"]]
    assert upward_imports(e) == [
        "neuron_runtime.aten._c (aten) skips a layer: imports neuron_runtime.cache (cache)",
        "neuron_runtime.executables._r (executables, rank 4) imports neuron_runtime (neuron_runtime, rank 8)",
        "neuron_runtime.executables._r (executables, rank 4) imports neuron_runtime.aten._a (aten, rank 5)"]
    assert private_reach_ins(tmp_path) == ["neuron_runtime.executables._r:1 -> neuron_runtime.aten._a"]
