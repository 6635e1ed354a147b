"""``calls:``, which calls of each selected module a hook acts on, and the counters behind it.

A call number counts one module's calls for one action from 0, from apply (or the last
``Surgery.reset_calls()``). ``calls`` is a Python slice string (``"1:"``, ``":2"``, ``"::2"``,
``"3"``), an int, or a list of ints. Only what can be known before running is accepted: no
negative numbers (the last call is not known while the model runs), no step <= 0, and no slice
that can never match (``"5:5"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Wanted = Callable[[int], bool]


class CallCounter:
    """One module's call number for one action's hook; ``reset_calls`` sets it back to 0."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


def _number(text: str, value: Any) -> int | None:
    text = text.strip()
    if not text:
        return None
    try:
        number = int(text)
    except ValueError:
        raise ValueError(
            f"{value!r} is not a slice of call numbers such as '1:', ':2', '::2' or a list [0, 2]"
        ) from None
    if number < 0:
        raise ValueError(f"{value!r}: calls are counted from 0 as they happen, so a negative number cannot be known")
    return number


def parse_calls(value: Any) -> Wanted | None:
    """The predicate ``wanted(call_number)`` for a ``calls`` value (None: every call); ValueError says why not."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a call number, a slice such as '1:' or a list of call numbers")
    if isinstance(value, int):
        value = [value]
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{value!r}: a list of calls needs at least one int call number, e.g. [0, 2]")
        if any(v < 0 for v in value):
            raise ValueError(
                f"{value!r}: calls are counted from 0 as they happen, so a negative number cannot be known"
            )
        return frozenset(value).__contains__
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a slice string such as '1:' or a list of call numbers")
    parts = value.split(":")
    if len(parts) == 1:
        only = _number(parts[0], value)
        if only is None:
            raise ValueError(f"{value!r} is empty; give a slice such as '1:' or a list of call numbers")
        return frozenset({only}).__contains__
    if len(parts) > 3:
        raise ValueError(f"{value!r} is not a slice: at most start:stop:step")
    start, stop, step = (_number(p, value) for p in (*parts, "")[:3])
    if step == 0:
        raise ValueError(f"{value!r}: a slice step must be positive")
    first, every = start or 0, step or 1
    if stop is not None and first >= stop:
        raise ValueError(f"{value!r} can never match: it selects no call number")
    if every == 1:
        return (lambda n: n >= first) if stop is None else (lambda n: first <= n < stop)
    if stop is None:
        return lambda n: n >= first and (n - first) % every == 0
    return lambda n: first <= n < stop and (n - first) % every == 0


def gated(hook: Callable[..., Any], wanted: Wanted, counter: CallCounter) -> Callable[..., Any]:
    """``hook`` run on the calls ``wanted`` picks; on the others the wrapper returns None (changes nothing)."""

    def gate(*args: Any) -> Any:
        n = counter.n
        counter.n = n + 1
        if wanted(n):
            return hook(*args)
        return None

    return gate
