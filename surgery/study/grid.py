"""A study's grid: named variables, their values, the cells, and ``{name}`` placeholders filled per cell.

>>> grid = parse_grid({"layer": "0:3", "pos": [1, 4]})
>>> cells(grid)[:2]
[{'layer': 0, 'pos': 1}, {'layer': 0, 'pos': 4}]
>>> fill({"patch": {"select": "transformer.h.{layer}", "index": "[:, {pos}]"}}, {"layer": 2, "pos": 4})
{'patch': {'select': 'transformer.h.2', 'index': '[:, 4]'}}

A string that is exactly one placeholder takes the variable's value with its type (``value: "{coef}"``
becomes the number); elsewhere the value is written into the text. ``{{`` and ``}}`` are literal braces.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from surgery.errors import ConfigError, SurgeryError
from surgery.safe.costs import check_cells, parse_range, range_size

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def parse_grid(
    grid: Mapping[str, Any],
    positions: int | None = None,
    where: str = "study.grid",
    every: Mapping[str, int] | None = None,
) -> dict[str, list]:
    """Each variable's values: a list, a ``"start:stop[:step]"`` range, or ``"all"``.

    ``all`` is ``range(every[name])`` where :func:`surgery.study.every.every_value` worked out what the
    variable counts (blocks, heads, positions), else every position. The cells are counted from each
    variable's value count (a range by arithmetic) and checked against ``limits.count`` before any value
    is listed.
    """
    if not isinstance(grid, Mapping) or not grid:
        raise ConfigError(f'{where}: a mapping of named variables, e.g. {{layer: "0:3", pos: all}}; got {grid!r}')
    given: dict[str, Sequence[Any]] = {}
    for name, values in grid.items():
        at = f"{where}.{name}"
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(f"{at}: a variable name is letters, digits and _, not starting with a digit")
        given[name] = _values(values, (every or {}).get(name, positions), at)
    check_cells((_count(v) for v in given.values()), where)
    return {name: list(values) for name, values in given.items()}


def grid_cells(grid: Mapping[str, Any], where: str = "study.grid") -> int:
    """How many cells ``grid`` has, from the config alone (``all`` counted as one position), checked against
    ``limits.count``: what a job checks before it builds the model."""
    if not isinstance(grid, Mapping) or not grid:
        return 0
    counts = (
        1 if values == "all" else _count(_values(values, None, f"{where}.{name}")) for name, values in grid.items()
    )
    return check_cells(counts, where)


def _count(values: Sequence[Any]) -> int:
    return range_size(values) if isinstance(values, range) else len(values)


def _values(values: Any, positions: int | None, at: str) -> Sequence[Any]:
    """A variable's values: a list, or a lazy ``range`` (counted before it is listed)."""
    if isinstance(values, str):
        if values == "all":
            if positions is None:
                raise ConfigError(f"{at}: 'all' means every position of a text input; give a range such as '0:13'")
            return range(positions)
        found = parse_range(values, at)
        if found is None:
            raise ConfigError(f"{at}: a list of values, a range 'start:stop[:step]' or 'all'; got {values!r}")
        if range_size(found) == 0:
            raise ConfigError(f"{at}: the range {values!r} is empty")
        return found
    if isinstance(values, Sequence) and not isinstance(values, (bytes, bytearray)):
        if not values:
            raise ConfigError(f"{at}: no values; give at least one")
        for value in values:
            if not isinstance(value, (int, float, str, bool)):
                raise ConfigError(f"{at}: values are numbers or texts; got {value!r}")
        return list(values)
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        return [values]
    raise ConfigError(f"{at}: a list of values, a range 'start:stop[:step]' or 'all'; got {values!r}")


def cells(grid: Mapping[str, list]) -> list[dict[str, Any]]:
    """Every combination of the variables' values, the last variable varying fastest."""
    names = list(grid)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(grid[n] for n in names))]


def placeholders(node: Any, where: str = "actions") -> dict[str, str]:
    """Every variable named by a ``{name}`` in a string value of ``node``: name → the first key using it."""
    found: dict[str, str] = {}
    for at, text in _strings(node, where):
        for match in _PLACEHOLDER.finditer(text):
            name = match.group(1)
            if name is None:
                continue  # {{ or }}
            if not _NAME.fullmatch(name):
                raise ConfigError(f"{at}: {{{name}}} is not a variable name; write {{{{ and }}}} for literal braces")
            found.setdefault(name, at)
    return found


def check_uses(grid: Mapping[str, list], actions: Any, where: str = "actions") -> None:
    """Every placeholder names a variable of the grid, and every variable is used by some action."""
    used = placeholders(actions, where)
    for name, at in used.items():
        if name not in grid:
            known = ", ".join(grid) or "none"
            raise ConfigError(f"{at}: {{{name}}} names no variable of study.grid (variables: {known})")
    for name in grid:
        if name not in used:
            raise ConfigError(f"study.grid.{name}: no action uses it; write {{{name}}} in an action's value")


def cell_text(cell: Mapping[str, Any]) -> str:
    """A cell as its errors and reports name it: ``{layer: 0, pos: 3}``."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in cell.items()) + "}"


@contextmanager
def naming(cell: Mapping[str, Any]) -> Iterator[None]:
    """A SurgeryError raised inside, again with the cell in front: ``study cell {layer: 0, pos: 3}: ...``."""
    try:
        yield
    except SurgeryError as e:
        raise type(e)(f"study cell {cell_text(cell)}: {e}") from None


def fill(node: Any, cell: Mapping[str, Any]) -> Any:
    """``node`` with every placeholder replaced by the cell's value (a whole-placeholder string keeps the type)."""
    if isinstance(node, Mapping):
        return {key: fill(value, cell) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return [fill(value, cell) for value in node]
    if not isinstance(node, str):
        return node
    whole = _PLACEHOLDER.fullmatch(node)
    if whole is not None and whole.group(1) is not None:
        return cell[whole.group(1)]

    def put(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return match.group(0)[0]
        return str(cell[match.group(1)])

    return _PLACEHOLDER.sub(put, node)


def filler(text: str) -> Callable[[Mapping[str, Any]], Any]:
    """``fill`` of one string with its placeholders found once, for filling the same text in many cells."""
    whole = _PLACEHOLDER.fullmatch(text)
    if whole is not None and whole.group(1) is not None:
        name = whole.group(1)
        return lambda cell: cell[name]
    parts: list[tuple[bool, str]] = []  # (a variable's name?, the text or the name)
    at = 0
    for match in _PLACEHOLDER.finditer(text):
        parts.append((False, text[at : match.start()]))
        named = match.group(1) is not None
        parts.append((True, match.group(1)) if named else (False, match.group(0)[0]))
        at = match.end()
    parts.append((False, text[at:]))
    return lambda cell: "".join(str(cell[t]) if named else t for named, t in parts)


def _strings(node: Any, where: str) -> list[tuple[str, str]]:
    if isinstance(node, Mapping):
        return [s for key, value in node.items() for s in _strings(value, f"{where}.{key}")]
    if isinstance(node, list | tuple):
        return [s for i, value in enumerate(node) for s in _strings(value, f"{where}[{i}]")]
    return [(where, node)] if isinstance(node, str) else []
