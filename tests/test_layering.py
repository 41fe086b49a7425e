"""The layering docs/style.md describes, checked from the source's imports without importing it.

`kvtransfer/` (bottom, no other Cleave package) <- `workers/` (the engine, no ray) <- `cluster/`
(Ray composition); `router/` never loads torch; no module imports itself through others.

Every `import` statement anywhere in a file counts: at module level, inside functions, under
`if TYPE_CHECKING:`. The one exception is a package `__init__`'s module-level `__getattr__`
(PEP 562): its imports run only when someone asks for the name, so they are lazy re-exports, not
imports of the package. Third-party modules are leaves (whatever torch imports is torch's
business). Whether a module loads torch or ray also follows the packages Python loads first:
importing `workers.contract.protocol` runs `workers/__init__.py`.

Files under `benchmarks/` are scripts: they import their siblings by bare name
(`from loadgen import ...`), read here as `benchmarks.loadgen`.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "router", "workers", "kvtransfer", "benchmarks")
SCRIPT_DIRS = ("benchmarks",)  # siblings import each other by bare name


@dataclass(frozen=True)
class ImportGraph:
    """Project modules (dotted names; a package is its `__init__`) and what each imports."""

    project: dict[str, frozenset[str]]  # module -> project modules it imports
    external: dict[str, frozenset[str]]  # module -> top-level third-party names it imports
    packages: frozenset[str]  # modules that are a package's `__init__`

    def parents(self, module: str) -> list[str]:
        """The packages Python runs before `module`, outermost first."""
        parts = module.split(".")
        return [p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                if p in self.packages]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def build_graph(root: Path, packages: Iterable[str] = PACKAGES,
                script_dirs: Iterable[str] = SCRIPT_DIRS) -> ImportGraph:
    files = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))
             if "__pycache__" not in p.parts}
    resolver = _Resolver(frozenset(files), frozenset(m for m, p in files.items()
                                                      if p.name == "__init__.py"),
                         frozenset(packages), frozenset(script_dirs))
    project: dict[str, frozenset[str]] = {}
    external: dict[str, frozenset[str]] = {}
    for module, path in files.items():
        targets = set(resolver.imports_of(module, ast.parse(path.read_text(), str(path))))
        targets.discard(module)  # `from . import x` in a package names its own submodules
        project[module] = frozenset(t for t in targets if t.split(".")[0] in resolver.roots)
        external[module] = frozenset(targets - project[module])
    return ImportGraph(project, external, resolver.packages)


@dataclass(frozen=True)
class _Resolver:
    modules: frozenset[str]
    packages: frozenset[str]
    roots: frozenset[str]  # top-level names of project packages
    script_dirs: frozenset[str]

    def imports_of(self, module: str, tree: ast.Module) -> Iterator[str]:
        lazy = _lazy_nodes(tree) if module in self.packages else set()
        for node in ast.walk(tree):
            if id(node) in lazy:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield self.absolute(alias.name, module)
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                base = self.base_of(node, module)
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    yield candidate if candidate in self.modules else base

    def base_of(self, node: ast.ImportFrom, module: str) -> str:
        if node.level == 0:
            return self.absolute(node.module or "", module)
        package = module if module in self.packages else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def absolute(self, name: str, importer: str) -> str:
        """The project module `name` means (its longest known prefix), or its top-level name
        when it is third-party."""
        top = name.split(".")[0]
        scripts = importer.split(".")[0]
        if top not in self.roots and scripts in self.script_dirs and \
                f"{scripts}.{top}" in self.modules:
            name = f"{scripts}.{name}"
        elif top not in self.roots:
            return top
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in self.modules:
                return ".".join(parts[:i])
        return name


def _lazy_nodes(tree: ast.Module) -> set[int]:
    """Ids of the nodes inside a module-level `def __getattr__` (PEP 562 lazy re-exports)."""
    return {id(inner) for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
            for inner in ast.walk(node)}


def find_cycles(graph: ImportGraph) -> list[list[str]]:
    """One shortest cycle through each module that is on a cycle, deduplicated, each as the
    chain `[a, b, ..., a]` starting at its smallest module."""
    cycles: set[tuple[str, ...]] = set()
    for component in _strongly_connected(graph.project):
        for start in component:
            path = _shortest_path(start, lambda m: [t for t in graph.project[m]
                                                    if t in component],
                                  lambda m, first=start: first in graph.project[m])
            if path is not None:  # start ... last, where last imports start
                i = path.index(min(path))
                cycles.add(tuple(path[i:] + path[:i] + [path[i]]))
    return [list(c) for c in sorted(cycles)]


def _strongly_connected(edges: dict[str, frozenset[str]]) -> list[set[str]]:
    """Tarjan's components with a cycle (more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                found.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _shortest_path(start: str, neighbours: Callable[[str], Iterable[str]],
                   is_goal: Callable[[str], bool]) -> list[str] | None:
    """Breadth-first from `start`: the shortest `[start, ..., m]` with `is_goal(m)`."""
    previous: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        m = queue.popleft()
        if is_goal(m):
            path = [m]
            while previous[path[-1]] is not None:
                path.append(previous[path[-1]])
            return path[::-1]
        for n in sorted(neighbours(m)):
            if n not in previous:
                previous[n] = m
                queue.append(n)
    return None


def loads_through(graph: ImportGraph, start: str, external: str) -> list[str] | None:
    """How importing `start` loads the third-party `external`, as a readable chain (a package
    run before its module shows as `(package) name`), or None when it does not."""
    def neighbours(m: str) -> list[str]:
        return [*graph.project.get(m, ()), *graph.parents(m)]

    path = _shortest_path(start, neighbours, lambda m: external in graph.external.get(m, ()))
    if path is None:
        return None
    shown = [path[0]]
    for a, b in zip(path, path[1:]):
        shown.append(f"(package) {b}" if b in graph.parents(a) and b not in graph.project[a]
                     else b)
    return [*shown, external]


