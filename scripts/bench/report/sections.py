"""BENCHMARKS.md sections 3 to 6: plan compile time, capture memory, torch.compile, CLI start-up."""

from __future__ import annotations

from typing import Any

from scripts.bench.report.markdown import load_note, ms, short, table, yes


def plan_section(data: dict[str, Any] | None) -> tuple[list[str], list[list[str]], list[str]]:
    if data is None:
        return ["## 3. Plan compile time", "", "Not run.", ""], [], []
    rows = [
        [
            f"{r['modules']:,}",
            f"{r['build_s']:.1f} s",
            ms(r["plan_s"]),
            ms(r["baseline_s"]),
            f"{r['ratio']:.2f}",
            f"{r['plan_us_per_module']:.1f} µs",
            f"{r['tree_mib']:,.0f} MiB" if "tree_mib" in r else "–",
            f"{r['peak_rss_mib']:,.0f} MiB" if "peak_rss_mib" in r else "–",
        ]
        for r in data["rows"]
    ]
    largest = data["rows"][-1]
    growth = ", ".join(f"{g:.1f}×" for g in data["growth_10x"])
    base_growth = ", ".join(f"{b['baseline_s'] / a['baseline_s']:.1f}×" for a, b in zip(data["rows"], data["rows"][1:]))
    repeats = sorted({r.get("repeats", 7 if r["modules"] < 100_000 else 3) for r in data["rows"]}, reverse=True)
    limit = data.get("linear_growth", 12.0)
    md = [
        "## 3. Plan compile time on large module trees",
        "",
        "`scripts/bench/plan.py`. Trees of `layers.N` blocks (12 modules each: LayerNorms, q/k/v/o"
        " Linears, an MLP) built on the `meta` device (without `reset_parameters`, which on meta draws nothing;"
        " the `build` column). Five actions compiled with `surgery.plan(..., reuse=False)` (compiled every time: the"
        " plan cache would find the plan again, section 17):"
        " `capture select: layers.*.attn.[qk]`, `modify_output type: LayerNorm`, `capture select:"
        " **.mlp.fc2`, `log type: GELU`, `modify_output select: layers.* exclude: layers.1*`. Baseline:"
        " one `named_modules()` walk and one compiled regex per pattern per module, written by hand (the"
        f" matched counts are checked equal). CPU time, median of {' / '.join(map(str, repeats))} runs (fewer on"
        f" the large trees). `tree`: resident memory the tree added; `peak RSS`: the process's peak once that tree"
        f" was planned (smaller trees are freed first). Garbage collection: {data['gc']}." + load_note(data),
        "",
        *table(
            ["modules", "build", "surgery.plan", "regex baseline", "plan/baseline", "per module", "tree", "peak RSS"],
            rows,
        ),
        f"Growth per 10× modules: surgery.plan {growth}; the regex baseline {base_growth} (linear is 10×; fixed"
        f" costs make small trees grow less; the target counts up to {limit:g}× as linear).",
        "",
    ]
    at = next((r for r in data["rows"] if r["modules"] >= data.get("target_modules", 100_000)), None)
    met = at is not None and at["plan_s"] <= data["target_s"]
    targets = [
        [
            "`surgery.plan`, 5 actions, 100k modules",
            f"≤ {data['target_s']} s",
            f"{at['plan_s']:.2f} s (baseline {at['baseline_s']:.2f} s)" if at else "not run",
            yes(met),
        ]
    ]
    misses = []
    if at is not None and not met:
        misses.append(
            f"plan at {at['modules']:,} modules: {at['plan_s']:.2f} s against a target of {data['target_s']} s;"
            f" the hand-written regex baseline alone takes {at['baseline_s']:.2f} s on this machine"
        )
    if at is not None and "round_ratio" in at:
        wanted = data["target_ratio"]
        low, high = min(at["round_ratios"]), max(at["round_ratios"])
        targets.append([f"`surgery.plan` / the hand-written walk plus regexes, 5 actions, {at['modules']:,} modules",
                        f"≤ {wanted}", f"{at['round_ratio']:.3f} (rounds {low:.3f}–{high:.3f})",
                        yes(data["ratio_met"])])  # fmt: skip
        if not data["ratio_met"]:
            misses.append(f"plan at {at['modules']:,} modules: {at['round_ratio']:.3f}× the hand-written walk")
    if "linear" in data:
        to = data["linear_to"]
        reached = largest["modules"] >= to
        measured = f"growth {growth} up to {largest['modules']:,} modules" + (
            "" if reached else f" (not run to {to:,})"
        )
        targets.append([f"planning stays linear to {to:,} modules", f"≤ {limit:g}× per 10×", measured,
                        yes(data["linear"])])  # fmt: skip
        if reached and not data["linear"]:
            misses.append(
                f"plan at {largest['modules']:,} modules grew {data['growth_10x'][-1]:.1f}× over the last 10× (the"
                f" regex baseline {largest['baseline_s'] / data['rows'][-2]['baseline_s']:.1f}×), over {limit:g}×"
            )
    return md, targets, misses


