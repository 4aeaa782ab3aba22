"""One direction of dependency: the services import the library, never the reverse (DESIGN.md,
"Layout"). Every module under ``specd/`` is parsed, so an import hidden inside a function (the
usual way to dodge the cycle it would make) counts as much as one at the top of the file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[2] / "specd"
SERVICES = "services"


def _dynamic_name(node: ast.Call) -> str | None:
    """The module an ``importlib.import_module(...)`` or ``__import__(...)`` call names, as far as
    its first argument spells it out (a string, or the literal start of an f-string)."""
    func = node.func
    if not ((isinstance(func, ast.Name) and func.id in ("__import__", "import_module"))
            or (isinstance(func, ast.Attribute) and func.attr == "import_module")) or not node.args:
        return None
    first = node.args[0]
    if isinstance(first, ast.JoinedStr) and first.values:
        first = first.values[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def service_imports(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, imported module) for every import of ``services`` or ``services.*`` in ``source``,
    at any depth (module level, inside functions and classes, under ``if`` or ``try``), including
    one through ``importlib.import_module`` with the name written out."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and (name := _dynamic_name(node)) is not None:
            names = [name]
        else:
            continue  # relative imports stay inside the package they are written in
        found += [(node.lineno, name) for name in names if name == SERVICES or name.startswith(SERVICES + ".")]
    return sorted(found)


def test_the_checker_sees_every_form_of_import():
    source = (
        "import services\n"
        "import os, services.up as up\n"
        "from services.common import broadcast\n"
        "def f():\n"
        "    from services import calibrate\n"
        "class C:\n"
        "    def g(self):\n"
        "        if True:\n"
        "            import services.bench\n"
        "import servicesx\n"  # another package that merely starts with the same letters
        "from specd.services_like import x\n"
        "from . import services\n"  # relative: a sibling module of that name, not the top package
        "def h(name):\n"
        "    importlib.import_module(f'services.{name}')\n"
        "    return __import__('services.up'), import_module('specd.zoo')\n"
    )
    assert service_imports(source) == [(1, "services"), (2, "services.up"), (3, "services.common"),
                                       (5, "services"), (9, "services.bench"), (14, "services."),
                                       (15, "services.up")]


def test_the_library_never_imports_a_service():
    modules = sorted(LIBRARY.rglob("*.py"))
    assert len(modules) > 20, f"found only {len(modules)} modules under {LIBRARY}"
    offences = [f"{path.relative_to(LIBRARY.parent)}:{line}: imports {name}"
                for path in modules for line, name in service_imports(path.read_text(), str(path))]
    if offences:
        pytest.fail("the library imports the services (they may import specd, never the reverse):\n  "
                    + "\n  ".join(offences))
