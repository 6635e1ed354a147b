"""The study benchmark's command-line and size cases (scripts/bench/study.py runs them and reports them).

    python -m scripts.bench.study_scale [--quick]    (alone: prints what study.py adds to its JSON)

* CLI: ``python -m surgery +study=patch_layer_pos`` on study.py's GPT-2 and prompts (saved with a
  word-level tokenizer, token ``wN`` = id N) against one plain CLI run of the same model and prompts
  with one patch (``+actions=patch_resid``), both wall time of a fresh interpreter, start-up
  included, interleaved; and once, the same 3 × 13 grid as a Hydra multirun of 39 plain jobs.
* Size: ``surgery.study`` at 10, 100 and 1,000 cells, each size in a fresh child process: CPU time
  per cell and the peak RSS the study adds. The grid is ``pos`` (10 positions patched from the clean
  run at block 1) × ``coef`` (a steering coefficient added to block 2's MLP output at the last
  position), one cell a forward, so every cell does the same work.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench.common import ROOT, cli_env, quartiles, run_child, verdict
from scripts.bench.memory import status_mib
from scripts.bench.study import CORRECT, LAYERS, PATCH, POSITIONS, VOCAB, WRONG, setup, study

CLI_TARGET, SCALE_TARGET = 1.5, 1.2
RSS_TARGET_MIB = 2.0  # "flat": a 1,000-cell study's peak RSS within this of a 10-cell one's
SIZES = (10, 100, 1000)
SCALE_POSITIONS = 10
STEER = {"kind": "modify_output", "select": "transformer.h.2.mlp", "op": "add", "value": "{coef}", "index": "[:, -1]"}


def save_model(directory: Path) -> dict[str, list[str]]:
    """study.py's GPT-2 and a word-level tokenizer (``wN`` is token N) saved in ``directory``; its prompts as text."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    model, clean, corrupt = setup()
    model.save_pretrained(directory)
    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}  # no word contains a special token
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(directory)
    text = lambda ids: [" ".join(f"w{int(i)}" for i in row) for row in ids]  # noqa: E731
    return {"clean": text(clean), "corrupt": text(corrupt)}


def commands(model_dir: Path, prompts: dict[str, list[str]], out: Path) -> dict[str, list[str]]:
    """The CLI study, one plain run with one patch, and the study's grid as a multirun of plain runs."""
    surgery = [sys.executable, "-m", "surgery"]
    common = ["+model=hf", f"model.path={model_dir}", "+input=text",
              f"input.prompts=[{','.join(prompts['corrupt'])}]", "+source=text",
              f"source.prompts=[{','.join(prompts['clean'])}]"]  # fmt: skip
    metric = f"study.metrics=[{{logit_diff: {{correct: w{CORRECT}, wrong: w{WRONG}}}}}]"
    layers = ",".join(f"transformer.h.{i}" for i in range(LAYERS))
    positions = ",".join(f"'[:, {p}]'" for p in range(POSITIONS))
    return {
        "study": [*surgery, *common, "+study=patch_layer_pos", metric, f"study.grid.layer=0:{LAYERS}",
                  f"hydra.run.dir={out / 'study'}"],
        "plain": [*surgery, *common, "+actions=patch_resid", f"hydra.run.dir={out / 'plain'}"],
        "multirun": [*surgery, "-m", *common, "+actions=patch_resid", f"actions.capture_resid.select={layers}",
                     f"actions.patch_resid.index={positions}", f"hydra.sweep.dir={out / 'multirun'}"],
    }  # fmt: skip


def shown(argv: list[str], out: Path, prompts: dict[str, list[str]]) -> str:
    """``argv`` as the report shows it: the temporary directory as DIR, the prompt lists as […]."""
    text = " ".join(argv).replace(str(out), "DIR")
    for texts in prompts.values():
        text = text.replace(f"[{','.join(texts)}]", "[…]")
    return text


