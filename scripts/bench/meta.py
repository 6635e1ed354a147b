"""A 70B-class Llama on the meta device, planned from the CLI: cold command, imports, build + plan, plan alone.

``python -m surgery +model=llama_meta device=meta mode=plan`` with five recipes (below), measured four ways:

- cold: the whole command in a fresh interpreter (wall and CPU of the child);
- imports: a fresh interpreter that only imports what the command imports (surgery's CLI and job,
  transformers' Llama), the part of the cold command no recipe changes;
- in-process: ``surgery.app.cli.main()`` called in this process once everything is imported, timing
  the whole call and, inside it, the job's ``build_s`` (seed, model, inputs), the ``llama_meta`` call
  alone and ``plan_s`` (read from the job the CLI prepares; no product code changes);
- plan alone: ``surgery.plan`` on the built model with the exact arguments the CLI passed.

The target (issue 18): build + plan under 1 s from the CLI, judged on the in-process call (CPU time,
median), and ``surgery.plan`` alone at most 50 ms per recipe.

    python -m scripts.bench.meta [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from scripts.bench.common import ROOT, cli_env, import_times, machine, run_child, write_json

BUILD_PLAN_TARGET_S = 1.0  # the whole in-process CLI call, per recipe
PLAN_TARGET_S = 0.05  # surgery.plan alone, per recipe
BASE = ["+model=llama_meta", "device=meta", "mode=plan"]
RECIPES: dict[str, tuple[str, list[str]]] = {
    "residual": (
        "capture the residual stream after every decoder layer",
        ["+actions.residual={kind: capture, type: LlamaDecoderLayer}"],
    ),
    "ablate_mlp": (
        "zero the MLP output of layers 40–49",
        ['+actions.ablate={kind: modify_output, select: "model.layers.4[0-9].mlp", op: zero}'],
    ),
    "scale_attention": (
        "halve every attention output (item 0 of its tuple)",
        ["+actions.scale={kind: modify_output, type: LlamaAttention, item: 0, op: mul, value: 0.5}"],
    ),
    "qk": (
        "capture every q and k projection",
        ['+actions.qk={kind: capture, select: "model.layers.*.self_attn.[qk]_proj"}'],
    ),
    "clip_grads": (
        "clip every Linear weight's gradient to norm 1 (conf/actions/clip_grads.yaml)",
        ["+actions=clip_grads"],
    ),
}
ALL = "all five"
IMPORTS = "import surgery.app.cli, surgery.app.job, transformers.models.llama.modeling_llama"


def overrides(name: str) -> list[str]:
    """The command line's overrides for one recipe; ``all five`` has every recipe as one (clip_grads inline)."""
    if name != ALL:
        return [*BASE, *RECIPES[name][1]]
    inline = "+actions.clip={kind: modify_grad, type: Linear, param: weight, op: clip_norm, max_norm: 1.0}"
    return [*BASE, *(o for n, (_, os_) in RECIPES.items() for o in os_ if n != "clip_grads"), inline]


def cold_runs(names: list[str], runs: int, directory: str) -> dict[str, Any]:
    """Each recipe's whole command and the imports alone, fresh interpreters, interleaved; wall and CPU."""
    walls: dict[str, list[float]] = {n: [] for n in ["imports", *names]}
    cpus: dict[str, list[float]] = {n: [] for n in walls}
    peak: dict[str, float] = {}
    commands = {"imports": [sys.executable, "-c", IMPORTS]}
    for n in names:
        where = f"hydra.run.dir={directory}/cold-{n.replace(' ', '_')}"
        commands[n] = [sys.executable, "-m", "surgery", *overrides(n), where]
    run_child(commands["imports"], cwd=ROOT, env=cli_env())  # warm the file cache
    for i in range(runs):
        for name, command in commands.items() if i % 2 == 0 else reversed(list(commands.items())):
            run = run_child(command, cwd=ROOT, env=cli_env())
            walls[name].append(run.wall_s)
            cpus[name].append(run.cpu_s)
            peak[name] = max(peak.get(name, 0.0), run.peak_rss_mib)
    top = import_times(commands[names[0]], 8)
    return {
        "runs": runs,
        "wall_s": {n: statistics.median(v) for n, v in walls.items()},
        "cpu_s": {n: statistics.median(v) for n, v in cpus.items()},
        "peak_rss_mib": peak,
        "imports_by_package": top,
    }


