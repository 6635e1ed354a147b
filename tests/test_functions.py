"""``function: NAME``: capture, modify_output and replace_forward on the results of a torch function called inside a
module's forward, against the same thing written by hand, bit for bit; plan-time checks; exact removal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery.errors import ConfigError


class Scores(nn.Module):
    """softmax(x W) V three ways: torch.nn.functional.softmax, torch.softmax and Tensor.softmax."""

    def __init__(self, how: str = "functional") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w, self.v = nn.Linear(4, 4), nn.Linear(4, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.w(x)
        p = (
            F.softmax(s, dim=-1)
            if self.how == "functional"
            else torch.softmax(s, -1)
            if self.how == "torch"
            else s.softmax(-1)
        )
        return self.v(p)


class Model(nn.Module):
    def __init__(self, how: str = "functional") -> None:
        super().__init__()
        self.scores, self.other = Scores(how), Scores(how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(self.scores(x))


def _x() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("how", ["functional", "torch", "method"])
def test_capture_sees_softmax_however_it_is_called(how: str) -> None:
    model, x = Model(how), _x()
    expected = F.softmax(model.scores.w(x), dim=-1)
    recipe = {"p": {"kind": "capture", "select": "scores", "function": "softmax"}}
    with surgery.apply(model, recipe, example_inputs=(x,), verify=True) as s:
        model(x)
        (call,) = s.captures["p"]["scores"].calls
    assert torch.equal(call.output, expected)


def test_modify_output_changes_each_call_of_the_function() -> None:
    model, x = Model(), _x()
    m = model.scores
    expected = model.other(m.v(F.softmax(m.w(x), dim=-1) * 0.5))
    recipe = {"half": {"kind": "modify_output", "select": "scores", "function": "softmax", "op": "mul", "value": 0.5}}
    with surgery.apply(model, recipe, verify=True):
        assert torch.equal(model(x), expected)


def test_replace_forward_replaces_the_function_result() -> None:
    model, x = Model(), _x()
    m = model.scores
    scores = m.w(x)
    expected = model.other(m.v(torch.ones_like(scores) / 4))
    recipe = {
        "flat": {"kind": "replace_forward", "select": "scores", "function": "softmax", "expr": "ones_like(output) / 4"}
    }
    with surgery.apply(model, recipe, verify=True):
        assert torch.equal(model(x), expected)


def test_capture_input_of_the_function_and_calls() -> None:
    model, x = Model(), _x()
    recipe = {"p": {"kind": "capture", "select": "scores", "function": "softmax", "what": ["input"], "calls": "1:"}}
    with surgery.apply(model, recipe) as s:
        model(x), model(x * 2)
        (call,) = s.captures["p"]["scores"].calls
    assert torch.equal(call.input[0], model.scores.w(x * 2).detach())


def test_modules_not_selected_run_outside_the_mode() -> None:
    model, x = Model(), _x()
    depth: list[int] = []
    model.other.register_forward_pre_hook(lambda m, a: depth.append(torch._C._len_torch_function_stack()))
    with surgery.apply(model, {"p": {"kind": "capture", "select": "scores", "function": "softmax"}}):
        model(x)
    assert depth == [0]


class Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F.softmax(x, -1)
        raise RuntimeError("boom")


def test_an_exception_in_the_forward_leaves_the_mode() -> None:
    model = Raises()
    with surgery.apply(model, {"p": {"kind": "capture", "select": "<root>", "function": "softmax"}}, verify=True) as s:
        with pytest.raises(RuntimeError, match="boom"):
            model(_x())
        assert torch._C._len_torch_function_stack() == 0
        assert len(s.captures["p"]["<root>"].calls) == 1


def test_a_function_the_forward_never_calls_is_refused_with_example_inputs() -> None:
    model, x = Model(), _x()
    with pytest.raises(ConfigError, match=r"^actions\.p\.function: Scores\.forward of 'scores' never calls matmul"):
        surgery.plan(model, {"p": {"kind": "capture", "select": "scores", "function": "matmul"}}, example_inputs=(x,))
    surgery.plan(model, {"p": {"kind": "capture", "select": "scores", "function": "matmul"}})  # nothing to run: allowed


@pytest.mark.parametrize(
    ("action", "where", "fragment"),
    [
        ({"kind": "capture", "function": "softmx"}, "function", "Did you mean"),
        ({"kind": "modify_input", "function": "softmax", "op": "zero"}, "function", "modify_input acts before"),
        ({"kind": "capture", "function": "softmax", "prepend": True}, "prepend", "drop prepend"),
    ],
)
def test_function_keys_refused_at_plan_time(action: dict, where: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=rf"^actions\.p\.{where}: .*{fragment}"):
        surgery.plan(Model(), {"p": {"select": "scores", **action}})


def test_attention_patterns_of_gpt2_equal_output_attentions() -> None:
    pytest.importorskip("transformers")
    from surgery.models.hf import gpt2_tiny

    torch.manual_seed(0)
    model = gpt2_tiny(n_layer=2)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(3))
    expected = model(ids, output_attentions=True).attentions
    recipe = {"attn": {"kind": "capture", "select": "transformer.h.*.attn", "function": "softmax"}}
    with surgery.apply(model, recipe, example_inputs=(ids,), verify=True) as s:
        model(ids)
        got = [s.captures["attn"][f"transformer.h.{i}.attn"].calls for i in range(2)]
    assert all(len(calls) == 1 and torch.equal(calls[0].output, expected[i]) for i, calls in enumerate(got))


def test_gpt2_with_sdpa_attention_is_refused_naming_the_key() -> None:
    pytest.importorskip("transformers")
    from surgery.models.hf import gpt2_tiny

    model = gpt2_tiny(n_layer=1, attn_implementation="sdpa")
    recipe = {"attn": {"kind": "capture", "select": "transformer.h.*.attn", "function": "softmax"}}
    with pytest.raises(ConfigError, match=r"^actions\.attn\.function: GPT2Attention\.forward .* never calls softmax"):
        surgery.plan(model, recipe, example_inputs=(torch.zeros(1, 4, dtype=torch.long),))
