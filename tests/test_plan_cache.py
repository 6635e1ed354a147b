"""Plans reused: the same recipe on the same module tree gets its compiled plan again (surgery/core/plan_cache.py).

A hit must be indistinguishable from a fresh plan: the same outputs and captures bit for bit, no record or
noise stream carried over from the apply before; anything that changes the recipe's content or the module
tree compiles afresh, and so does a recipe whose plan depends on a file, a callable named by import path
or a module built for it.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import surgery
from surgery.core import plan_cache
from surgery.core.compiler import compile_plan

ADD = {"add": {"kind": "modify_output", "select": "fc", "op": "add", "value": 1.5}}
NOISE = {"cap": {"kind": "capture", "select": "conv"}, "n": {"kind": "modify_output", "select": "fc", "op": "noise",
                                                             "std": 0.5}}  # fmt: skip


def run(model: nn.Module, plan_or_recipe, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """The output of one forward under the surgery, and every capture's recorded outputs."""
    with torch.no_grad(), surgery.apply(model, plan_or_recipe) as s:
        y = model(x)
        captured = {f"{a}/{m}": [c.output for c in r.calls] for a, rs in s.captures.items() for m, r in rs.items()}
    return y, captured


def test_the_same_recipe_again_is_the_same_plan_and_gives_the_same_bits(tiny, x_img) -> None:
    plan_cache.forget(tiny)
    first = surgery.plan(tiny, ADD)
    assert surgery.plan(tiny, copy.deepcopy(ADD)) is first  # by content: an equal dict is the same recipe
    assert surgery.plan(tiny, "capture_block3", strict=False) is surgery.plan(tiny, "capture_block3", strict=False)
    fresh = compile_plan(tiny, ADD, reuse=False)
    assert fresh is not first
    for recipe in (NOISE, ADD):
        cached_runs = [run(tiny, recipe, x_img) for _ in range(3)]  # the 2nd and 3rd apply hit the cache
        y, captured = run(tiny, compile_plan(tiny, recipe, reuse=False), x_img)
        for y_hit, captured_hit in cached_runs:  # no record, noise draw or counter carried over between applies
            assert torch.equal(y_hit, y)
            assert captured_hit.keys() == captured.keys()
            assert all(len(captured_hit[k]) == len(v) == 1 for k, v in captured.items())
            assert all(torch.equal(a, b) for k in captured for a, b in zip(captured_hit[k], captured[k]))


def test_a_site_recipe_and_the_logit_lens_are_reused(tiny_lm) -> None:
    model, clean, _ = tiny_lm
    lens = {"lens": {"kind": "capture", "select": "@resid_post", "lens": "logit"}}
    plan = surgery.plan(model, lens)
    assert surgery.plan(model, {"lens": dict(lens["lens"])}) is plan
    hit, fresh = run(model, lens, clean)[1], run(model, compile_plan(model, lens, reuse=False), clean)[1]
    assert hit.keys() == fresh.keys() and all(torch.equal(hit[k][0], fresh[k][0]) for k in fresh)


def test_a_recipe_changed_in_place_or_a_file_edited_is_compiled_again(tiny, x_img, tmp_path: Path) -> None:
    recipe = copy.deepcopy(ADD)
    first = surgery.plan(tiny, recipe)
    recipe["add"]["value"] = 2.5  # the same dict object, new content
    second = surgery.plan(tiny, recipe)
    assert second is not first and second.steps[0].config.value == 2.5
    with torch.no_grad():
        assert torch.equal(run(tiny, recipe, x_img)[0], tiny(x_img) + 2.5)
    assert surgery.plan(tiny, {"add": {**recipe["add"], "value": -0.0}}) is not surgery.plan(
        tiny, {"add": {**recipe["add"], "value": 0.0}}
    )  # equal numbers, different bits
    assert surgery.plan(tiny, ADD, seed=1) is not surgery.plan(tiny, ADD, seed=2)
    path = tmp_path / "recipe.yaml"
    path.write_text("add: {kind: modify_output, select: fc, op: add, value: 1.0}\n")
    from_file = surgery.plan(tiny, str(path))
    assert surgery.plan(tiny, str(path)) is from_file
    path.write_text("add: {kind: modify_output, select: fc, op: add, value: 3.0}\n")
    edited = surgery.plan(tiny, str(path))
    assert edited is not from_file and edited.steps[0].config.value == 3.0


def test_a_change_to_the_module_tree_compiles_again(x_img) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    recipe = {"a": {"kind": "modify_output", "select": "*", "type": "Linear", "op": "mul", "value": 2.0}}
    plan = surgery.plan(model, recipe)
    changes = [
        lambda: model.__setitem__(2, nn.Linear(8, 3)),  # a module replaced
        lambda: model.append(nn.Linear(3, 3)),  # a module added
        lambda: model[0].register_buffer("extra", torch.zeros(1)),  # a buffer added
        lambda: setattr(model[0].weight, "data", torch.zeros(8, 4, dtype=torch.float64)),  # dtype changed in place
        lambda: setattr(model[0].weight, "data", torch.zeros(9, 4)),  # shape changed in place
        lambda: model[0].weight.requires_grad_(False),  # frozen
        lambda: model.__delitem__(3),  # a module removed
    ]
    for change in changes:
        change()
        again = surgery.plan(model, recipe)
        assert again is not plan and [t.module for t in again.steps[0].targets] == [
            m for m in model if isinstance(m, nn.Linear)
        ]
        assert surgery.plan(model, recipe) is again
        plan = again


def test_plans_that_depend_on_more_than_the_recipe_are_never_reused(tiny, tmp_path: Path) -> None:
    path = tmp_path / "v.safetensors"
    save_file({"v": torch.ones(3)}, str(path))
    from_file = {"a": {"kind": "modify_output", "select": "fc", "op": "add", "from": {"file": str(path), "key": "v"}}}
    built = {"r": {"kind": "replace_module", "select": "act", "with": {"_target_": "torch.nn.Identity"}}}
    tensor = {"a": {"kind": "modify_output", "select": "fc", "op": "add", "value": torch.ones(3)}}
    for recipe in (from_file, built, tensor):
        assert surgery.plan(tiny, recipe) is not surgery.plan(tiny, recipe)
    save_file({"v": torch.full((3,), 2.0)}, str(path))  # the file changed: the next plan reads it again
    x = torch.randn(1, 1, 6, 6)
    with torch.no_grad():
        assert torch.equal(run(tiny, from_file, x)[0], tiny(x) + 2.0)


def test_the_cache_is_small_lives_on_the_model_and_is_not_copied(tiny) -> None:
    plan_cache.forget(tiny)
    for i in range(plan_cache.SIZE + 3):
        surgery.plan(tiny, {"add": {**ADD["add"], "value": float(i)}})
    assert plan_cache.kept(tiny) == plan_cache.SIZE
    assert plan_cache.kept(copy.deepcopy(tiny)) == 0
    assert plan_cache.kept(pickle.loads(pickle.dumps(tiny))) == 0
    assert "_surgery_plans" not in dict(tiny.named_modules()) and not any(
        "_surgery_plans" in k for k in tiny.state_dict()
    )


@pytest.mark.parametrize("options", [{"example_inputs": (torch.randn(1, 1, 6, 6),)}, {"reuse": False}])
def test_example_inputs_or_reuse_false_compile_afresh(tiny, options) -> None:
    assert compile_plan(tiny, ADD, **options) is not compile_plan(tiny, ADD, **options)
