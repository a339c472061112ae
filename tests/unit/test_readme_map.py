"""The README's file map ("How it works") names every file of ``gateway/``, and only files
that exist.

The map is the first fenced block of that section: a tree, two spaces of indent per level,
one entry per line, its name first (a folder's ends in ``/``); a line indented past the next
level continues the description above it. Checked: every ``.py`` (a package's
``__init__.py`` is named by its folder), every ``.lua`` and every file of ``static/``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"^[\w.-]+/?$")


def file_map(readme: str) -> str:
    section = readme.split("\n## How it works\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```\n", 2)[1]


def named_files(tree: str) -> set[str]:
    """The files a map names, as paths from the repository's root."""
    names: set[str] = set()
    folders: list[str] = []
    for line in tree.splitlines():
        if not line.strip():
            continue
        depth, odd = divmod(len(line) - len(line.lstrip(" ")), 2)
        if odd or depth > len(folders):
            continue  # a description's next line
        name = line.split()[0]
        assert NAME.match(name), f"not a name: {line!r}"
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name[:-1])
        else:
            names.add("/".join([*folders, name]))
    return names


def package_files() -> set[str]:
    found = set()
    for path in (ROOT / "gateway").rglob("*"):
        relative = path.relative_to(ROOT)
        if not path.is_file() or "__pycache__" in relative.parts:
            continue
        if (path.suffix == ".py" and path.name != "__init__.py") or path.suffix == ".lua" or (
                relative.parent == Path("gateway/static")):
            found.add(relative.as_posix())
    return found


def test_the_map_reads_as_a_tree() -> None:
    tree = "gateway/\n  a.py    one\n          more\n  sub/\n    b.lua  two\n  c.py\n"
    assert named_files(tree) == {"gateway/a.py", "gateway/sub/b.lua", "gateway/c.py"}


def test_the_file_map_names_every_file_of_the_package() -> None:
    named = named_files(file_map((ROOT / "README.md").read_text()))
    files = package_files()
    assert {"gateway/redis/lua/child.lua", "gateway/static/app.js"} <= files
    missing = files - named
    assert not missing, f"README's file map does not name {sorted(missing)}"
    stale = named - files
    assert not stale, f"README's file map names files that do not exist: {sorted(stale)}"
