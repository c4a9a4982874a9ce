"""Imports flow one way (ARCHITECTURE.md): a module imports only from its own or lower levels."""

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
    "server": 8,
    "cli": 9,
}
ROOT = Path(moetier.__file__).parent


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "moetier" and len(parts) > 1:
                found.add(parts[1])
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


def test_checker_catches_an_upward_import(tmp_path):
    fake = tmp_path / "mod.py"
    fake.write_text("from moetier.server.app import create_app\n")
    assert imported_packages(fake) == {"server"}
