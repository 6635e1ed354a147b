"""Cells run as edits at sites (surgery/study/direct.py) give the same bits as applying each cell's plan.

The engine route (each cell's plan applied, today's fallback) is forced by making every plan ineligible;
both routes run the same forwards (same rows, same cells per forward), so every value must be equal.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import surgery
from surgery.core.compiler import Shared
from surgery.study.direct import why_not_direct
from surgery.study.grid import cells, parse_grid
from surgery.study.template import Template

PATCH = {
    "cap": {"kind": "capture", "select": "transformer.h.{layer}", "what": ["input"]},
    "patch": {"kind": "modify_input", "select": "transformer.h.{layer}", "op": "set", "index": "[:, {pos}]",
              "from": {"capture": "cap", "what": "input"}},
}  # fmt: skip
OUT_PATCH = {
    "cap": {"kind": "capture", "select": "transformer.h.{layer}.mlp"},
    "patch": {"kind": "modify_output", "select": "transformer.h.{layer}.mlp", "op": "patch", "index": "[:, {pos}, :8]",
              "from": {"capture": "cap"}},
}  # fmt: skip
study_run = importlib.import_module("surgery.study.run")  # surgery.study is the function
METRICS = [{"logit_diff": {"correct": 3, "wrong": 4}}, {"prob": {"token": 3}}, "kl"]


def both_routes(monkeypatch, *args, **options) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The study's values by edits at sites, and by each cell's plan applied (the engine's route)."""
    direct = surgery.study(*args, **options).values
    with monkeypatch.context() as m:
        m.setattr(study_run, "why_not_direct", lambda plan, sourced: "forced: the engine's route")
        engine = surgery.study(*args, **options).values
    return direct, engine


SHIFT = {"kind": "modify_output", "select": "transformer.h.0.mlp", "op": "add", "value": 0.25, "passes": "main"}
OPS = {"kind": "modify_output", "select": "transformer.h.{layer}", "op": "{op}", "value": 1.7, "index": "[:, :, {d}]",
       "passes": "main"}  # fmt: skip
STEER = {"kind": "modify_output", "select": "transformer.h.0.mlp", "op": "add", "value": "{coef}", "index": "[:, -1]"}
COEF = {"kind": "modify_input", "select": "transformer.h.1", "op": "mul", "value": "{coef}", "index": "[:, -1]",
        "passes": "main"}  # fmt: skip
AT_1 = {"cap": {**PATCH["cap"], "select": "transformer.h.1"}, "patch": {**PATCH["patch"], "select": "transformer.h.1"}}
CASES = [
    (PATCH, {"layer": "0:2", "pos": "all"}),
    (OUT_PATCH, {"layer": [1, 0], "pos": [0, 3, 4]}),
    ({**PATCH, "shift": SHIFT}, {"layer": [1], "pos": "1:4"}),  # an action the same in every cell
    ({"m": OPS}, {"layer": [0, 1], "op": ["add", "mul", "set", "zero"], "d": [0, 5]}),  # ops differ in one forward
    ({**AT_1, "steer": STEER}, {"pos": "0:3", "coef": [0.5, 2.0]}),  # changes the source pass: each cell its own
    ({"m": COEF}, {"coef": [0.0, -0.0, 0.3, 7.0]}),
]


@pytest.mark.parametrize("batch_cells", [1, 4, "auto"])
@pytest.mark.parametrize(("actions", "grid"), CASES)
def test_edits_at_sites_equal_each_cells_plan_applied_bit_for_bit(tiny_lm, monkeypatch, actions, grid, batch_cells):
    model, clean, corrupt = tiny_lm
    if "steer" in actions and batch_cells == 4:  # each cell's source pass is its own: one cell a forward
        with pytest.raises(surgery.ConfigError, match="4 cells cannot share a forward: actions.steer changes the sou"):
            surgery.study(model, actions, grid, corrupt, METRICS, source=clean, batch_cells=batch_cells)
        return
    direct, engine = both_routes(monkeypatch, model, actions, grid, corrupt, METRICS, source=clean,
                                 batch_cells=batch_cells)  # fmt: skip
    for name in engine:
        assert torch.equal(direct[name], engine[name]), name
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_a_study_without_a_source_and_a_classifier(monkeypatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    actions = {"scale": {"kind": "modify_output", "select": "1", "op": "mul", "value": "{coef}", "index": "[:, {j}]"}}
    grid = {"coef": [0.0, 0.5, 2.0], "j": [0, 7]}
    for batch_cells in (1, "auto"):
        direct, engine = both_routes(monkeypatch, model, actions, grid, x, ["loss", "accuracy"], labels=y,
                                     batch_cells=batch_cells)  # fmt: skip
        assert all(torch.equal(direct[n], engine[n]) for n in engine)


def test_one_hook_per_site_serves_every_cell_of_a_forward(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    block = model.transformer.h[0]
    seen: list[int] = []  # hooks on block 0 besides this one, at each of its calls
    handle = block.register_forward_pre_hook(lambda m, a: seen.append(len(m._forward_pre_hooks) - 1))
    try:
        surgery.study(model, PATCH, {"layer": [0], "pos": "all"}, corrupt, METRICS[:1], source=clean, batch_cells=5)
    finally:
        handle.remove()
    assert seen == [0, 0, 1]  # the unmodified run, the source run, then one forward of the 5 cells: one hook


def test_cells_keep_no_plan_each(tiny_lm) -> None:
    model, _, _ = tiny_lm
    spec = {"m": {"kind": "modify_output", "select": "transformer.h.{layer}", "op": "add", "value": "{coef}",
                  "index": "[:, {pos}]", "passes": "main"}}  # fmt: skip
    grid = cells(parse_grid({"layer": [0, 1], "pos": "0:5", "coef": [float(c) for c in range(100)]}))
    template = Template(model, spec, grid, 0, True, False, Shared(), lambda plan: why_not_direct(plan, False))
    assert template.why_not is None and len(template.every_plan()) == 2  # one per layer, for 1,000 cells
    edits = template.edits(999)
    assert edits[0].value == 99.0 and edits[0].index_text == "[:, 4]" and edits[0].cell == grid[999]


def test_a_cell_whose_index_does_not_fit_is_named_before_any_cell_runs(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    forwards: list[int] = []
    handle = model.register_forward_hook(lambda m, a, o: forwards.append(1))
    try:
        wanted = (
            r"^study cell \{layer: 0, pos: 7\}: actions.patch.index: "
            r"\[:, 7\] does not fit the input of 'transformer\.h\.0'"
        )
        with pytest.raises(surgery.ConfigError, match=wanted):
            surgery.study(model, PATCH, {"layer": [0, 1], "pos": [0, 7]}, corrupt, METRICS, source=clean)
    finally:
        handle.remove()
    assert len(forwards) == 1  # the unmodified run, where every cell's index is checked
