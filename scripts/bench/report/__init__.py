"""Run every benchmark module in its own process and write BENCHMARKS.md from their JSON results.

``python -m scripts.bench`` calls this in the bench venv (``.venv-bench``, with the peer tools);
``--quick`` is a smoke run on tiny sizes that writes to ``.venv-bench/results-quick`` and leaves
BENCHMARKS.md alone unless ``--out`` says otherwise; ``--render`` rewrites BENCHMARKS.md from
the last full results without running anything (refused, as is a run of ``--only`` some, while a
benchmark has no results here: its measured section would read "Not run."); ``--only NAME --merge``
runs one benchmark and rewrites only its part of BENCHMARKS.md (scripts/bench/report/merge.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench.circuits import circuits_section
from scripts.bench.common import ROOT, machine, version_of
from scripts.bench.plan_cache import plan_cache_section
from scripts.bench.report.attribution import attribution_section
from scripts.bench.report.gpu import gpu_section, last_gpu_run
from scripts.bench.report.harvest import harvest_section
from scripts.bench.report.hooks import overhead_section, peers_section, peers_target
from scripts.bench.report.markdown import load, table
from scripts.bench.report.merge import MERGEABLE, merge
from scripts.bench.report.scale import ddp_section, meta_section
from scripts.bench.report.sections import compile_section, memory_section, plan_section, startup_section
from scripts.bench.report.splices import splice_section
from scripts.bench.report.studies import data_section, lm_section, study_section, training_section
from scripts.bench.sites import sites_section

BENCHES = [
    "overhead", "plan", "memory", "compile", "startup", "data", "lm", "training", "meta", "ddp", "study", "attribution",
    "splice", "harvest", "sites", "plan_cache", "circuits",
]  # fmt: skip
BUDGET_S = 600


def run_benches(names: list[str], quick: bool, results: Path) -> dict[str, dict[str, Any]]:
    """Run each ``scripts.bench.NAME`` (output streamed), writing ``results/NAME.json``; wall seconds and status."""
    results.mkdir(parents=True, exist_ok=True)
    status: dict[str, dict[str, Any]] = {}
    peers = any(version_of(p) for p in ("nnsight", "pyvene", "transformer-lens"))
    for name in names:
        args = [sys.executable, "-m", f"scripts.bench.{name}", "--json", str(results / f"{name}.json")]
        args += ["--quick"] if quick else []
        args += ["--peers"] if name == "overhead" and peers else []
        print(f"== scripts.bench.{name}", flush=True)
        start = time.perf_counter()
        code = subprocess.run(args, cwd=ROOT).returncode
        status[name] = {"seconds": time.perf_counter() - start, "exit": code}
        print(f"== scripts.bench.{name}: {status[name]['seconds']:.0f} s, exit {code}", flush=True)
    return status


def render(results: Path, status: dict[str, Any], quick: bool) -> str:
    info = machine()
    overhead = load(results, "overhead")
    info = (overhead or {}).get("machine", info)
    total = sum(s["seconds"] for s in status.values())
    failed = [n for n, s in status.items() if s["exit"]]
    o_md, o_t, o_m = overhead_section(overhead)
    p_md, p_t, p_m = plan_section(load(results, "plan"))
    c_md, c_t, c_m = compile_section(load(results, "compile"))
    s_md, s_t, s_m = startup_section(load(results, "startup"))
    d_md, d_t, d_m = data_section(load(results, "data"))
    l_md, l_t, l_m = lm_section(load(results, "lm"))
    t_md, t_t, t_m = training_section(load(results, "training"))
    x_md, x_t, x_m = meta_section(load(results, "meta"))
    g_md, g_t, g_m = ddp_section(load(results, "ddp"))
    y_md, y_t, y_m = study_section(load(results, "study"))
    a_md, a_t, a_m = attribution_section(load(results, "attribution"))
    u_md, u_t, u_m = gpu_section(load(results, "gpu") or last_gpu_run())  # run on a GPU machine, not here
    v_md, v_t, v_m = splice_section(load(results, "splice"))
    h_md, h_t, h_m = harvest_section(load(results, "harvest"))
    z_md, z_t, z_m = sites_section(load(results, "sites"))
    r_md, r_t, r_m = plan_cache_section(load(results, "plan_cache"))
    e_md, e_t, e_m = circuits_section(load(results, "circuits"))
    peer_t, peer_m = peers_target(overhead)
    targets = o_t + peer_t + p_t + r_t + c_t + s_t + d_t + l_t + t_t + x_t + g_t + y_t + u_t + a_t + v_t + h_t + z_t
    targets += e_t
    lines = [
        "# Benchmarks",
        "",
        "Written by `python -m scripts.bench` (all of it; `--quick` is a smoke run on tiny sizes);"
        " do not edit by hand. Each `python -m scripts.bench.NAME` also runs alone (`--help`). The bench venv"
        " `.venv-bench` holds the package plus the peers (nnsight, pyvene, TransformerLens), so the dev"
        " venv stays as it is.",
        "",
        "## Machine",
        "",
        *table(
            ["", ""],
            [
                ["CPUs (`nproc`)", info["nproc"]],
                ["CPU", info["cpu"]],
                ["python", info["python"]],
                ["torch", info["torch"]],
                ["load average (1 min) at the start", info["load_1min"]],
                ["wall time of the whole run", f"{total:.0f} s" + (" (quick)" if quick else "")],
            ],
        ),
        "Measured on a **shared machine**: other jobs were running tests on the same cores during the run"
        " (see the load average), so absolute times are noisy. Ratios are robust to that: the variants of"
        " a case run interleaved in the same process and times are CPU time, which a neighbour does not"
        " inflate the way it inflates wall time (it still disturbs caches, hence the quartiles).",
        "",
        "## Targets",
        "",
        *table(["target", "wanted", "measured", ""], targets),
    ]
    misses = o_m + peer_m + p_m + r_m + c_m + s_m + d_m + l_m + t_m + x_m + g_m + y_m + u_m + a_m + v_m + h_m + z_m
    misses += e_m
    if failed:
        misses.append(f"scripts that failed: {', '.join(failed)}")
    if total > BUDGET_S:
        misses.append(f"the whole run took {total:.0f} s, over the {BUDGET_S} s budget")
    if misses:
        why = why_lines(results, misses)
        lines += ["### Over a target, and why", "", *[f"- {m}" for m in misses], ""]
        lines += ["Where the time goes (measured in the same run):", "", *why, ""] if why else []
    lines += (
        o_md
        + peers_section(overhead)
        + p_md
        + memory_section(load(results, "memory"))
        + c_md
        + s_md
        + d_md
        + l_md
        + t_md
        + ["## 10. Beyond one machine", ""]
        + x_md
        + g_md
        + y_md
        + u_md
        + a_md
        + v_md
        + h_md
        + z_md
        + r_md
        + e_md
    )
    return "\n".join(lines).rstrip() + "\n"


def why_lines(results: Path, misses: list[str]) -> list[str]:
    """Measured explanations for the kinds of miss in ``misses``."""
    lines = []
    overhead, plan, ddp = load(results, "overhead"), load(results, "plan"), load(results, "ddp")
    if overhead and any(m.startswith("hook overhead") for m in misses):
        small = [r for r in overhead["rows"] if r.get("headline")]
        hand = small[0]["times"]["hand"] * 1e3
        counts = sorted({r["hooks"] for r in small})
        lines.append(
            f"- Hook overhead: the `µs per hook` column of section 1 is the engine's own cost per hook call on the"
            f" {small[0]['model']} ({counts[0]}–{counts[-1]} hooks per call): the Python work around the op in"
            " the engine's hook (the try that names the action and module when the op fails, looking up the item,"
            f" building the record). A forward of that model takes about {hand:.2f} ms, so 1 µs per hook is about"
            f" {counts[0] / (hand * 1e3) * 100:.0f}% of it."
        )
    if plan and any(m.startswith("plan at") for m in misses):
        parts = plan.get("breakdown", {})
        modules = parts.pop("modules", None)
        if parts:
            measured = "; ".join(f"{name}: {seconds:.2f} s" for name, seconds in parts.items())
            lines.append(
                f"- `surgery.plan` at {modules:,} modules (CPU time, median of 3): {measured}. The hand-written"
                " baseline is the walk plus five regex passes; the plan warnings are computed when first read."
            )
    if ddp and ddp.get("by_action") and any(m.startswith("DDP:") for m in misses):
        worst = max(ddp["by_action"].items(), key=lambda kv: kv[1]["extra_ms"])
        lines.append(
            f"- DDP: of the three actions alone, `{worst[0]}` adds the most over its hand-written hook"
            f" ({worst[1]['extra_ms']:+.2f} ms per step over both ranks, ratio {worst[1]['ratio']:.3f}; section 10.2)."
            + (" `reduce: mean` keeps a running mean, but the engine's running statistics (`Running.add` in"
               " surgery/core/records.py) also compute the squared deviations, minimum and maximum on every call,"
               " which only `reduce: stats` reads." if worst[0] == "stats" else "")
        )  # fmt: skip
    peer_misses = [m for m in misses if m.startswith("peers:")]
    if peer_misses and all("GPT-2" in m for m in peer_misses):
        lines.append(
            "- Peers: where a peer's ratio is below surgery's, it is on GPT-2 small, where a forward takes"
            " ~150 ms and every tool's hooks add well under a millisecond, so the rows differ by round-to-round"
            " variation (see the quartiles)."
        )
    if any("silently ignored" in m for m in misses):
        lines.append(
            "- After `torch.compile`, hooks added to the inner model are not seen by the graphs already compiled"
            " (torch does not guard on hooks added later), and the check that should have warned did not fire."
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes; results in .venv-bench/results-quick")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(BENCHES)}")
    parser.add_argument("--render", action="store_true", help="only rewrite BENCHMARKS.md from the last results")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --only: rewrite only their sections, target rows"
        f" and misses in BENCHMARKS.md, keep the rest ({', '.join(MERGEABLE)}; no bench venv needed)",
    )
    parser.add_argument("--out", help="where to write the Markdown (default: BENCHMARKS.md, not for --quick)")
    args = parser.parse_args(argv)
    if args.merge and (not args.only or set(args.only.split(",")) - set(MERGEABLE)):
        parser.error(f"--merge needs --only with some of {', '.join(MERGEABLE)}")
    results = ROOT / ".venv-bench" / ("results-quick" if args.quick else "results")
    if args.render:
        status = json.loads((results / "status.json").read_text())
    else:
        names = args.only.split(",") if args.only else BENCHES
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".venv-bench" / "inductor-cache"))
        status = run_benches(names, args.quick, results)
        old = results / "status.json"
        if args.only and old.is_file():  # keep the other benches' earlier status
            status = {**json.loads(old.read_text()), **status}
        old.write_text(json.dumps(status, indent=2))
    out = Path(args.out) if args.out else (None if args.quick else ROOT / "BENCHMARKS.md")
    if args.merge:
        text = (out if out is not None and out.is_file() else ROOT / "BENCHMARKS.md").read_text()
        for name in args.only.split(","):
            text = merge(text, load(results, name), name)
    else:
        missing = [name for name in BENCHES if load(results, name) is None]
        if missing and not args.quick and not args.out:  # their measured sections would read "Not run."
            print(f"BENCHMARKS.md left as it is: no results here for {', '.join(missing)}. Run them too,"
                  " rewrite only what ran with --only NAME --merge, or write elsewhere with --out",
                  file=sys.stderr)  # fmt: skip
            return 2
        text = render(results, status, args.quick)
    if out is not None:
        out.write_text(text)
        print(f"wrote {out}")
    total = sum(s["seconds"] for s in status.values())
    print(f"total {total:.0f} s" + (f" (over the {BUDGET_S} s budget)" if total > BUDGET_S else ""))
    return 1 if any(s["exit"] for s in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
