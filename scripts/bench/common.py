"""What the benchmark scripts share: the checkout on sys.path, interleaved timing, the machine, JSON out.

Timing runs every variant of a case in the same process, interleaved (A B C, then C B A, ...),
and compares variants within each round, so drift and a busy neighbour affect both sides of a
ratio alike. Times are CPU time of this process (``time.process_time_ns``), with torch on one
thread: a neighbour on a shared machine steals wall time, not CPU time.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmark this checkout's code, whatever else is installed

os.environ.setdefault("HF_HUB_OFFLINE", "1")

Attach = Callable[[], Callable[[], None]]  # installs a variant, returns the function that removes it


@dataclass
class Variant:
    """One way of doing a task: ``attach()`` installs it and returns ``detach``; ``step`` runs one call."""

    name: str
    attach: Attach
    step: Callable[[], Any]


@dataclass
class Timing:
    """Per-call CPU seconds of each variant in each round."""

    rounds: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.rounds[name])

    def ratios(self, name: str, base: str) -> list[float]:
        """``name``/``base`` of each round (both measured in the same round)."""
        return [a / b for a, b in zip(self.rounds[name], self.rounds[base])]

    def ratio(self, name: str, base: str) -> float:
        """Median over rounds of ``name``/``base`` measured in the same round."""
        return statistics.median(self.ratios(name, base))

    def spread(self, name: str, base: str) -> tuple[float, float]:
        """First and third quartile of the per-round ratios: how far noise moves the median."""
        return quartiles(self.ratios(name, base))


def interleave(
    variants: Sequence[Variant],
    rounds: int,
    reps: int,
    warmup: int = 1,
    settled: Callable[[Timing], bool] | None = None,
    max_s: float = 0.0,
) -> Timing:
    """Time every variant ``reps`` calls per round (after ``warmup`` calls), alternating the order each round.

    With ``settled``, pairs of rounds are added after the first ``rounds`` until ``settled(timing)``
    (e.g. the quartiles of a ratio are narrower than a target's margin) or ``max_s`` CPU seconds.
    """
    timing = Timing({v.name: [] for v in variants})
    start = time.process_time()
    r = 0
    while True:
        for variant in variants if r % 2 == 0 else list(reversed(variants)):
            detach = variant.attach()
            try:
                for _ in range(warmup):
                    variant.step()
                gc.collect(1)  # young garbage only: a full collection over a loaded model costs more than a block
                begin = time.process_time_ns()
                for _ in range(reps):
                    variant.step()
                timing.rounds[variant.name].append((time.process_time_ns() - begin) / reps / 1e9)
            finally:
                detach()
        r += 1
        if r < rounds or (r - rounds) % 2:  # rounds past the first come in pairs, both orders
            continue
        if settled is None or settled(timing) or time.process_time() - start >= max_s:
            break
    return timing


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """First and third quartile (min and max under 4 values)."""
    if len(values) < 4:
        return min(values), max(values)
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def verdict(low: float, high: float, target: float) -> str:
    """``met`` only when the whole interquartile range is at or under ``target``; ``over`` when all of it is above."""
    if high <= target:
        return "met"
    return "over" if low > target else "within noise"


def nothing() -> Callable[[], None]:
    """``attach`` for a variant with nothing to install."""
    return lambda: None


def machine() -> dict[str, Any]:
    """CPU count and model, python, torch and peer versions, whether other work shares the machine."""
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_1min": round(load, 2),
    }


def version_of(package: str) -> str | None:
    """The installed version of ``package``, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` (nothing when None)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str))


@dataclass
class ChildRun:
    """A finished child process: wall seconds, CPU seconds (user + system), peak RSS, its output."""

    wall_s: float
    cpu_s: float
    peak_rss_mib: float
    stdout: str
    stderr: str


def run_child(args: Sequence[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> ChildRun:
    """Run ``args`` to the end and measure it alone (``wait4`` gives this child's own resource use)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
            list(args), stdout=out, stderr=err, text=True, cwd=cwd, env={**os.environ, **(env or {})}
        )
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, so Popen never waits on it
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        run = ChildRun(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out.read(), err.read())
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{run.stderr[-3000:]}")
    return run


def fmt_ratio(value: float) -> str:
    return f"{value:.3f}"


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"


IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)")


def cli_env() -> dict[str, str]:
    """The environment a benchmarked ``python -m surgery`` child runs with (this checkout on the path)."""
    return {"PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}


def import_times(command: Sequence[str], top: int) -> list[dict[str, Any]]:
    """Import time of ``command`` (``[python, args...]``) by top-level package, own modules only (``-X importtime``)."""
    run = run_child([command[0], "-X", "importtime", *command[1:]], cwd=ROOT, env=cli_env())
    totals: dict[str, int] = {}
    for line in run.stderr.splitlines():
        match = IMPORT_LINE.match(line)
        if match:
            root = match.group(4).split(".")[0]
            totals[root] = totals.get(root, 0) + int(match.group(1))
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return [{"package": name, "self_s": us / 1e6} for name, us in ranked[:top]]