class Spy:
    """Wraps the CLI's own functions (job.prepare, hf.llama_meta, prepare.compile_plan) to read times and arguments."""

    def __init__(self) -> None:
        import surgery.app.job as job
        import surgery.app.prepare as prepare
        import surgery.models.hf as hf

        self.seen: dict[str, Any] = {}
        self._undo: list[Callable[[], None]] = []
        self._wrap(job, "prepare", self._after_prepare)
        self._wrap(hf, "llama_meta", None)
        self._wrap(prepare, "compile_plan", None)

    def _wrap(self, module: Any, name: str, after: Callable[[Any], None] | None) -> None:
        original = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            result = original(*args, **kwargs)
            self.seen[name] = {"cpu_s": time.process_time() - start, "args": args, "kwargs": kwargs, "result": result}
            if after is not None:
                after(result)
            return result

        setattr(module, name, wrapper)
        self._undo.append(lambda: setattr(module, name, original))

    def _after_prepare(self, job: Any) -> None:
        self.seen["timings"] = dict(job.timings)

    def close(self) -> None:
        for undo in self._undo:
            undo()


def cli_call(args: list[str]) -> tuple[float, float, str]:
    """``python -m surgery ARGS`` as ``surgery.app.cli.main()`` in this process: wall and CPU seconds, its output."""
    from surgery.app import cli

    out = io.StringIO()
    sys.argv = ["surgery", *args]
    wall, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli.main()
        except SystemExit as e:
            if e.code:
                raise RuntimeError(f"surgery {' '.join(args)} exited {e.code}:\n{out.getvalue()[-2000:]}") from None
    return time.perf_counter() - wall, time.process_time() - cpu, out.getvalue()