def _per_reference(row: dict[str, Any]) -> str:
    """``added`` over the model's tensors plus one batch of captures (a capturing row only)."""
    reference = row.get("model_mib", 0) + row.get("one_batch_mib", 0)
    return f"{row['added_mib'] / reference:.1f}" if row.get("one_batch_mib") else "–"


def memory_section(data: dict[str, Any] | None) -> list[str]:
    if data is None:
        return ["## 4. Capture memory", "", "Not run.", ""]
    api = [
        [
            r["mode"],
            f"{r['peak_rss_mib']:.0f} MiB",
            f"{r['added_mib']:.0f} MiB",
            f"{r['held_in_captures_mib']:.0f} MiB",
            f"{r['on_disk_mib']:.0f} MiB",
            _per_reference(r),
            f"{r['seconds']:.2f} s",
        ]
        for r in data["api"]
    ]
    cli = [
        [
            r["mode"],
            f"{r['peak_rss_mib']:.0f} MiB",
            f"{r['on_disk_mib']:.0f} MiB ({r['files']} file{'s' if r['files'] != 1 else ''})",
        ]
        for r in data["cli"]
    ]
    batches = data["api"][0]["batches"]
    ref = next(
        (r for r in data["api"] if "one_batch_mib" in r and r["one_batch_mib"]), {"model_mib": 0, "one_batch_mib": 0}
    )
    md = [
        f"## 4. Capture memory over {batches} batches: in memory vs `to: disk`",
        "",
        f"`scripts/bench/memory.py`. The CNN (`surgery.models.cnn.CNN`), batch {data['batch']}, {batches}"
        " forwards, each case in a fresh process. API: `capture` of every module (`select: '**'`,"
        " `exclude: '<root>'`); `disk` uses `to: disk` and `Surgery.flush(dir)` after each batch;"
        " `none` runs without surgery. `added` is peak RSS minus RSS before the first batch; `held` is"
        " the tensor storage the records hold at the end; `added / (model + 1 batch)` compares `added`"
        f" with the model's own tensors ({ref['model_mib']:.2f} MiB) plus one batch of captures"
        f" ({ref['one_batch_mib']:.1f} MiB): streaming to disk stays between 1 and 2 whatever the number of"
        " batches (the batch's captured tensors, plus the one serialised copy made while its shard is"
        " written); memory mode grows with every batch.",
        "",
        *table(["API", "peak RSS", "added", "held", "on disk", "added / (model + 1 batch)", "forwards"], api),
    ]
    if cli:
        md += [
            "CLI, the whole job: `python -m surgery +model=cnn +actions=capture"
            f" +input.batches={batches} +input.shape=[{data['batch']},1,28,28] compare=false`, with and"
            " without `+actions.capture.to=disk` (memory mode writes `captures.safetensors` at the end):",
            "",
            *table(["CLI", "peak RSS", "written"], cli),
        ]
    return md


