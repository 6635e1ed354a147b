"""Costs known before work starts (SPEC §19): grids, study work, figures, harvest bytes and resolver arguments
are sized from the config's arithmetic and refused against ``limits`` before any model pass or write."""

from __future__ import annotations

import itertools
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import surgery
from surgery.core.limits import GB, SAFE_DEFAULTS, Limits, enforced
from surgery.errors import ConfigError
from surgery.safe import costs
from surgery.safe.interpolations import MAX_RESOLVER_ARGUMENT, check_interpolations
from surgery.study.result import StudyResult

PATCH = {
    "cap": {"kind": "capture", "select": "transformer.h.{layer}", "what": ["input"]},
    "patch": {"kind": "modify_input", "select": "transformer.h.{layer}", "op": "set", "index": "[:, {pos}]",
              "from": {"capture": "cap", "what": "input"}},
}  # fmt: skip
METRIC = [{"logit_diff": {"correct": 3, "wrong": 4}}]


@contextmanager
def no_forward(model: torch.nn.Module) -> Iterator[None]:
    """Fail the test if ``model`` runs a forward inside the block: a cost must be refused before any pass."""

    def ran(*_: Any) -> None:
        raise AssertionError("the model ran before the cost was checked")

    handle = model.register_forward_pre_hook(ran)
    try:
        yield
    finally:
        handle.remove()


def refused(call: Any, starts: str, ends: str | None = None, seconds: float = 2.0) -> str:
    """``call()`` raises a one-line ConfigError starting with ``starts`` (ending with ``ends``), quickly."""
    clock = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        call()
    text = str(info.value)
    assert time.perf_counter() - clock < seconds, text
    assert text.startswith(starts) and "\n" not in text, text
    if ends is not None:
        assert text.endswith(ends), text
    return text


# ---------------------------------------------------------------- 1, 2: a grid's cells, from its arithmetic


@pytest.mark.parametrize(
    ("method", "options"),
    [("patch", {}), ("attribution", {}), ("integrated_gradients", {"steps": 4})],
)
def test_a_grid_of_100k_cells_is_refused_against_limits_count_for_every_method(tiny_lm, method, options) -> None:
    model, clean, corrupt = tiny_lm
    grid = {"layer": "0:100", "pos": "0:1000"}
    with enforced(SAFE_DEFAULTS), no_forward(model):
        refused(lambda: surgery.study(model, PATCH, grid, corrupt, METRIC, source=clean, method=method, **options),
                "study.grid: 100,000 study cells", "limits.count=100000")  # fmt: skip


def test_a_grid_of_100k_cells_is_refused_in_plan_mode_before_the_model_is_built(tmp_path: Path) -> None:
    from surgery.app.job import run_job
    from tests.test_cli import composed

    cfg = composed("+experiment=induction_patching", "study.grid.layer=0:100", "study.grid.pos=0:1000", "mode=plan",
                   "safe=true")  # fmt: skip
    refused(lambda: run_job(cfg, tmp_path), "study.grid: 100,000 study cells", "limits.count=100000")
    assert not (tmp_path / "report.json").exists()


def test_a_huge_range_is_counted_never_listed() -> None:
    from surgery.study.grid import parse_grid

    assert costs.range_size(range(0, 10**12)) == 10**12
    assert costs.range_size(range(10, 0, -3)) == len(range(10, 0, -3))
    assert costs.range_size(range(5, 5)) == 0
    refused(lambda: parse_grid({"pos": "0:1000000000000"}), "study.grid: 1,000,000,000,000 cells are more than")
    with enforced(SAFE_DEFAULTS):
        refused(lambda: parse_grid({"pos": "0:1000000000000:7"}), "study.grid: 142,857,142,858 study cells")
    assert parse_grid({"layer": "0:6:2", "pos": [1, 4]}) == {"layer": [0, 2, 4], "pos": [1, 4]}


# ---------------------------------------------------------------- 3: a study's work and memory, before any pass


