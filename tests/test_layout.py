"""The package's imports point one way: the engine never reaches up into the application or capabilities."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "surgery"
UPPER = ("surgery.app", "surgery.data", "surgery.lm", "surgery.dist", "surgery.integrations", "surgery.vision")
# what each room may not import (module prefixes), at any depth, inside functions too
FORBIDDEN = {
    "errors.py": ("surgery.",),
    "expr": ("surgery.core", "surgery.actions", *UPPER),
    "core": ("surgery.actions", *UPPER),  # kinds register into core.steps.KINDS; the compiler imports none
    "actions": ("surgery.core.engine", "surgery.core.compiler", *UPPER),
    "files": (
        "surgery.actions",
        "surgery.expr",
        "surgery.core.engine",
        "surgery.core.compiler",
        "surgery.safe",
        *UPPER,
    ),
    "safe": ("surgery.actions", "surgery.core.engine", "surgery.core.compiler", *UPPER),
    "report": ("surgery.actions", "surgery.core.engine", "surgery.core.compiler", *UPPER),  # reads results only
}


def imported(path: Path) -> list[str]:
    """Every absolute module name ``path`` imports, wherever the import statement sits."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def room_files() -> list[tuple[str, Path]]:
    files = []
    for room in FORBIDDEN:
        target = PACKAGE / room
        files += [(room, p) for p in sorted(target.rglob("*.py"))] if target.is_dir() else [(room, target)]
    return files


@pytest.mark.parametrize(("room", "path"), room_files(), ids=lambda v: str(v).split("surgery/")[-1])
def test_no_import_points_up(room: str, path: Path) -> None:
    upward = [name for name in imported(path) if name.startswith(FORBIDDEN[room]) and name != "surgery.errors"]
    if room == "errors.py":
        upward = [name for name in imported(path) if name.startswith("surgery")]
    assert not upward, f"{path.relative_to(PACKAGE.parent)} imports {upward}, which its room must not"


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    """The checker itself: an import hidden in a function body is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from surgery.app.job import run_job\n")
    assert "surgery.app.job" in imported(module)


def test_top_level_holds_only_the_public_api_and_entry_points() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "errors.py", "replay.py", "sweep.py"]


def test_kinds_are_registered_by_importing_the_package_and_the_compiler_finds_them() -> None:
    """``import surgery`` fills the core registry the compiler reads; the actions package re-exports it."""
    import subprocess
    import sys

    code = (
        "import surgery, sys; from surgery.core.steps import KINDS; import surgery.actions as a;"
        "assert a.KINDS is KINDS and 'capture' in KINDS and 'on_load' in KINDS;"
        "assert 'surgery.app' not in sys.modules, sorted(m for m in sys.modules if m.startswith('surgery.app'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
