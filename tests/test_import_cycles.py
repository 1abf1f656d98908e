"""No import circles among rayslice's own modules, lazy (function-level) imports included.

A circle makes two modules one concept in two files: neither can be read, tested or moved alone,
and which one Python finishes first depends on who imported first. A lazy import only hides that
from Python, so the graph here is read from the source (every `import` anywhere in a module, under
`if TYPE_CHECKING:` too), not from what importing it did. The Airflow layer's folders are mapped
into the package as installed (pyproject's package-dir): hooks/ is rayslice.hooks, and so on.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Each source folder and the package it installs as (pyproject.toml's package-dir).
FOLDERS = {"rayslice": "rayslice", "hooks": "rayslice.hooks", "operators": "rayslice.operators",
           "plugins": "rayslice.plugins", "dags": "rayslice.dags"}


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the project by its installed name (a package by its own name, for its __init__.py)."""
    modules = {}
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _target(name: str, modules: Mapping[str, Path]) -> str | None:
    """The project module an imported name lives in: itself, else its closest enclosing package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, source: str, modules: Mapping[str, Path], is_package: bool = False) -> set[str]:
    """The project modules `source` (module `module`) imports anywhere: top level, functions, TYPE_CHECKING."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(_target(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:  # `from a import b`: b is a module of a, or a name in a
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else _target(base, modules))
    found.discard(None)
    found.discard(module)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path.read_text(), modules, path.name == "__init__.py")
            for name, path in modules.items()}


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of two or more modules (Tarjan), as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # the project's modules are a few hundred: recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_in(group, graph) for group in groups]


def _circle_in(group: set[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A path that goes around inside `group` and back to where it started, to name in the failure."""
    start = min(group)
    path, seen = [start], {start}
    while True:
        nxt = min(n for n in graph[path[-1]] if n in group)
        if nxt in seen:
            return path[path.index(nxt):] + [nxt]
        path.append(nxt)
        seen.add(nxt)


def test_the_project_has_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles (lazy imports count): " + "; ".join(" -> ".join(c) for c in found)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path):
    """Not vacuous: top-level, lazy, relative, `from package import module` and TYPE_CHECKING imports all count."""
    (tmp_path / "rayslice" / "sub").mkdir(parents=True)
    (tmp_path / "operators").mkdir()
    files = {
        "rayslice/__init__.py": "",
        "rayslice/sub/__init__.py": "from . import b\n",
        "rayslice/sub/a.py": "def f():\n    from rayslice.operators import op\n",
        "rayslice/sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        "operators/__init__.py": "",
        "operators/op.py": "import rayslice.sub.b as b\nimport json\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["rayslice.sub"] == {"rayslice.sub.b"}
    assert graph["rayslice.sub.a"] == {"rayslice.operators.op"}
    assert graph["rayslice.sub.b"] == {"rayslice.sub.a"}
    assert graph["rayslice.operators.op"] == {"rayslice.sub.b"}
    assert cycles(graph) == [["rayslice.operators.op", "rayslice.sub.b", "rayslice.sub.a", "rayslice.operators.op"]]


def test_the_real_graph_holds_the_lazy_edges_that_once_closed_circles():
    """The edges kept after the circles were broken are still seen (a lazy import among them)."""
    graph = import_graph()
    assert "rayslice.operators.kuberay" in graph["rayslice.operators.step"]  # setup_mismatch's lazy import
    assert "rayslice.cloud.kuberay_client" in graph["rayslice.cloud.kuberay_cli"]
    assert "rayslice.cloud.kuberay" in graph["rayslice.cloud.kuberay_client"]
    assert "rayslice.cluster.queue" in graph["rayslice.cluster.reservation"]
    assert "rayslice.client.submission" in graph["rayslice"]  # `rayslice.run`, loaded on first use