def compile_section(data: dict[str, Any] | None) -> tuple[list[str], list[list[str]], list[str]]:
    if data is None:
        return ["## 5. torch.compile", "", "Not run.", ""], [], []
    rows = []
    builtin_breaks = expr_breaks = 0
    for name, r in data["explain"].items():
        reasons = "; ".join(short(reason) for reason in r["reasons"][:2])
        rows.append([name, r["graphs"], r["graph_breaks"], "yes" if r["equal_to_eager"] else "**no**", reasons])
        if name.startswith("expr"):
            expr_breaks += r["graph_breaks"]
        else:
            builtin_breaks += r["graph_breaks"]
    rec = data["capture_recompiles"]
    after = data["after_compile"]
    md = [
        "## 5. torch.compile",
        "",
        "`scripts/bench/compile.py`. A 3-layer MLP (width 16) with one action; `torch._dynamo.explain`"
        " counts graphs and graph breaks; the `aot_eager` compiled output is compared with eager"
        " (a fresh `apply` per run, so seeded noise starts from its seed each time).",
        "",
        *table(["action", "graphs", "graph breaks", "equal to eager", "break reason"], rows),
        f"`capture` over {rec['calls']} compiled calls: {rec['graphs']} graphs (Dynamo's cache limit is"
        f" {rec['cache_size_limit']}): the recording hook appends to a list, which Dynamo guards on, so it"
        " recompiles on every call until the limit and then runs the frame eagerly. Every call recorded:"
        f" {rec['every_call_recorded']}.",
        "",
    ]
    inductor = data.get("inductor")
    targets, misses = [], []
    if inductor:
        ratio = inductor["compiled_surgery/compiled_hand"]
        q1, q3 = inductor.get("spread", (ratio, ratio))
        t = inductor["times"]
        md += [
            "Inductor (CPU, 1 thread): MLP width 256, depth 12, batch 8, with `add 1.0` on every Linear and"
            " `replace_forward expr: x * sigmoid(x)` on every ReLU; each model compiled with its own copy of"
            " the forward code (Dynamo keeps graphs per code object), timed interleaved:",
            "",
            *table(
                ["eager hand", "compiled hand", "compiled surgery", "compiled surgery / compiled hand", "equal"],
                [
                    [
                        ms(t["eager hand"]),
                        ms(t["compiled hand"]),
                        ms(t["compiled surgery"]),
                        f"**{ratio:.3f}** ({q1:.3f}–{q3:.3f})",
                        inductor["equal"],
                    ]
                ],
            ),
        ]
        targets.append(
            ["Compiled surgered / compiled hand-written (inductor)", "≈ 1", f"{ratio:.3f}", yes(ratio <= 1.05)]
        )
        if ratio > 1.05:
            misses.append(
                f"compiled surgery is {ratio:.2f}× the compiled hand-written hooks: the expression's graph break"
                " (below) makes Dynamo give up on the whole forward frame (a break inside a loop)"
            )
    md += [
        "A surgery applied after the model has run compiled (torch does not guard on hooks added to a module that"
        " had none when it compiled, so compiled calls ignore them). `surgery.apply` recognises the compiled wrapper"
        " and, per instance, a model Dynamo has traced (docs/behaviour.md). Not detected: a never-compiled sibling of"
        " a compiled instance, which can reuse its class's cached graph.",
        "",
        *table(
            ["applied to", "eager model changed", "compiled output changed", "surgery warned"],
            [
                [k, v["eager_model_changed"], v["compiled_output_changed"], v["surgery_warned"]]
                for k, v in after.items()
            ],
        ),
    ]
    targets.append(["Zero graph breaks, built-in ops (aot_eager)", "0", str(builtin_breaks), yes(builtin_breaks == 0)])
    targets.append(["Zero graph breaks, expressions (aot_eager)", "0", str(expr_breaks), yes(expr_breaks == 0)])
    silent = [k for k, v in after.items() if not v["compiled_output_changed"] and not v["surgery_warned"]]
    ignored = bool(silent)
    seen = "; ".join(
        f"{k}: {'ignored, no warning' if k in silent else 'warned' if v['surgery_warned'] else 'honoured'}"
        for k, v in after.items()
    )
    targets.append(["A surgery applied after compiling is reported", "warn or refuse", seen, yes(not ignored)])
    for what, count, expressions in (("built-in ops", builtin_breaks, False), ("expressions", expr_breaks, True)):
        if count:
            reasons = "; ".join(
                f"{n}: {'; '.join(short(reason) for reason in r['reasons'][:2]) or 'see the table'}"
                for n, r in data["explain"].items()
                if r["graph_breaks"] and n.startswith("expr") == expressions
            )
            misses.append(f"{what}: {count} graph break(s): {reasons}")
    if ignored:
        misses.append(
            f"a surgery applied after `torch.compile` to the {' and '.join(silent)} is silently ignored by the"
            " compiled model"
        )
    return md, targets, misses


