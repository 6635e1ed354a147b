"""Markdown helpers every section of BENCHMARKS.md uses, and reading a benchmark's JSON result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def short(text: str, limit: int = 110) -> str:
    """``text`` cut at a word boundary within ``limit`` characters."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " …"


def ms(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "–"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.2f} s"


def yes(met: bool) -> str:
    return "**met**" if met else "**not met**"


def load_note(data: dict[str, Any]) -> str:
    """A sentence with the load average when this benchmark started, and a warning when it exceeded the CPUs."""
    info = data.get("machine", {})
    load, cpus = info.get("load_1min"), info.get("nproc") or 1
    if load is None:
        return ""
    if load > cpus:
        return (
            f" **Measured under load** (load average {load} on {cpus} CPUs when it started): absolute times are"
            " inflated and noisy; rerun on a quiet machine for final numbers."
        )
    return f" Load average (1 min) when it started: {load}."
