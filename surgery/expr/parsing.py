"""Expression text to a syntax tree within limits, einsum equations, and literal index subscripts (``"[:, 3:5]"``).

The limits (length, bracket depth) are checked before the parser sees the text, so a hostile
config cannot make ``ast.parse`` recurse or allocate without bound.
"""

from __future__ import annotations

import ast
from typing import Any

from surgery.errors import ConfigError
from surgery.expr.runtime import shorten

MAX_LENGTH = 2000
MAX_DEPTH = 50


def check_text(text: Any, where: str) -> str:
    """Refuse non-strings, overlong texts and deep bracket nesting before the parser sees them."""
    if not isinstance(text, str):
        raise ConfigError(f"{where}: expected an expression string, got {type(text).__name__} {text!r}")
    if len(text) > MAX_LENGTH:
        raise ConfigError(f"{where}: expression is longer than {MAX_LENGTH} characters: '{shorten(text)}'")
    depth = deepest = 0
    for char in text:
        depth += (char in "([{") - (char in ")]}")
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        raise ConfigError(f"{where}: brackets are nested deeper than {MAX_DEPTH} levels: '{shorten(text)}'")
    return text.strip()


def parse_text(source: str, text: str, where: str) -> ast.Expression:
    """``source`` parsed as one Python expression; a syntax error is a ConfigError quoting ``text``."""
    try:
        return ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        reason = getattr(error, "msg", None) or type(error).__name__
        raise ConfigError(f"{where}: '{shorten(text)}' is not a valid expression ({reason})") from None


MAX_BINDINGS = 32


def parse_program(text: str, where: str) -> tuple[list[tuple[str, ast.expr]], ast.expr]:
    """``text`` as ``NAME = expr; ...; result`` (``;`` or new lines): the bindings in order and the result.

    A plain expression has no bindings. Anything else (imports, attribute or tuple targets, ``+=``, a text that
    ends with a binding) is a ConfigError quoting the text; positions stay those of ``text`` for messages.
    """
    try:
        return [], ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        eval_error = error
    try:
        statements = ast.parse(text, mode="exec").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        reason = getattr(eval_error, "msg", None) or type(eval_error).__name__
        raise ConfigError(f"{where}: '{shorten(text)}' is not a valid expression ({reason})") from None
    bindings: list[tuple[str, ast.expr]] = []
    for statement in statements[:-1]:
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name)):  # fmt: skip
            part = ast.get_source_segment(text, statement) or text
            raise ConfigError(
                f"{where}: '{shorten(part)}' in '{shorten(text)}': before the result only bindings NAME = expression"
                " are allowed (separated by ';' or new lines)"
            )
        bindings.append((statement.targets[0].id, statement.value))
    last = statements[-1] if statements else None
    if not isinstance(last, ast.Expr):
        raise ConfigError(f"{where}: '{shorten(text)}' must end with the expression whose value is the result")
    if len(bindings) > MAX_BINDINGS:
        raise ConfigError(f"{where}: {len(bindings)} bindings in '{shorten(text)}'; at most {MAX_BINDINGS}")
    return bindings, last.value


def einsum_problem(equation: str, operands: int) -> str | None:
    """Why an einsum equation cannot work with ``operands`` tensors, or None (checked before any model runs)."""
    if not equation or set(equation) - set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ,->. "):
        return "an einsum equation uses letters, ',', '->' and '...' only, e.g. 'bij,bjk->bik'"
    text = equation.replace(" ", "")
    if text.count("->") > 1 or text.replace("->", "").count("-") or text.replace("->", "").count(">"):
        return "an einsum equation has at most one '->'"
    inputs, _, output = text.partition("->")
    terms = inputs.split(",")
    if len(terms) != operands:
        return f"the equation names {len(terms)} operand(s), the call gives {operands}"
    for term in [*terms, output]:
        if term.replace("...", "", 1).count("."):  # the character check left only letters, dots and one '->'
            return f"{term!r}: each term is letters with at most one '...'"
    if "->" in text:
        letters = output.replace("...", "")
        unknown = sorted(set(letters) - set(inputs))
        if unknown or len(set(letters)) != len(letters):
            return f"the output {output!r} must use each input letter at most once" + (
                f"; {', '.join(unknown)} is in no input" if unknown else ""
            )
    return None


def _literal_index_part(node: ast.expr) -> Any:
    """The value of one literal index part, or raise ValueError."""
    if isinstance(node, ast.Slice):
        lower, upper, step = (None if p is None else _literal_int(p) for p in (node.lower, node.upper, node.step))
        if step is not None and step <= 0:
            raise ValueError("slice steps must be positive (use flip to reverse)")
        return slice(lower, upper, step)
    if isinstance(node, ast.Constant) and (node.value is None or node.value is Ellipsis):
        return node.value
    return _literal_int(node)


def _literal_int(node: ast.expr) -> int:
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        sign, node = -1, node.operand
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return sign * node.value
    raise ValueError("only integers, slices of integers, '...' and None are allowed")


def compile_index(text: str, where: str) -> tuple[Any, ...]:
    """Turn a literal index like ``"[:, 3:5]"`` into ``(slice(None), slice(3, 5))``; nothing is evaluated."""
    if isinstance(text, str):
        found = _INDEXES.get(text)
        if found is not None:
            return found
    index = _compile_index(text, where)
    if len(_INDEXES) >= MAX_KEPT_INDEXES:
        _INDEXES.clear()
    _INDEXES[text] = index  # a tuple of ints, slices, None and Ellipsis: nothing a caller can change
    return index


_INDEXES: dict[str, tuple[Any, ...]] = {}  # each index text parsed once (a study's cells repeat them)
MAX_KEPT_INDEXES = 4096


def _compile_index(text: str, where: str) -> tuple[Any, ...]:
    text = check_text(text, where)
    if not (text.startswith("[") and text.endswith("]")):
        raise ConfigError(f"{where}: an index must be written in brackets, like '[:, 3:5]'; got '{shorten(text)}'")
    source = "x" + text
    body = parse_text(source, text, where).body
    if not (isinstance(body, ast.Subscript) and isinstance(body.value, ast.Name)):
        raise ConfigError(f"{where}: '{shorten(text)}' is not a single index like '[:, 3:5]'")
    parts = body.slice.elts if isinstance(body.slice, ast.Tuple) else [body.slice]
    index = []
    for part in parts:
        try:
            index.append(_literal_index_part(part))
        except ValueError as error:
            segment = ast.get_source_segment(source, part) or text
            raise ConfigError(f"{where}: {error}: '{segment}' in '{shorten(text)}'") from None
    return tuple(index)