def cli(runs: int, multirun: bool = True) -> dict[str, Any]:
    """Wall (and CPU) seconds of the CLI study and one plain CLI run, interleaved ``runs`` times; the multirun once."""
    import torch
    from safetensors.torch import load_file

    env = {**cli_env(), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        prompts = save_model(out / "model")
        argv = commands(out / "model", prompts, out)
        wall: dict[str, list[float]] = {"study": [], "plain": []}
        cpu: dict[str, list[float]] = {"study": [], "plain": []}
        for name in wall:  # warms the file cache; the study's numbers are checked against surgery.study
            run_child(argv[name], cwd=out, env=env)
        model, clean, corrupt = setup()
        saved = load_file(str(out / "study" / "study.safetensors"))["values/logit_diff"]
        assert torch.allclose(saved, study(model, clean, corrupt, "auto"), rtol=1e-5, atol=1e-6), "CLI study differs"
        for i in range(runs):
            for name in ("study", "plain") if i % 2 == 0 else ("plain", "study"):
                run = run_child(argv[name], cwd=out, env=env)
                wall[name].append(run.wall_s)
                cpu[name].append(run.cpu_s)
        ratios = [a / b for a, b in zip(wall["study"], wall["plain"])]
        low, high = quartiles(ratios)
        result: dict[str, Any] = {
            "runs": runs,
            "wall_s": {k: statistics.median(v) for k, v in wall.items()},
            "cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
            "ratio": statistics.median(ratios),
            "quartiles": [low, high],
            "target": CLI_TARGET,
            "verdict": verdict(low, high, CLI_TARGET),
            "command": shown(argv["study"][1:], out, prompts),
        }
        if multirun:
            run = run_child(argv["multirun"], cwd=out, env=env)
            jobs = sum(1 for p in (out / "multirun").iterdir() if (p / "report.json").is_file())
            assert jobs == LAYERS * POSITIONS, f"the multirun wrote {jobs} jobs"
            result["multirun"] = {"jobs": jobs, "wall_s": run.wall_s, "cpu_s": run.cpu_s,
                                  "over_study": run.wall_s / result["wall_s"]["study"]}  # fmt: skip
    return result


def scale_child(cells: int) -> dict[str, Any]:
    """CPU seconds per cell of a ``cells``-cell study and the peak RSS it adds, in this fresh process."""
    import surgery

    model, clean, corrupt = setup()
    actions = {"cap": {**PATCH["cap"], "select": "transformer.h.1"},
               "patch": {**PATCH["patch"], "select": "transformer.h.1"}, "steer": STEER}  # fmt: skip

    def grid(n: int) -> dict[str, Any]:
        return {"pos": f"0:{SCALE_POSITIONS}", "coef": [round(0.01 * i, 2) for i in range(n // SCALE_POSITIONS)]}

    def run(n: int) -> Any:
        return surgery.study(model, actions, grid(n), corrupt, [{"logit_diff": {"correct": CORRECT, "wrong": WRONG}}],
                             source=clean, batch_cells=1)  # fmt: skip

    run(SCALE_POSITIONS)  # imports and torch's lazy allocations belong to the floor
    before = status_mib("VmRSS")
    reset = _reset_peak()  # else the warm-up's own peak would hide a smaller study's
    seconds = []
    for _ in range(max(1, 300 // cells)):  # small sizes repeated: a 10-cell study is a few tens of ms
        begin = time.process_time()
        result = run(cells)
        seconds.append(time.process_time() - begin)
    assert result.values["logit_diff"].shape == (SCALE_POSITIONS, cells // SCALE_POSITIONS, len(clean))
    added = (status_mib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024) - before
    return {"cells": cells, "seconds": statistics.median(seconds), "reps": len(seconds), "added_mib": added,
            "per_cell_s": statistics.median(seconds) / cells,
            "plans_mib": _plans_mib(model, actions, grid(cells)) if cells == max(SIZES) else None}  # fmt: skip


def _plans_mib(model: Any, actions: dict[str, Any], grid: dict[str, Any]) -> dict[str, float] | None:
    """Python memory (tracemalloc) of what a study keeps for its cells until its end: the template (a plan per
    group of cells) the study builds now, and every cell's compiled plan (the engine's route, which it falls back
    to for cells it cannot run as edits)."""
    import tracemalloc

    from surgery.core.compiler import Shared, load_actions
    from surgery.study.grid import cells, parse_grid

    try:  # the study's own planning steps; their home may move
        from surgery.study.direct import why_not_direct
        from surgery.study.run import plan_cells
        from surgery.study.template import Template
    except ImportError:
        return None
    spec, grid_cells = load_actions(actions), cells(parse_grid(grid))
    held = {}
    for name, build in (("template", lambda: Template(model, spec, grid_cells, 0, True, False, Shared(),
                                                      lambda plan: why_not_direct(plan, True))),
                        ("every plan", lambda: plan_cells(model, spec, grid_cells, 0, True, False, 1))):  # fmt: skip
        tracemalloc.start()
        kept = build()
        held[name] = tracemalloc.get_traced_memory()[0] / 2**20
        tracemalloc.stop()
        del kept
    return held


def _reset_peak() -> bool:
    """Start this process's peak RSS (VmHWM) again from its RSS now; False where Linux does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def scaling(sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Each size in a fresh child; the 1,000-cell per-cell time over the 10-cell one, and RSS growth."""
    rows = []
    for n in sizes:
        run = run_child([sys.executable, "-m", "scripts.bench.study_scale", "--child", str(n)], cwd=ROOT)
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    first, last = rows[0], rows[-1]
    ratio = last["per_cell_s"] / first["per_cell_s"]
    growth = last["added_mib"] - first["added_mib"]
    return {"rows": rows, "ratio": ratio, "target": SCALE_TARGET, "met": ratio <= SCALE_TARGET,
            "rss_growth_mib": growth, "rss_target_mib": RSS_TARGET_MIB, "rss_met": growth <= RSS_TARGET_MIB,
            "plans_mib": last.get("plans_mib")}  # fmt: skip


def cli_and_sizes(quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both cases, printed as they finish (``quick``: one CLI run each; 10 and 100 cells)."""
    on_cli = cli(1 if quick else 5)
    multi = on_cli["multirun"]
    print(f"CLI study {on_cli['wall_s']['study']:.2f} s, one plain CLI run {on_cli['wall_s']['plain']:.2f} s (wall):"
          f" {on_cli['ratio']:.3f} ({on_cli['quartiles'][0]:.3f}–{on_cli['quartiles'][1]:.3f}) {on_cli['verdict']};"
          f" the grid as a multirun {multi['wall_s']:.1f} s, {multi['over_study']:.2f}× the CLI study")  # fmt: skip
    sizes = scaling(SIZES[:2] if quick else SIZES)
    for row in sizes["rows"]:
        print(f"{row['cells']:5} cells: {row['per_cell_s'] * 1e3:.2f} ms a cell, peak RSS +{row['added_mib']:.1f} MiB")
    print(f"per cell, largest / 10 cells: {sizes['ratio']:.3f}; RSS growth {sizes['rss_growth_mib']:+.1f} MiB")
    return on_cli, sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one CLI run each; 10 and 100 cells")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(scale_child(args.child)))
        return 0
    on_cli, sizes = cli_and_sizes(args.quick)
    print(json.dumps({"cli": on_cli, "scale": sizes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
