"""Start-up cost of the CLI: three jobs, each a whole process, against the imports no job can skip.

Jobs (``python -m surgery ...``):

- the main job ``+model=cnn +actions=linearize`` (the trained CNN on 359 digits, before and after);
- an MLP run ``+model=mlp +actions=capture``;
- a meta plan ``+model=llama_meta device=meta mode=plan +actions=capture`` (a 70B-class Llama, no weights).

Floors, each a fresh interpreter: ``import torch``; ``import torch, omegaconf, hydra.main`` (what every job
imports before any of surgery: a strict lower bound); the Hydra floor: ``import torch`` + Hydra composing
the same config once with the same overrides (``scripts/bench/startup_floor.py``: what any Hydra CLI
over this config pays); and for the meta plan also the Llama class (``transformers``' modeling_llama).
Every command runs several times, interleaved, medians of wall and CPU time of the child; the target is
judged on CPU time, which a busy neighbour does not inflate the way it inflates wall time. Children run
with byte code cached (``PYTHONDONTWRITEBYTECODE`` removed, one warm-up run each, as an installed
package has) and one intra-op thread (``OMP_NUM_THREADS=1``: on a shared 2-core machine torch's second
thread spins while the other core is busy, which times the neighbours, not the job). ``python -X
importtime`` on the main job then says which packages' imports take the time.

    python -m scripts.bench.startup [--quick] [--runs N] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

from scripts.bench.common import ROOT, cli_env, import_times, machine, run_child, write_json

TARGET_S = 0.3  # the main job over `import torch`, wall (issue 32)
JOBS: dict[str, list[str]] = {
    "main job (cnn, linearize)": ["+model=cnn", "+actions=linearize"],
    "MLP run (mlp, capture)": ["+model=mlp", "+actions=capture"],
    "meta plan (llama_meta, 70B-class)": ["+model=llama_meta", "device=meta", "mode=plan", "+actions=capture"],
}
MAIN = "main job (cnn, linearize)"
META = "meta plan (llama_meta, 70B-class)"
LLAMA = "import torch, hydra, transformers.models.llama.modeling_llama"
HYDRA = "import torch, omegaconf, hydra.main"  # what every job imports before surgery: a strict lower bound


def child_env() -> dict[str, str]:
    """This checkout on the path, byte code written and read, one intra-op thread."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # children inherit os.environ; cli_env adds to it
    return {**cli_env(), "OMP_NUM_THREADS": "1"}


def what_it_printed(stdout: str) -> str:
    """The job's headline: its before → after line, else (a plan) the first row of its plan table."""
    lines = stdout.strip().splitlines()
    headline = [line for line in lines if "→" in line]
    if headline:
        return headline[-1].split(";")[0]
    rows = lines[lines.index(next(x for x in lines if x.startswith("---"))) + 1 :] if any(
        x.startswith("---") for x in lines) else lines  # fmt: skip
    return " ".join(rows[0].split()[:5]) + " …" if rows else ""


def commands(directory: str) -> dict[str, list[str]]:
    """Every timed command: the jobs, then the floors."""
    py = sys.executable
    out: dict[str, list[str]] = {}
    for i, (name, args) in enumerate(JOBS.items()):
        out[name] = [py, "-m", "surgery", *args, f"hydra.run.dir={directory}/{i}"]
    out["import torch"] = [py, "-c", "import torch"]
    out[f"floor: {HYDRA}"] = [py, "-c", HYDRA]
    for name, args in JOBS.items():
        out[f"floor: {name}"] = [py, "-m", "scripts.bench.startup_floor", *args]
    out[f"floor: {LLAMA}"] = [py, "-c", LLAMA]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two runs each")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    runs = 2 if args.quick else args.runs
    env = child_env()
    with tempfile.TemporaryDirectory() as directory:
        timed = commands(directory)
        walls: dict[str, list[float]] = {name: [] for name in timed}
        cpus: dict[str, list[float]] = {name: [] for name in timed}
        printed: dict[str, str] = {}
        for command in timed.values():  # warm: byte code written, files in the page cache
            run_child(command, cwd=ROOT, env=env)
        for i in range(runs):
            order = list(timed.items())
            for name, command in order if i % 2 == 0 else reversed(order):
                run = run_child(command, cwd=ROOT, env=env)
                walls[name].append(run.wall_s)
                cpus[name].append(run.cpu_s)
                if name in JOBS:
                    printed[name] = what_it_printed(run.stdout)
        imports = import_times(timed[MAIN], 12)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    rows = []
    for name in JOBS:
        floor = f"floor: {LLAMA}" if name == META else f"floor: {name}"
        row: dict[str, Any] = {"job": name, "command": "python -m surgery " + " ".join(JOBS[name]),
                               "floor": floor.removeprefix("floor: "), "printed": printed.get(name, "")}  # fmt: skip
        for clock, times in (("wall", wall), ("cpu", cpu)):
            row[f"{clock}_s"] = times[name]
            row[f"over_torch_{clock}_s"] = times[name] - times["import torch"]
            row[f"over_hydra_floor_{clock}_s"] = times[name] - times[f"floor: {name}"]
            row[f"over_floor_{clock}_s"] = times[name] - times[floor]
        rows.append(row)
    for row in rows:
        print(
            f"{row['job']:36} {row['cpu_s']:.2f} s CPU ({row['wall_s']:.2f} s wall); over import torch"
            f" {row['over_torch_cpu_s']:+.2f} s CPU ({row['over_torch_wall_s']:+.2f} s wall); over its floor"
            f" {row['over_floor_cpu_s']:+.2f} s CPU ({row['over_floor_wall_s']:+.2f} s wall)"
        )
    for name in timed:
        print(f"  {name:60} {wall[name]:.2f} s wall  {cpu[name]:.2f} s CPU")
    for row in imports:
        print(f"  import {row['package']:24} {row['self_s']:.3f} s")
    main_row = rows[0]
    write_json(
        args.json,
        {
            "machine": machine(),
            "runs": runs,
            "rows": rows,
            "wall_s": wall,
            "cpu_s": cpu,
            "all_wall_s": walls,
            "all_cpu_s": cpus,
            "target_s": TARGET_S,
            "extra_cpu_s": main_row["over_torch_cpu_s"],
            "extra_wall_s": main_row["over_torch_wall_s"],
            "hydra_floor_extra_cpu_s": cpu[f"floor: {MAIN}"] - cpu["import torch"],
            "hydra_floor_extra_wall_s": wall[f"floor: {MAIN}"] - wall["import torch"],
            "hydra_imports_extra_cpu_s": cpu[f"floor: {HYDRA}"] - cpu["import torch"],
            "hydra_imports_extra_wall_s": wall[f"floor: {HYDRA}"] - wall["import torch"],
            "met": main_row["over_torch_cpu_s"] <= TARGET_S,
            "imports": imports,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
