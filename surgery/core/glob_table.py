"""Matching a glob without backtracking, in time proportional to the name times the pattern: the captures
``rename`` fills in when one regex could backtrack to find them (several ``*`` in a segment, several ``**``),
and the names with an empty segment (``a..b``) that the yes/no regex of several ``**`` leaves out.

Both give what a backtracking regex would: each wildcard as long as it can be, left to right.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple


class _Piece(NamedTuple):
    """A fixed-width run of a segment's atoms between two stars, found forward or (reversed) backward."""

    forward: re.Pattern[str]
    backward: re.Pattern[str]  # the atoms reversed, searched in the reversed segment
    width: int
    wild: tuple[int, ...]  # offsets of the wildcards (?, [..]) inside the piece


def runs(atoms: list[tuple[str, bool] | None]) -> list[list[tuple[str, bool]]]:
    """The atoms between a segment's stars: one run more than it has stars."""
    runs: list[list[tuple[str, bool]]] = [[]]
    for atom in atoms:
        if atom is None:
            runs.append([])
        else:
            runs[-1].append(atom)
    return runs


def _pieces(atoms: list[tuple[str, bool] | None]) -> list[_Piece]:
    """The pieces between a segment's stars, to find forward and backward."""
    return [
        _Piece(
            re.compile("".join(a for a, _ in run)),
            re.compile("".join(a for a, _ in reversed(run))),
            len(run),
            tuple(k for k, (_, wild) in enumerate(run) if wild),
        )
        for run in runs(atoms)
    ]


def _match_segment(pieces: list[_Piece], text: str) -> list[str] | None:
    """The wildcards' captures when one segment's pattern matches ``text`` wholly, else None.

    Pieces are placed from the right, each as far right as it goes: that finds a match if there is
    one, and makes each star as long as it can be, left to right (what a backtracking regex picks).
    """
    n, first, last = len(text), pieces[0], pieces[-1]
    if len(pieces) == 1:
        found = first.forward.fullmatch(text)
        return None if found is None else [text[k] for k in first.wild]
    if (
        n < first.width + last.width
        or not first.forward.match(text)
        or not last.forward.fullmatch(text, n - last.width)
    ):
        return None
    starts = [0] * len(pieces)
    starts[-1] = end = n - last.width
    reversed_text = text[::-1]
    for i in range(len(pieces) - 2, 0, -1):
        found = pieces[i].backward.search(reversed_text, n - end, n - first.width)
        if found is None:
            return None
        starts[i] = end = n - found.end()
    captures = [text[k] for k in first.wild]
    for i in range(1, len(pieces)):
        captures.append(text[starts[i - 1] + pieces[i - 1].width : starts[i]])
        captures.extend(text[starts[i] + k] for k in pieces[i].wild)
    return captures


class LinearGlob:
    """One glob matched without backtracking: a table over (pattern segment, name segment)."""

    __slots__ = ("items",)

    def __init__(self, segments: list[str], atoms: list[Any]) -> None:
        self.items = [None if seg == "**" else _pieces(atoms[i]) for i, seg in enumerate(segments)]

    def captures(self, name: str) -> list[str] | None:
        """What each wildcard matched, in order (``**`` without its dots), or None when ``name`` does not match."""
        items = self.items
        if len(items) == 1 and items[0] is None:
            return [name] if name else None
        segs = name.split(".")
        count = len(segs)
        # ok[t][s]: items[t:] match segs[s:]; a '**' spans only non-empty segments, as its regex does
        ok = [[False] * (count + 1) for _ in range(len(items) + 1)]
        ok[-1][count] = True
        for t in range(len(items) - 1, -1, -1):
            row, after, pieces = ok[t], ok[t + 1], items[t]
            if pieces is None:
                row[count] = after[count]
                for s in range(count - 1, -1, -1):
                    row[s] = after[s] or (row[s + 1] and segs[s] != "")
            else:
                for s in range(count):
                    row[s] = after[s + 1] and _match_segment(pieces, segs[s]) is not None
        if not ok[0][0]:
            return None
        found: list[str] = []
        s = 0
        for t, pieces in enumerate(items):
            if pieces is None:  # as many segments as can be, like the regex's greedy '**'
                k = s
                while k < count and segs[k]:
                    k += 1
                while not ok[t + 1][k]:
                    k -= 1
                found.append(".".join(segs[s:k]))
                s = k
            else:
                found.extend(_match_segment(pieces, segs[s]) or ())
                s += 1
        return found

    def fullmatch(self, name: str) -> bool | None:
        return True if self.captures(name) is not None else None
