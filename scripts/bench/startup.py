"""Start-up cost of the CLI: ``python -m surgery +model=cnn +actions=linearize`` minus ``python -c "import torch"``.

Both commands run several times, interleaved, each in a fresh interpreter; the medians are
compared (wall time, and CPU time, which a busy neighbour does not inflate). ``python -X
importtime`` on the CLI then says which packages' imports take the time (their own modules' time).

    python -m scripts.bench.startup [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from scripts.bench.common import ROOT, cli_env, import_times, machine, run_child, write_json

TARGET_S = 1.0
CLI = ["-m", "surgery", "+model=cnn", "+actions=linearize"]


def cli_args(directory: str) -> list[str]:
    return [sys.executable, *CLI, f"hydra.run.dir={directory}"]


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
        run_child(cli_args(directory), cwd=ROOT, env=cli_env())  # warm the file cache for both
        for i in range(runs):
            order = [("import torch", torch_only), ("cli", cli_args(directory))]
            for name, command in order if i % 2 == 0 else reversed(order):
                run = run_child(command, cwd=ROOT, env=cli_env())
                walls[name].append(run.wall_s)
                cpus[name].append(run.cpu_s)
        imports = import_times(cli_args(directory), 12)
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