def chain(path: list[str]) -> str:
    return " -> ".join(path)


@functools.cache
def cleave_graph() -> ImportGraph:
    return build_graph(ROOT)


def in_package(graph: ImportGraph, package: str) -> list[str]:
    return sorted(m for m in graph.project if m.split(".")[0] == package)


# ---- Cleave's rules ---------------------------------------------------------------------------


def test_no_import_cycles() -> None:
    cycles = find_cycles(cleave_graph())
    assert not cycles, (f"{len(cycles)} import cycles (a -> b: a imports b; break each by "
                        "moving the shared part into its own module):\n  "
                        + "\n  ".join(chain(c) for c in cycles))


def test_router_never_imports_torch() -> None:
    graph = cleave_graph()
    offenders = [chain(p) for m in in_package(graph, "router")
                 if (p := loads_through(graph, m, "torch")) is not None]
    assert not offenders, "router modules that load torch:\n  " + "\n  ".join(offenders)


def test_workers_never_import_ray() -> None:
    graph = cleave_graph()
    offenders = [chain(p) for m in in_package(graph, "workers")
                 if (p := loads_through(graph, m, "ray")) is not None]
    assert not offenders, "workers modules that load ray:\n  " + "\n  ".join(offenders)


def test_kvtransfer_imports_no_other_cleave_package() -> None:
    graph = cleave_graph()
    offenders = [f"{m} -> {t}" for m in in_package(graph, "kvtransfer")
                 for t in sorted(graph.project[m]) if t.split(".")[0] != "kvtransfer"]
    assert not offenders, "kvtransfer imports other Cleave packages:\n  " + "\n  ".join(offenders)


# ---- the checker itself, on a small tree ------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def sample(tmp_path: Path) -> ImportGraph:
    write_tree(tmp_path, {
        "app/__init__.py": "def __getattr__(name):\n    from app.heavy import Heavy\n"
                           "    return Heavy\n",
        "app/heavy.py": "import torch.nn\n",
        "app/a.py": "from . import b\nfrom .sub import c\n",
        "app/b.py": "def f():\n    from app.sub.c import X\n",
        "app/sub/__init__.py": "import ray\n",
        "app/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from app import a\n",
        "lib/__init__.py": "from lib.x import Y\n",
        "lib/x.py": "import numpy as np\nimport app.heavy\n",
        "scripts/run.py": "from helpers import go\n",
        "scripts/helpers.py": "import app\n",
    })
    return build_graph(tmp_path, ("app", "lib", "scripts"), ("scripts",))


def test_relative_function_level_and_type_checking_imports_count(sample: ImportGraph) -> None:
    assert sample.project["app.a"] == {"app.b", "app.sub.c"}
    assert sample.project["app.b"] == {"app.sub.c"}
    assert sample.project["app.sub.c"] == {"app.a"}
    assert sample.external["app.heavy"] == {"torch"}
    assert sample.project["scripts.run"] == {"scripts.helpers"}
    assert find_cycles(sample) == [["app.a", "app.b", "app.sub.c", "app.a"],
                                   ["app.a", "app.sub.c", "app.a"]]


def test_lazy_reexports_are_not_imports_but_packages_run_first(sample: ImportGraph) -> None:
    assert sample.project["app"] == frozenset()
    assert loads_through(sample, "scripts.run", "torch") is None
    assert loads_through(sample, "app.a", "ray") == ["app.a", "app.sub.c", "(package) app.sub",
                                                     "ray"]
    assert loads_through(sample, "lib.x", "torch") == ["lib.x", "app.heavy", "torch"]


# ---- inside workers/: sub-packages by concern, each importing only those below it ---------------

# Bottom first. `contract` is what the router and the workers share (no torch); `tokenizer` is
# torch-free too; `kernels` holds the CPU (C) and Triton kernels; `attention` and `quant` build on
# them; `models` holds the families' modules and checkpoint reading; `engine` is the core
# (scheduler, KV cache, runner, parallel ranks, the async engine); `serving` is the worker's shell
# around one engine (role, handoff and migration verbs, the router's calls).
WORKERS_LAYERS = ("contract", "tokenizer", "kernels", "attention", "quant", "models", "engine",
                  "serving")


def workers_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "workers" or len(parts) < 2:
        return None
    return WORKERS_LAYERS.index(parts[1]) if parts[1] in WORKERS_LAYERS else None


def test_workers_top_level_holds_only_its_layers() -> None:
    top = sorted(p.stem if p.suffix == ".py" else p.name for p in (ROOT / "workers").iterdir()
                 if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir()))
    assert top == sorted(("__init__", *WORKERS_LAYERS)), top


def test_workers_layers_import_downward() -> None:
    graph = cleave_graph()
    offenders = [f"{m} -> {t}" for m in in_package(graph, "workers")
                 if (low := workers_layer(m)) is not None
                 for t in sorted(graph.project[m])
                 if (high := workers_layer(t)) is not None and high > low]
    assert not offenders, ("workers/ sub-packages import upward (order, bottom first: "
                           f"{', '.join(WORKERS_LAYERS)}):\n  " + "\n  ".join(offenders))


@pytest.mark.parametrize("package", ["workers.contract", "workers.tokenizer"])
def test_the_contract_and_tokenizer_never_import_torch(package: str) -> None:
    graph = cleave_graph()
    offenders = [chain(p) for m in sorted(graph.project)
                 if (m == package or m.startswith(package + "."))
                 and (p := loads_through(graph, m, "torch")) is not None]
    assert not offenders, f"{package} modules that load torch:\n  " + "\n  ".join(offenders)