def startup_section(data: dict[str, Any] | None) -> tuple[list[str], list[list[str]], list[str]]:
    """Section 6 and its target row: three CLI jobs, whole processes, each against its import floor."""
    if data is None:
        return ["## 6. CLI start-up", "", "Not run.", ""], [], []
    if "rows" not in data:  # a result written before the jobs and floors were added
        return ["## 6. CLI start-up", "", "Rerun `python -m scripts.bench --only startup --merge`.", ""], [], []
    wall, cpu, rows = data["wall_s"], data["cpu_s"], data["rows"]
    md = [
        "## 6. CLI start-up",
        "",
        "`scripts/bench/startup.py`. Three jobs, each a whole `python -m surgery` process, against the imports no"
        ' job can skip: `python -c "import torch"`; `import torch, omegaconf, hydra.main`; the Hydra floor,'
        " `import torch` and Hydra composing the same"
        " config once with the same overrides (`scripts/bench/startup_floor.py`: what any Hydra command line over"
        " this config pays, before surgery's checks and job); for the meta plan also `import transformers`' Llama."
        f" {data['runs']} runs of every command, interleaved, medians of the child's CPU time (wall in brackets:"
        " a busy neighbour inflates it). Byte code cached, one intra-op thread"
        f" (`OMP_NUM_THREADS=1`). Load average (1 min) when it started: {data['machine']['load_1min']}. On a"
        " shared machine these medians move by a few hundred milliseconds from run to run (a job can land under"
        " its floor): read the floors and the jobs together, and rerun on a quiet machine for final numbers.",
        "",
        *table(
            ["job", "CPU (wall)", "over `import torch`", "its floor", "over its floor", "printed"],
            [
                [
                    f"`{r['command']}`",
                    f"{ms(r['cpu_s'])} ({ms(r['wall_s'])})",
                    f"{_signed(r['over_torch_cpu_s'])} ({_signed(r['over_torch_wall_s'])})",
                    f"`{r['floor']}`" if r["floor"] != r["job"] else "Hydra floor",
                    f"{_signed(r['over_floor_cpu_s'])} ({_signed(r['over_floor_wall_s'])})",
                    r["printed"].split(";")[0],
                ]
                for r in rows
            ],
        ),
        "The commands alone:",
        "",
        *table(
            ["command", "CPU", "wall"],
            [
                [
                    f"`{name.removeprefix('floor: ')}`" + (" (floor)" if name.startswith("floor: ") else ""),
                    ms(cpu[name]),
                    ms(wall[name]),
                ]
                for name in cpu
            ],  # fmt: skip
        ),
        "Import time by package in the main job (`python -X importtime`, each package's own modules):",
        "",
        *table(["package", "import time"], [[r["package"], ms(r["self_s"])] for r in data["imports"][:8]]),
    ]
    floor, imports = data["hydra_floor_extra_cpu_s"], data.get("hydra_imports_extra_cpu_s", float("nan"))
    target = [
        "CLI start-up minus `import torch`",
        f"≤ {data['target_s']} s",
        f"main job {ms(data['extra_cpu_s'])} CPU (wall {ms(data['extra_wall_s'])}); importing Hydra alone"
        f" {ms(imports)}, and composing once {ms(floor)}",
        yes(data["met"]),
    ]
    misses = []
    if not data["met"]:
        misses.append(
            f"CLI start-up: the main job is {ms(data['extra_cpu_s'])} CPU over `import torch`; importing Hydra and"
            f" OmegaConf alone is {ms(imports)} of that and Hydra composing the same config once {ms(floor)}: the"
            f" {data['target_s']} s target is under the floor of any Hydra command line"
        )
    return md, [target], misses


def _signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "−") + ms(abs(seconds))
