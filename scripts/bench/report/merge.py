"""``--only NAME --merge``: rewrite one benchmark's part of BENCHMARKS.md and keep the rest as it is.

A full run takes over half an hour; a change to one benchmark should not need it, nor the other
benchmarks' JSON results (they stay on the machine that ran them). A benchmark's part is its
section (from its ``## N.`` heading to the next ``## ``), its rows of the Targets table (matched by
their first cell; a row whose name changed must be removed by a full run) and its bullets under
"Over a target, and why" (matched by the prefix its misses start with).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scripts.bench.circuits import circuits_section
from scripts.bench.plan_cache import plan_cache_section
from scripts.bench.report.attribution import attribution_section
from scripts.bench.report.gpu import gpu_section
from scripts.bench.report.harvest import harvest_section
from scripts.bench.report.sections import plan_section, startup_section
from scripts.bench.report.splices import splice_section
from scripts.bench.report.studies import data_section, lm_section, study_section, training_section
from scripts.bench.sites import sites_section

Section = Callable[[dict[str, Any] | None], tuple[list[str], list[list[str]], list[str]]]
# name → (section function, how its misses start)
MERGEABLE: dict[str, tuple[Section, str]] = {
    "plan": (plan_section, "plan at"),
    "startup": (startup_section, "CLI start-up"),
    "data": (data_section, "evaluate"),
    "lm": (lm_section, "generate:"),
    "training": (training_section, "training:"),
    "study": (study_section, "study:"),
    "gpu": (gpu_section, "GPU:"),
    "attribution": (attribution_section, "attribution:"),
    "splice": (splice_section, "splice:"),
    "harvest": (harvest_section, "harvest:"),
    "sites": (sites_section, "sites:"),
    "plan_cache": (plan_cache_section, "plan cache:"),
    "circuits": (circuits_section, "circuits:"),
}
MISSES = "### Over a target, and why"


def merge(text: str, data: dict[str, Any] | None, name: str) -> str:
    """``text`` (BENCHMARKS.md) with ``name``'s section, target rows and misses rendered from ``data``."""
    section, prefix = MERGEABLE[name]
    md, targets, misses = section(data)
    lines = text.rstrip("\n").split("\n")
    lines = _replace_section(lines, md)
    lines = _replace_targets(lines, targets)
    lines = _replace_misses(lines, prefix, misses)
    return "\n".join(lines).rstrip() + "\n"


def _replace_section(lines: list[str], md: list[str]) -> list[str]:
    number = md[0].split(" ", 2)[1]  # "## 11. Title" → "11."
    start = next((i for i, line in enumerate(lines) if line.startswith(f"## {number} ")), None)
    if start is None:
        return [*lines, "", *md]
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [*lines[:start], *md, *lines[end:]]


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _replace_targets(lines: list[str], targets: list[list[str]]) -> list[str]:
    heading = lines.index("## Targets")
    first = next(i for i in range(heading, len(lines)) if lines[i].startswith("|"))
    last = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines)) - 1
    table = lines[first : last + 1]
    for row in targets:
        match = next((i for i, line in enumerate(table) if line.startswith(f"| {row[0]} |")), None)
        if match is None:
            table.append(_row(row))
        else:
            table[match] = _row(row)
    return [*lines[:first], *table, *lines[last + 1 :]]


def _replace_misses(lines: list[str], prefix: str, misses: list[str]) -> list[str]:
    bullets = [f"- {m}" for m in misses]
    if MISSES not in lines:
        if not bullets:
            return lines
        heading = lines.index("## Targets")
        after = next(i for i in range(heading + 1, len(lines)) if lines[i].startswith("#"))
        return [*lines[:after], MISSES, "", *bullets, "", *lines[after:]]
    start = lines.index(MISSES) + 2
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("- ")), len(lines))
    kept = [b for b in lines[start:end] if not b.startswith(f"- {prefix}")]
    return [*lines[:start], *kept, *bullets, *lines[end:]]
