"""Every Python name README.md and docs/*.md document exists (issue 25: `Surgery.flush` outlived its method).

Names are found statically, by reading the package's source with ``ast`` (no import, so no optional
dependency is paid for): dotted ``surgery.a.b.c`` paths anywhere in backticks or code blocks (``_target_``
values, ``surgery.apply(``), ``Class.attr`` for any class the package defines (``Surgery.remove()``,
``Record.sources``), ``from surgery.x import y`` and ``import surgery.x`` lines, and the modules run with
``python -m surgery.x`` (which must have a ``__main__`` guard or a ``__main__.py``), and the repository's
files a doc points to (``surgery/core/globs.py``, ``conf/actions/patch_resid.yaml``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "surgery"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

DOTTED = re.compile(r"(?<![\w./:-])surgery(?:\.[A-Za-z_]\w*)+")
ATTRIBUTE = re.compile(r"(?<![\w.])([A-Z]\w*)\.([a-z_]\w*)")
FROM_IMPORT = re.compile(r"^\s*from (surgery(?:\.\w+)*) import \(?([\w, ]+)\)?")
IMPORT = re.compile(r"^\s*import ([\w., ]+)")
RUN_MODULE = re.compile(r"-m (surgery(?:\.\w+)*)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FILE = re.compile(r"(?<![\w/.-])((?:surgery|conf|scripts|tests|docs)/[\w/.-]+\.(?:py|yaml|md|sh))\b")
PLACEHOLDER = re.compile(r"\b[A-Z]{2,}\b")  # conf/actions/NAME.yaml names no file


def documented_text(text: str) -> list[str]:
    """The parts of a markdown text that name code: each line of a fenced block, each backticked span."""
    parts, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        parts += [line] if fenced else CODE_SPAN.findall(line)
    return parts


def documented_names(text: str) -> set[tuple[str, str]]:
    """(how, name) for every name the text documents: ``path``, ``attr``, ``import``, ``run``."""
    found: set[tuple[str, str]] = set()
    for part in documented_text(text):
        found |= {("path", name) for name in DOTTED.findall(part)}
        found |= {("attr", f"{cls}.{attr}") for cls, attr in ATTRIBUTE.findall(part) if cls in classes()}
        found |= {("run", name) for name in RUN_MODULE.findall(part)}
        found |= {("file", name) for name in FILE.findall(part) if not PLACEHOLDER.search(name)}
        if m := FROM_IMPORT.match(part):
            found |= {("path", f"{m[1]}.{n.split(' as ')[0].strip()}") for n in m[2].split(",") if n.strip()}
        elif m := IMPORT.match(part):
            found |= {
                ("module", n.split(" as ")[0].strip()) for n in m[1].split(",") if n.strip().startswith("surgery")
            }
    return found


# --- the package, read with ast ---------------------------------------------------------------------------------


def module_file(dotted: str) -> Path | None:
    """The source file of module ``dotted`` (``surgery.a.b``), or None."""
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def top_level(module: ast.Module) -> dict[str, ast.AST]:
    """Names a module binds at its top level (``if``/``try`` bodies included) and what binds them."""
    names: dict[str, ast.AST] = {}
    todo = list(module.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [n for h in getattr(node, "handlers", []) for n in h.body]
    return names


@functools.cache
def classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Every top-level class the package defines: name -> [(module, class node)]."""
    found: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in tree(path).body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append((module, node))
    return found


def class_has(module: str, node: ast.ClassDef, attr: str, seen: int = 0) -> bool:
    """Whether class ``node`` of ``module`` (or a base) has ``attr``: method, class attribute, field, ``self.attr``."""
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and item.name == attr:
            return True
        if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in item.targets):
            return True
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == attr:
            return True
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
                and t.attr == attr
            ):
                return True
    return seen < 8 and any(base_has(module, base, attr, seen + 1) for base in node.bases)


def base_has(module: str, base: ast.expr, attr: str, seen: int) -> bool:
    """Whether base class ``base`` (as written in ``module``) has ``attr``; bases outside surgery are imported."""
    if isinstance(base, ast.Subscript):  # Generic[T]
        base = base.value
    text = ast.unparse(base)
    head, _, rest = text.partition(".")
    path = module_file(module)
    bound = top_level(tree(path)).get(head) if path else None
    if isinstance(bound, ast.ClassDef):
        return class_has(module, bound, attr, seen)
    if isinstance(bound, ast.ImportFrom) and bound.module:
        origin = bound.module
        real = next(a.name for a in bound.names if (a.asname or a.name) == head)
        dotted = ".".join(p for p in (origin, real, rest) if p)
    elif isinstance(bound, ast.Import):
        dotted = text
    else:
        return False
    if dotted.startswith("surgery."):
        return resolve(f"{dotted}.{attr}") is None
    owner_module, _, name = dotted.rpartition(".")
    try:  # a base from torch or the standard library: ask it
        return hasattr(getattr(importlib.import_module(owner_module), name), attr)
    except (ImportError, AttributeError):
        return False


