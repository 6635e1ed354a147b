"""Every file the package opens, reads, writes, lists or maps passes through surgery/files/ (SPEC §19).

The check walks each module's syntax tree (docstrings and comments never count) for the calls that
touch a file: ``open``, ``Path.read_*``/``write_*``, listings (``iterdir``, ``glob``, ``os.listdir``,
``os.walk``), maps (``mmap``, ``np.memmap``), the libraries' own loaders and savers (``safe_open``,
``load_file``, ``torch.load``, ``json.load``, ``savefig``, ``from_pretrained``), removals and temp files.
A new feature that reads a file its own way fails here, so the gate cannot be bypassed by accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "surgery"
GATE = PACKAGE / "files"

NAMES = {"open", "safe_open", "load_file", "save_file", "load_from_disk", "load_dataset", "mkstemp", "mkdtemp"}
METHODS = {
    "read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "glob", "rglob", "mkdir", "unlink", "rmdir",
    "touch", "savefig", "from_pretrained", "save_pretrained", "symlink_to", "hardlink_to", "from_file",
}  # fmt: skip
MODULE_CALLS = {
    "os": {"open", "fdopen", "listdir", "scandir", "walk", "remove", "unlink", "rename", "replace", "mkdir",
           "makedirs", "rmdir", "symlink", "link", "truncate", "mkfifo"},
    "json": {"load", "dump"}, "np": {"load", "save", "savez", "memmap", "fromfile"},
    "numpy": {"load", "save", "savez", "memmap", "fromfile"}, "torch": {"load", "save"}, "mmap": {"mmap"},
    "shutil": None, "tempfile": None, "gzip": {"open"}, "bz2": {"open"}, "lzma": {"open"}, "zipfile": {"ZipFile"},
    "tarfile": {"open"}, "io": {"open", "FileIO"}, "Image": {"open"}, "pickle": {"load"}, "yaml": {"load"},
    "OmegaConf": {"load", "save"},
}  # fmt: skip
OWN_OPENS = {"TextCorpus", "activations"}  # surgery's own ``X.open(...)`` API names, not files
GATE_MODULES = {"gate", "write", "maps", "libraries", "pretrained"}  # calls into surgery/files/ are the gate itself


def _receiver(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def file_accesses(source: str) -> list[str]:
    """``line: call`` for every call in ``source`` that touches a file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in NAMES:
            found.append(f"{node.lineno}: {func.id}(")
        elif isinstance(func, ast.Attribute) and _receiver(func.value) not in GATE_MODULES:
            owner = _receiver(func.value)
            calls = MODULE_CALLS.get(owner, set()) if owner in MODULE_CALLS else set()
            if owner in MODULE_CALLS and (calls is None or func.attr in calls):
                found.append(f"{node.lineno}: {owner}.{func.attr}(")
            elif func.attr in METHODS or (func.attr == "open" and owner not in OWN_OPENS | set(MODULE_CALLS)):
                found.append(f"{node.lineno}: .{func.attr}(")
    return found


def modules_outside_the_gate() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if GATE not in p.parents]


@pytest.mark.parametrize("path", modules_outside_the_gate(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_file_access_outside_the_gate(path: Path) -> None:
    stray = file_accesses(path.read_text())
    assert not stray, f"{path.relative_to(PACKAGE.parent)} touches files itself ({stray}); go through surgery/files/"


@pytest.mark.parametrize(
    "line",
    [
        "open('x')",
        "Path(p).read_text()",
        "p.write_bytes(b'')",
        "sorted(d.iterdir())",
        "d.rglob('*.txt')",
        "json.load(f)",
        "np.load(p)",
        "torch.load(p, weights_only=True)",
        "safe_open(str(p), framework='pt')",
        "load_file(p)",
        "os.listdir(d)",
        "shutil.rmtree(d)",
        "mmap.mmap(f.fileno(), 0)",
        "fig.savefig(p)",
        "AutoModel.from_pretrained(d)",
        "tempfile.mkdtemp()",
        "gzip.open(p)",
        "path.open('rb')",
    ],
)
def test_the_check_finds_a_stray_access(line: str) -> None:
    """The checker itself: each way of touching a file is found, inside a function too."""
    assert file_accesses(f"def f():\n    return {line}\n"), line


@pytest.mark.parametrize("line", ["json.loads(s)", "'a'.replace('a', 'b')", "items.remove(x)", "TextCorpus.open(c)"])
def test_the_check_leaves_plain_calls_alone(line: str) -> None:
    assert not file_accesses(line)
