"""The ``gateway`` package's import graph, read with :mod:`ast` (nothing is imported).

Every import counts: at the top of a file, inside a function, and under ``if
TYPE_CHECKING:``. ``from a import b`` is an edge to ``a.b`` when that is a module of the
package, else to ``a``. Imports of other packages are kept apart, by top-level name.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its file."""
    return {target for target in imported_names(name, path, known)
            if target in known and target != name}


def libraries_of(path: Path, known: set[str]) -> set[str]:
    """The top-level names of the other packages a file imports, anywhere in it."""
    return {target.split(".")[0] for target in imported_names(module_name(path), path, known)
            if target.split(".")[0] != "gateway"}


def imported_names(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module a file names in an import (resolved as far as the package knows)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if not is_package:
                    base.pop()
                base = base[: len(base) - (node.level - 1)]
                if node.module:
                    base.append(node.module)
                source = ".".join(base)
            else:
                source = node.module or ""
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found.add(child if child in known else source)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def closure(edges: dict[str, set[str]], roots: set[str]) -> set[str]:
    """Every module that importing ``roots`` runs: what they import, on and on, and the
    packages (``__init__``) above each."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:n]) for n in range(1, len(parts))]
        todo += edges.get(module, ())
    return seen