def in_process(names: list[str], rounds: int, directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Warm CLI calls, every recipe per round (order alternating); and then ``surgery.plan`` alone per recipe."""
    import surgery

    spy, clock = Spy(), GcClock()
    try:
        cli_call([*overrides(ALL), f"hydra.run.dir={directory}/warm"])  # lazy imports, Hydra's first composition
        times: dict[str, dict[str, list[float]]] = {n: {} for n in names}
        matched: dict[str, list[int]] = {}
        plan_args: dict[str, Any] = {}
        for r in range(rounds):
            for name in names if r % 2 == 0 else list(reversed(names)):
                spy.seen.clear()
                clock.take()
                wall, cpu, _ = cli_call([*overrides(name), f"hydra.run.dir={directory}/{name.replace(' ', '_')}"])
                seen = spy.seen
                row = {"cli_wall_s": wall, "cli_cpu_s": cpu, "llama_meta_cpu_s": seen["llama_meta"]["cpu_s"],
                       "plan_cpu_s": seen["compile_plan"]["cpu_s"], "job_build_wall_s": seen["timings"]["build_s"],
                       "job_plan_wall_s": seen["timings"]["plan_s"], "gc_cpu_s": sum(clock.take())}  # fmt: skip
                for key, value in row.items():
                    times[name].setdefault(key, []).append(value)
                call = seen["compile_plan"]
                matched[name] = [len(step.targets) for step in call["result"].steps]
                plan_args[name] = (call["args"], call["kwargs"])
    finally:
        spy.close()
        clock.close()
    cli = {n: {k: statistics.median(v) for k, v in t.items()} | {"max_cli_cpu_s": max(t["cli_cpu_s"]),
           "matched": matched[n]} for n, t in times.items()}  # fmt: skip
    alone: dict[str, Any] = {}
    for name, (args, kwargs) in plan_args.items():
        kwargs = {k: v for k, v in kwargs.items() if k != "batches"}  # surgery.plan's arguments: the CLI's, one batch
        kwargs["reuse"] = False  # compiled every time, not found in the plan cache
        spent = []
        for _ in range(rounds * 3):
            start = time.process_time()
            surgery.plan(*args, **kwargs)
            spent.append(time.process_time() - start)
        alone[name] = {"plan_s": statistics.median(spent), "max_s": max(spent), "calls": len(spent)}
    return cli, alone


class GcClock:
    """CPU seconds spent in garbage collections (``gc.callbacks``) while installed, by generation."""

    def __init__(self) -> None:
        self.spent = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.spent[info["generation"]] += time.process_time() - self._start

    def take(self) -> list[float]:
        spent, self.spent = self.spent, [0.0, 0.0, 0.0]
        return spent

    def close(self) -> None:
        gc.callbacks.remove(self._tick)


PROFILED = {  # (file, function) in the profile of one in-process CLI call: what a reader would recognise
    "Hydra: compose the config (Hydra does it twice per run)": ("config_loader_impl.py", "load_configuration"),
    "build_model (instantiate llama_meta on meta)": ("build.py", "build_model"),
    "compile_plan": ("compiler.py", "compile_plan"),
    "print the plan table": ("output.py", "say"),
    "write report.json": ("io.py", "write_json"),
}


def profile_call(directory: str) -> dict[str, float]:
    """Shares of one in-process CLI call (all five recipes) under ``cProfile``, by the functions in PROFILED."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    cli_call([*overrides(ALL), f"hydra.run.dir={directory}/profiled"])
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = max(cum for (_, _, fn), (_, _, _, cum, _) in stats.items() if fn == "main")
    found = {}
    for label, (file, function) in PROFILED.items():
        cum = sum(v[3] for (f, _, fn), v in stats.items() if f.endswith(file) and fn == function)
        found[label] = cum / total
    return found


def gc_cost() -> dict[str, float]:
    """What one full garbage collection costs in this process (torch, transformers, Hydra loaded)."""
    gc.collect()
    start = time.process_time()
    gc.collect()
    return {"objects": len(gc.get_objects()), "full_collection_s": time.process_time() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one cold run of one recipe, two in-process rounds")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    names = [*RECIPES, ALL]
    with tempfile.TemporaryDirectory() as directory:
        cold = cold_runs(names[:1] if args.quick else names, 1 if args.quick else 2, directory)
        print(f"cold: {cold['wall_s']}", flush=True)
        # the imports a cold command pays, here outside the in-process timings
        import transformers.models.llama.modeling_llama  # noqa: F401

        import surgery.app.cli  # noqa: F401

        cli, alone = in_process(names, 2 if args.quick else 7, directory)
        shares = profile_call(directory)
    for name in names:
        c, a = cli[name], alone[name]
        print(f"{name:16} CLI call {c['cli_cpu_s'] * 1e3:6.0f} ms CPU ({c['cli_wall_s'] * 1e3:.0f} ms wall):"
              f" llama_meta {c['llama_meta_cpu_s'] * 1e3:.0f} ms, plan {c['plan_cpu_s'] * 1e3:.1f} ms;"
              f" surgery.plan alone {a['plan_s'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    result = {
        "machine": machine(),
        "base": "python -m surgery " + " ".join(BASE),
        "recipes": {
            n: {
                "what": RECIPES[n][0] if n in RECIPES else "the five above in one recipe",
                "overrides": overrides(n)[len(BASE) :],
            }
            for n in names
        },  # fmt: skip
        "imports": IMPORTS,
        "cold": cold,
        "cli": cli,
        "plan_alone": alone,
        "gc": gc_cost(),
        "profile_shares": shares,
        "build_plan_target_s": BUILD_PLAN_TARGET_S,
        "plan_target_s": PLAN_TARGET_S,
        "build_plan_met": all(c["cli_cpu_s"] < BUILD_PLAN_TARGET_S for c in cli.values()),
        "plan_met": all(a["plan_s"] <= PLAN_TARGET_S for a in alone.values()),
    }
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