def test_forward_rows_are_cells_times_examples_bounded_before_any_pass(tiny_lm) -> None:
    model, _, _ = tiny_lm
    many = torch.randint(2, 20, (1001, 5))  # 10 cells × 1,001 examples: 10,010 rows, past 10 × 1,000
    with enforced(Limits(count=10)), no_forward(model):
        refused(lambda: surgery.study(model, PATCH, {"layer": "0:2", "pos": "all"}, many, METRIC, source=many),
                "study.grid: 10,010 forward rows (10 cells × 1,001 examples)", "limits.count=11")  # fmt: skip


def test_bootstrap_draws_and_ig_steps_are_bounded_before_any_pass(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    grid = {"layer": "0:2", "pos": "all"}
    with enforced(Limits(count=10)), no_forward(model):
        refused(lambda: surgery.study(model, PATCH, grid, corrupt, METRIC, source=clean, ci=0.9, n_boot=2000),
                "study.n_boot: 20,000 bootstrap means (2,000 draws × 10 cells)", "limits.count=20")  # fmt: skip
    with enforced(Limits(count=100)), no_forward(model):
        refused(lambda: surgery.study(model, PATCH, grid, corrupt, METRIC, source=clean,
                                      method="integrated_gradients", steps=20),
                "study.steps: 200 integrated-gradient passes (20 steps × 10 cells)", "limits.count=200")  # fmt: skip


def test_rows_in_one_forward_are_bounded_by_memory_before_any_pass(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    grid = {"layer": "0:2", "pos": "all"}
    # 10 cells × 3 examples = 30 rows, each about 5 positions × 128 (the widest dimension) float32s: 76,800 bytes
    with enforced(Limits(memory_gb=50_000 / GB)), no_forward(model):
        refused(lambda: surgery.study(model, PATCH, grid, corrupt, METRIC, source=clean, batch_cells=10),
                "study.batch_cells: would need", "limits.memory_gb=1")  # fmt: skip


def test_a_small_study_passes_its_costs_and_runs(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    with enforced(SAFE_DEFAULTS):
        result = surgery.study(model, PATCH, {"layer": "0:2", "pos": "all"}, corrupt, METRIC, source=clean, ci=0.9)
    assert result.values["logit_diff"].shape == (2, 5, 3)


# ---------------------------------------------------------------- 4: figures sized before drawing


def synthetic(grid: dict[str, list]) -> StudyResult:
    sizes = [len(v) for v in grid.values()]
    names = list(grid)
    cells = [dict(zip(names, combo, strict=True)) for combo in itertools.product(*grid.values())]
    mean = torch.linspace(-1, 1, len(cells)).reshape(sizes)
    return StudyResult(grid=grid, cells=cells, values={"m": mean[..., None]}, mean={"m": mean})


def png_size(path: Path) -> tuple[int, int]:
    from surgery.files.gate import read_bytes

    width, height = struct.unpack(">II", read_bytes(path, "png", cap=None)[16:24])
    return width, height


@pytest.mark.parametrize(
    "grid",
    [
        {"layer": [0, 1], "pos": list(range(4000))},  # a heatmap 4,000 columns wide
        {"head": list(range(16)), "layer": [0, 1], "pos": list(range(600))},  # 16 panels of 600 columns
        {"a": list(range(65)), "layer": [0], "pos": [0, 1]},  # more panels than a figure draws
    ],
    ids=["4000_columns", "16x600_panels", "65_panels"],
)
def test_a_figure_past_the_caps_is_not_drawn_its_numbers_go_to_csv(grid, tmp_path: Path) -> None:
    from surgery.study.plots import undrawn

    result = synthetic(grid)
    clock = time.perf_counter()
    written = result.plot(tmp_path)
    assert time.perf_counter() - clock < 5
    assert [p.name for p in written] == ["study_m.csv"]
    assert not (tmp_path / "study_m.png").exists()
    assert (tmp_path / "study_m.csv").read_text().count("\n") == 1 + len(result.cells)
    assert undrawn(result)["study_m.png"].startswith("not drawn: ")


def test_a_wide_heatmap_within_the_caps_is_squeezed_to_fit(tmp_path: Path) -> None:
    result = synthetic({"layer": [0, 1], "pos": list(range(300))})  # 0.5 in a column would be 15,200 pixels
    (path,) = result.plot(tmp_path)
    width, height = png_size(path)
    assert path.suffix == ".png" and width <= costs.FIGURE_MAX_PIXELS and height <= costs.FIGURE_MAX_PIXELS


def test_a_study_job_notes_an_undrawn_figure_in_its_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from surgery.app.job import run_job
    from surgery.study import plots
    from tests.test_cli import composed

    monkeypatch.setattr(costs, "FIGURE_MAX_PIXELS", 300)  # 13 positions no longer fit: the CSV instead
    monkeypatch.setattr(plots, "FIGURE_MAX_PIXELS", 300)
    report = run_job(composed("+experiment=induction_patching", "study.ci=null"), tmp_path)
    assert report["plots"] == []
    assert set(report["plot_notes"]) == {"plots/study_logit_diff.png", "plots/study_prob.png"}
    assert (tmp_path / "plots" / "study_logit_diff.csv").is_file()
    assert "`plots/study_logit_diff.png` not drawn: " in (tmp_path / "report.md").read_text()


# ---------------------------------------------------------------- 5: harvest bytes before the first shard


def test_a_harvest_past_the_disk_budget_is_refused_before_the_first_shard(tmp_path: Path) -> None:
    from surgery.harvest import harvest_corpus
    from tests.harvest_helpers import make_corpus

    corpus = make_corpus(tmp_path / "corpus", datasets=False)
    shard_mb = 8 * 16 * 32 * 4 / 2**20  # 8 rows of 16 tokens × 32 float32s a site: about 33 KB a shard
    out = tmp_path / "out"

    with enforced(Limits(disk_gb=100_000 / GB)):  # 80 rows × 2 sites × 2 KiB: past 100 KB
        refused(lambda: harvest_corpus(corpus.model, corpus.tokenizer, corpus.jsonl, out, ["transformer.h.*"],
                                       context=16, limit_tokens=16 * 80, batch_size=4, shard_mb=shard_mb,
                                       progress=False), "input.limit_tokens: the run would write")  # fmt: skip
    assert not out.exists()
    assert costs.harvest_bytes(10, [2048, 2048], 16) == 10 * (4096 + 256)


# ---------------------------------------------------------------- 6: resolver arguments


def test_a_long_resolver_argument_is_refused_in_one_line_at_once() -> None:
    bomb = {"hydra": {"run": {"dir": "outputs/${now:" + "%Y-" * 300_000 + "}"}}}
    for safe in (True, False):
        refused(lambda safe=safe: check_interpolations(bomb, safe=safe),
                "hydra.run.dir: the argument of ${now:...} is 900,000 characters", seconds=1)  # fmt: skip
    check_interpolations({"d": "${now:" + "x" * MAX_RESOLVER_ARGUMENT + "}", "e": "${now:%Y-%m-%d}/${d}"}, safe=True)


# ---------------------------------------------------------------- the CLI: one line, exit 2, nothing written


def test_the_cli_refuses_a_costly_study_in_one_line_with_exit_2_writing_nothing(tmp_path: Path) -> None:
    from tests.test_cli import cli

    result = cli("+experiment=induction_patching", "study.grid.layer=0:100", "study.grid.pos=0:1000", "safe=true",
                 "hydra.run.dir=run", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: study.grid: 100,000 study cells"), lines
    assert lines[0].endswith("raise it: limits.count=100000")
    run = tmp_path / "run"
    assert not run.exists() or {p.name for p in run.iterdir()} <= {".hydra", "surgery.log"}