def resolve(dotted: str) -> str | None:
    """None when ``surgery.a.b.c`` exists (a module, or names bound in one); else what is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is not None:
            return _resolve_in(".".join(parts[:cut]), parts[cut:])
    return f"no module {parts[0]}"


def _resolve_in(module: str, rest: list[str]) -> str | None:
    if not rest:
        return None
    path = module_file(module)
    assert path is not None
    bound = top_level(tree(path)).get(rest[0])
    if bound is None:
        return f"{module} has no {rest[0]!r}"
    if isinstance(bound, ast.ImportFrom) and len(rest) > 1:
        real = next(a.name for a in bound.names if (a.asname or a.name) == rest[0])
        origin = bound.module or ""
        if bound.level:  # relative import
            origin = ".".join(module.split(".")[: -bound.level + (1 if path.name == "__init__.py" else 0) or None])
            origin = f"{origin}.{bound.module}" if bound.module else origin
        return resolve(".".join([origin, real, *rest[1:]])) if origin.startswith("surgery") else None
    if isinstance(bound, ast.ClassDef) and len(rest) > 1:
        return None if class_has(module, bound, rest[1]) else f"{module}.{rest[0]} has no {rest[1]!r}"
    return None  # an attribute of a function or a value: not checked further


def run_module(dotted: str) -> str | None:
    """None when ``python -m dotted`` runs something: a module with a main guard, or a package with __main__.py."""
    path = module_file(dotted)
    if path is None:
        return f"no module {dotted}"
    if path.name == "__init__.py":
        return None if (path.parent / "__main__.py").is_file() else f"package {dotted} has no __main__.py"
    return None if '__name__ == "__main__"' in path.read_text() else f'{dotted} has no `if __name__ == "__main__"`'


def missing(how: str, name: str) -> str | None:
    if how in ("path", "module"):
        return resolve(name)
    if how == "run":
        return run_module(name)
    if how == "file":
        return None if (ROOT / name).exists() else "no such file in the repository"
    cls, attr = name.split(".")
    if any(class_has(module, node, attr) for module, node in classes()[cls]):
        return None
    return f"class {cls} has no {attr!r}"


def cases() -> list[tuple[str, str, str]]:
    return sorted(
        (doc.relative_to(ROOT).as_posix(), how, name) for doc in DOCS for how, name in documented_names(doc.read_text())
    )


@pytest.mark.parametrize(("doc", "how", "name"), cases(), ids=lambda v: v)
def test_every_documented_name_exists(doc: str, how: str, name: str) -> None:
    problem = missing(how, name)
    assert problem is None, f"{doc} documents {name!r} ({how}), but {problem}"


def test_the_docs_name_enough_to_be_worth_checking() -> None:
    kinds = {how for _, how, _ in cases()}
    assert len(cases()) >= 40 and kinds >= {"path", "attr", "run", "file"}, (len(cases()), kinds)


def test_the_extractor_finds_what_a_doc_names_and_flags_what_is_gone() -> None:
    text = """
In Python, `Surgery.flush(directory)` writes the next shard; `Surgery.remove()` undoes; `Tensor.add` is torch's.
Use `surgery.apply(model, plan)` or `python -m surgery.sweep DIR`, `_target_: surgery.models.mlp.Gone`.
```python
from surgery.core.select import ModuleIndex, nothing_here
import surgery.lm.metrics   # registers
callbacks.surgery.actions=capture
```
The rule is in `surgery/globs.py`; see `conf/actions/NAME.yaml` and `surgery/core/select.py`.
"""
    names = documented_names(text)
    assert names == {
        ("attr", "Surgery.flush"), ("attr", "Surgery.remove"), ("path", "surgery.apply"), ("path", "surgery.sweep"),
        ("run", "surgery.sweep"), ("path", "surgery.models.mlp.Gone"), ("path", "surgery.core.select.ModuleIndex"),
        ("path", "surgery.core.select.nothing_here"), ("module", "surgery.lm.metrics"), ("path", "surgery.core.select"),
        ("path", "surgery.lm.metrics"), ("file", "surgery/globs.py"), ("file", "surgery/core/select.py"),
    }  # fmt: skip
    gone = {name for how, name in names if missing(how, name)}
    assert gone == {"Surgery.flush", "surgery.models.mlp.Gone", "surgery.core.select.nothing_here", "surgery/globs.py"}
    assert missing("path", "surgery.Surgery.take_streamed") is None  # through the package's re-export
    assert missing("path", "surgery.Surgery.nope") == "surgery.core.engine.Surgery has no 'nope'"
    assert missing("run", "surgery.core.engine") is not None
