"""What the benchmark scripts rely on, checked on tiny models (behaviour only, never timings).

The benchmarks compare surgery with the same hooks written by hand; these tests pin that the
comparison is fair: identical outputs, captures and gradients, the same hooks on the same
modules and none elsewhere, and a surgered model that ``torch.compile`` traces whole.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's scripts/ package

import surgery  # noqa: E402
from scripts.bench import cases  # noqa: E402
from scripts.bench import compile as bench_compile  # noqa: E402
from scripts.bench import overhead as bench_overhead  # noqa: E402
from scripts.bench import plan as bench_plan  # noqa: E402
from surgery.core.restore import hooks_on  # noqa: E402

TASK_MODES = [(task, mode) for task in cases.TASKS for mode in task.modes]


@pytest.fixture(scope="module")
def tiny_mlp() -> cases.ModelCase:
    return cases.mlp_case(8, rounds=1, block_s=0.0, batch=2)


@pytest.mark.parametrize(("task", "mode"), TASK_MODES, ids=[f"{t.name}/{m}" for t, m in TASK_MODES])
def test_engine_and_hand_written_hooks_agree(tiny_mlp: cases.ModelCase, task, mode) -> None:
    """Same output, gradients and captures; same hooks on every module; nothing left after remove()."""
    on = cases.inplace_case(tiny_mlp) if task.inplace else tiny_mlp
    plan = surgery.plan(on.model, task.actions)
    bench_overhead.check_task(on, task, plan, mode)


def test_check_task_notices_a_different_hook(tiny_mlp: cases.ModelCase) -> None:
    """The check is not vacuous: an engine plan doing something else than the hand hooks is caught."""
    task = cases.TASKS[1]  # add 1.0 to every Linear output
    other = surgery.plan(tiny_mlp.model, {"add": {**task.actions["add"], "value": 2.0}})
    with pytest.raises(AssertionError, match="outputs differ"):
        bench_overhead.check_task(tiny_mlp, task, other, "fwd")


def test_unselected_modules_carry_no_hooks(tiny_mlp: cases.ModelCase) -> None:
    model = tiny_mlp.model
    with surgery.apply(model, cases.TASKS[0].actions):
        hooked = {name for name, m in model.named_modules() if bench_overhead.own_hooks(m)}
        linear = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        assert hooked == linear
    assert hooks_on(model) == 0


def test_a_target_is_met_only_when_the_whole_interquartile_range_is_inside() -> None:
    from scripts.bench.common import verdict

    assert verdict(0.99, 1.02, 1.03) == "met"
    assert verdict(0.99, 1.04, 1.03) == "within noise"  # the median may be under the target: still not met
    assert verdict(1.031, 1.05, 1.03) == "over"


def test_the_plan_baseline_matches_what_surgery_selects() -> None:
    model, _ = bench_plan.build(300)
    assert bench_plan.plan_counts(model) == bench_plan.baseline(model)


BUILT_IN = [  # one per mechanism: output hook, sliced op, pre-hook, replaced forward (two ways), capture
    "modify_output add",
    "modify_output zero + index",
    "modify_output noise",
    "modify_input mul",
    "replace_forward identity",
    "replace_forward linear",
    "capture (one call)",
]
EXPRESSIONS = ["expr: modify_output", "expr: replace_forward x"]
READS_MODULE = "expr: replace_forward module"


@pytest.mark.parametrize("name", BUILT_IN)
def test_built_in_ops_compile_without_graph_breaks(name: str) -> None:
    model, x = bench_compile.make_model(8, 2)
    result = bench_compile.explain_case(bench_compile.CASES[name], model, x)
    assert result["graph_breaks"] == 0, result["reasons"]
    assert result["equal_to_eager"]


@pytest.mark.parametrize("name", [*EXPRESSIONS, READS_MODULE])
def test_expressions_compile_without_graph_breaks(name: str) -> None:
    model, x = bench_compile.make_model(8, 2)
    result = bench_compile.explain_case(bench_compile.CASES[name], model, x)
    assert result["equal_to_eager"]
    assert result["graph_breaks"] == 0, result["reasons"]


def test_the_after_compile_demonstration_applies_and_removes_cleanly() -> None:
    """bench_compile's demonstration really applies the surgery (the eager model changes) and leaves no hook."""
    model, x = bench_compile.make_model(8, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = bench_compile.surgery_after_compile(model, x)
    assert result["inner model"]["eager_model_changed"]
    assert hooks_on(model) == 0
