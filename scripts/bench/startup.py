"""Start-up cost of the CLI: ``python -m surgery +model=cnn +actions=linearize`` minus ``python -c "import torch"``.

Both commands run several times, interleaved, each in a fresh interpreter; the medians are
compared (wall time, and CPU time, which a busy neighbour does not inflate). ``python -X
importtime`` on the CLI then says which packages' imports take the time (their own modules' time).

    python -m scripts.bench.startup [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from typing import Any

from scripts.bench.common import ROOT, machine, run_child, write_json

TARGET_S = 1.0
CLI = ["-m", "surgery", "+model=cnn", "+actions=linearize"]
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)")


def cli_args(directory: str) -> list[str]:
    return [sys.executable, *CLI, f"hydra.run.dir={directory}"]


def import_times(directory: str) -> list[dict[str, Any]]:
    """Import time of the CLI run by top-level package, its own modules only (``self`` of ``-X importtime``)."""
    run = run_child([sys.executable, "-X", "importtime", *cli_args(directory)[1:]], cwd=ROOT, env=env())
    totals: dict[str, int] = {}
    for line in run.stderr.splitlines():
        match = IMPORT_LINE.match(line)
        if match:
            root = match.group(4).split(".")[0]
            totals[root] = totals.get(root, 0) + int(match.group(1))
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return [{"package": name, "self_s": us / 1e6} for name, us in ranked[:12]]


def env() -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two runs each")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    runs = 2 if args.quick else args.runs
    torch_only = [sys.executable, "-c", "import torch"]
    walls: dict[str, list[float]] = {"import torch": [], "cli": []}
    cpus: dict[str, list[float]] = {"import torch": [], "cli": []}
    with tempfile.TemporaryDirectory() as directory:
        run_child(cli_args(directory), cwd=ROOT, env=env())  # warm the file cache for both
        for i in range(runs):
            order = [("import torch", torch_only), ("cli", cli_args(directory))]
            for name, command in order if i % 2 == 0 else reversed(order):
                run = run_child(command, cwd=ROOT, env=env())
                walls[name].append(run.wall_s)
                cpus[name].append(run.cpu_s)
        imports = import_times(directory)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    extra_wall = wall["cli"] - wall["import torch"]
    extra_cpu = cpu["cli"] - cpu["import torch"]
    print(f"import torch {wall['import torch']:.2f} s wall ({cpu['import torch']:.2f} s CPU)")
    print(f"cli          {wall['cli']:.2f} s wall ({cpu['cli']:.2f} s CPU)")
    print(f"cli - torch  {extra_wall:.2f} s wall ({extra_cpu:.2f} s CPU); target <= {TARGET_S} s")
    for row in imports:
        print(f"  import {row['package']:24} {row['self_s']:.3f} s")
    write_json(
        args.json,
        {
            "machine": machine(),
            "command": "python " + " ".join(CLI),
            "runs": runs,
            "wall_s": wall,
            "cpu_s": cpu,
            "all_wall_s": walls,
            "extra_wall_s": extra_wall,
            "extra_cpu_s": extra_cpu,
            "target_s": TARGET_S,
            "met": extra_wall <= TARGET_S,
            "imports": imports,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
