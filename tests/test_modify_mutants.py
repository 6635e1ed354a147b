"""modify_output and modify_input pinned down exactly (surgery/actions/forward.py): items, keyword-only and named
inputs, ``calls``, modules that refuse hooks, and every refusal's exact text, against plain PyTorch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery import ActionError, ConfigError
from tests.test_forward_mutants import Holder, X
from tests.test_functions import Model as SoftmaxModel

# ---------------------------------------------------------------- modify_output


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("alpha", torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x * 2


def test_modify_output_item_op_reads_the_module() -> None:
    module = Pair()
    recipe = {
        "o": {"kind": "modify_output", "select": "<root>", "item": 1, "op": "expr", "expr": "output * module.alpha"}
    }
    with surgery.apply(module, recipe, verify=True) as s:
        a, b = module(X)
        assert s.hook_count == {"o": 1}
    assert torch.equal(a, X + 1) and torch.equal(b, X * 2 * 3.0)


def test_modify_output_with_function_refuses_a_capture_source() -> None:
    recipe = {
        "c": {"kind": "capture", "select": "scores"},
        "o": {
            "kind": "modify_output",
            "select": "scores",
            "function": "softmax",
            "op": "add",
            "from": {"capture": "c"},
        },
    }
    with pytest.raises(ConfigError) as e:
        surgery.plan(SoftmaxModel(), recipe)
    assert str(e.value) == "actions.o.from: a capture source is read on module calls, not with function:"


class Refuses(nn.Module):
    """A module that takes no hooks (as some wrappers do)."""

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no hooks here")

    register_forward_pre_hook = register_forward_hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize(
    "action",
    [
        {"kind": "replace_forward", "fn": "identity"},
        {"kind": "modify_output", "op": "zero"},
        {"kind": "modify_input", "item": 0, "op": "zero"},
    ],
)
def test_a_module_refusing_hooks_is_named(action: dict) -> None:
    model = nn.Sequential(nn.Identity(), Refuses())
    with pytest.raises(ActionError) as e:
        surgery.apply(model, {"k": {**action, "select": "1"}})
    assert str(e.value) == "actions.k: failed on '1': RuntimeError: no hooks here. Nothing was changed."


# ---------------------------------------------------------------- modify_input


@pytest.mark.parametrize("item", [1.5, True, [0]])
def test_modify_input_item_must_be_a_position_or_name(item: Any) -> None:
    with pytest.raises(ConfigError) as e:
        surgery.plan(Holder(), {"k": {"kind": "modify_input", "select": "m", "item": item, "op": "zero"}})
    assert str(e.value) == f"actions.k.item: an input is picked by position or argument name, got {item!r}"


class Star(nn.Module):
    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return x


class OnlyStar(nn.Module):
    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return args[0]


class KeywordOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("alpha", torch.tensor(3.0))

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x * scale


@pytest.mark.parametrize(
    ("module", "select", "item", "message"),
    [
        (Holder(), "m", -1, "-1: an input is picked by its position from 0, or by argument name; Scale.forward of"
         " 'm' takes 3 positional input(s): x, k, bias"),
        (Star(), "<root>", -2, "-2: an input is picked by its position from 0, or by argument name; Star.forward of"
         " '<root>' takes 1 positional input(s) (and any number more): x"),
        (OnlyStar(), "<root>", -1, "-1: an input is picked by its position from 0, or by argument name;"
         " OnlyStar.forward of '<root>' takes 0 positional input(s) (and any number more): none"),
        (Holder(), "m", "nope", "Scale.forward of 'm' has no input 'nope'; its inputs: x, k, bias"),
        (OnlyStar(), "<root>", "nope", "OnlyStar.forward of '<root>' has no input 'nope'; its inputs: none"),
    ],
)  # fmt: skip
def test_modify_input_refuses_an_input_forward_does_not_take(module: Any, select: str, item: Any, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        surgery.plan(module, {"k": {"kind": "modify_input", "select": select, "item": item, "op": "zero"}})
    assert str(e.value) == f"actions.k.item: {message}"


def test_a_negative_position_matching_nothing_says_no_more() -> None:
    recipe = {"k": {"kind": "modify_input", "select": "none", "allow_empty": True, "item": -1, "op": "zero"}}
    with pytest.raises(ConfigError) as e:
        surgery.plan(Holder(), recipe)
    assert str(e.value) == "actions.k.item: -1: "


def test_modify_input_refuses_function() -> None:
    recipe = {"k": {"kind": "modify_input", "select": "scores", "item": 0, "op": "zero", "function": "softmax"}}
    with pytest.raises(ConfigError) as e:
        surgery.plan(SoftmaxModel(), recipe)
    assert str(e.value) == (
        "actions.k.function: modify_input acts before the forward runs; function: works on capture,"
        " modify_output and replace_forward"
    )


def test_modify_input_of_a_keyword_only_input_reads_the_module() -> None:
    module, scale = KeywordOnly(), torch.tensor(0.5)
    recipe = {
        "k": {"kind": "modify_input", "select": "<root>", "item": "scale", "op": "expr", "expr": "x * module.alpha"}
    }
    handle = module.register_forward_pre_hook(
        lambda m, a, k: (a, {**k, "scale": k["scale"] * m.alpha}), with_kwargs=True
    )
    expected = module(X, scale=scale)
    handle.remove()
    with surgery.apply(module, recipe, verify=True) as s:
        assert torch.equal(module(X, scale=scale), expected)
        assert s.hook_count == {"k": 1}


def test_modify_input_named_input_not_passed_says_what_came() -> None:
    model = Holder()
    with surgery.apply(model, {"k": {"kind": "modify_input", "select": "m", "item": "bias", "op": "zero"}}):
        with pytest.raises(ActionError) as e:
            model.m(X, 2.0)
    assert str(e.value) == (
        "actions.k.item on module 'm': input 'bias' was not passed;"
        " the module got 2 positional input(s) and keywords []"
    )


def test_modify_input_calls_changes_only_the_selected_call() -> None:
    model = Holder()
    recipe = {"k": {"kind": "modify_input", "select": "m", "item": 0, "op": "mul", "value": -2.0, "calls": [1]}}
    with surgery.apply(model, recipe, verify=True):
        got = [model(X, 2.0) for _ in range(3)]
    assert torch.equal(got[0], X * 2.0) and torch.equal(got[1], X * -2.0 * 2.0) and torch.equal(got[2], X * 2.0)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"index": "[:, 5]"}, "actions.k.index: [:, 5] does not fit the input of 'm', shape [2, 4]: index 5 is out"
         " of bounds for dimension 1 with size 4"),
        ({"index": "[:, a"}, "actions.k.index: an index must be written in brackets, like '[:, 3:5]'; got '[:, a'"),
        ({"op": "set", "from": torch.ones(3)}, "actions.k.from: the tensor given as from has shape [3], but the input"
         " of 'm' is [2, 4] on this input: it does not broadcast onto it"),
        ({"op": "patch", "from": {"file": "/nonexistent/c.safetensors", "key": "c/m/input"}},
         "actions.k.from.file: '/nonexistent/c.safetensors' does not exist; capture it first (e.g. kind: capture)"),
    ],
)  # fmt: skip
def test_modify_input_shapes_are_checked_on_the_example_input(extra: dict, message: str) -> None:
    recipe = {"k": {"kind": "modify_input", "select": "m", "item": 0, "op": "zero", **extra}}
    with pytest.raises(ConfigError) as e:
        surgery.plan(Holder(), recipe, example_inputs=(X, 2.0))
    assert str(e.value) == message
