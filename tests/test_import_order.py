"""Imports flow one way (ARCHITECTURE.md): a module imports only from its own or lower levels,
and no modules import each other in a circle (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import moetier

LEVELS = {
    "config": 0,
    "core": 0,
    "kernels": 1,
    "quant": 2,
    "residency": 3,
    "gate": 4,
    "layers": 5,
    "models": 5,
    "loader": 6,
    "engine": 7,
    "parallel": 8,
    "server": 9,
    "cli": 10,
}
ROOT = Path(moetier.__file__).parent


def imported_names(path: Path, package: str = "") -> set[str]:
    """Every dotted name `path` imports (`from a import b` gives both a and a.b: b may be a
    module); relative imports resolved against `package`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def imported_packages(path: Path) -> set[str]:
    """The moetier packages (second name) `path` imports from."""
    return {
        name.split(".")[1]
        for name in imported_names(path)
        if name.startswith("moetier.") and len(name.split(".")) > 1
    }


def module_graph(root: Path, top: str) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = [top, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {t for t in imported_names(path, package) if t in modules and t != name}
        # importing a.b.c runs a and a.b first; a package importing its own submodules is fine
        graph[name] = {t for t in targets if not name.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_level():
    packages = {
        p.stem if p.is_file() else p.name
        for p in ROOT.iterdir()
        if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").exists())
    }
    assert packages <= set(LEVELS), packages - set(LEVELS)


def test_no_upward_imports():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith("_"):
            continue  # moetier/__init__.py, __main__.py
        own = rel.parts[0].removesuffix(".py")
        for target in imported_packages(path):
            if LEVELS[target] > LEVELS[own]:
                bad.append(f"{rel} imports moetier.{target}")
    assert not bad, bad


def test_no_import_circles():
    assert circles(module_graph(ROOT, "moetier")) == []


def test_checker_catches_an_upward_import(tmp_path):
    fake = tmp_path / "mod.py"
    fake.write_text("from moetier.server.app import create_app\n")
    assert imported_packages(fake) == {"server"}


def test_checker_catches_circles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")  # a package importing its own: fine
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\nimport os\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")  # lazy, relative
    (pkg / "c.py").write_text("from pkg import a\n")
    (pkg / "d.py").write_text("from pkg.c import g\n")  # into the circle, not part of it
    graph = module_graph(pkg, "pkg")
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert circles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "c.py").write_text("import os\n")
    assert circles(module_graph(pkg, "pkg")) == []
