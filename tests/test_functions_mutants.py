"""``function: NAME``, pinned where mutation testing found nothing watching.

What a user sees of capture / modify_output / replace_forward acting on a torch function's calls inside a forward:
keyword inputs and which of input/output a call keeps, ``reduce`` statistics and their keys, ``to: disk`` and
``plot``, ``calls`` counting and ``reset_calls``, hook counts, the plan table's mechanism, the error naming action
and module, ``module`` reads, ``fn`` callables with and without ``kwargs``, and hooks
of the user's that run outside the mode (at plan and at run time). Numbers are compared with plain PyTorch, bit
for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError


class Adds(nn.Module):
    """F.linear with its bias by keyword (a tensor kwarg of the function call)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight, self.bias = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
        self.scale = nn.Parameter(torch.tensor(0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, bias=self.bias) * 3


class Softmaxes(nn.Module):
    """torch.softmax with its dim by position (no keyword inputs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.lin(x), -1)
        return p[:, :2] - p[:, 2:]


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.adds, self.soft = Adds(), Softmaxes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.soft(self.adds(x))


def _x(seed: int = 2) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))


def _linear(adds: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The call of F.linear inside Adds, in plain torch."""
    return F.linear(x, adds.weight, bias=adds.bias).detach()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hooks(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


def test_capture_keeps_positional_and_keyword_inputs_and_the_output() -> None:
    model, x = Outer(), _x()
    adds = model.adds
    recipe = {"p": {"kind": "capture", "select": "adds", "function": "linear", "what": ["input", "output"]}}
    with surgery.apply(model, recipe, verify=True) as s:
        model(x)
        record = s.captures["p"]["adds"]
        (call,) = record.calls
    assert record.reduce == "none"
    assert len(call.input) == 2 and torch.equal(call.input[0], x) and torch.equal(call.input[1], adds.weight)
    assert list(call.kwargs) == ["bias"] and torch.equal(call.kwargs["bias"], adds.bias)
    assert torch.equal(call.output, _linear(adds, x))


@pytest.mark.parametrize(("what", "has_input", "has_output"), [(["output"], False, True), (["input"], True, False)])
def test_capture_keeps_only_what_it_is_asked_for(what: list[str], has_input: bool, has_output: bool) -> None:
    model, x = Outer(), _x()
    recipe = {"p": {"kind": "capture", "select": "adds", "function": "linear", "what": what}}
    with surgery.apply(model, recipe) as s:
        model(x)
        (call,) = s.captures["p"]["adds"].calls
    assert (call.input is not None, call.kwargs is not None, call.output is not None) == (
        has_input,
        has_input,
        has_output,
    )


def test_capture_of_a_call_without_keyword_inputs_keeps_no_kwargs() -> None:
    model, x = Outer(), _x()
    recipe = {"p": {"kind": "capture", "select": "soft", "function": "softmax", "what": ["input"]}}
    with surgery.apply(model, recipe) as s:
        model(x)
        (call,) = s.captures["p"]["soft"].calls
    assert call.kwargs is None
    assert call.input == (call.input[0], -1) and torch.equal(call.input[0], model.soft.lin(model.adds(x)))


def _stats(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """What reduce: stats gives for one call of a tensor (dim 0 the batch), in plain torch."""
    x = t.detach().double()
    mean = x.mean(0)
    std = (((x - mean) ** 2).sum(0) / (x.shape[0] - 1)).sqrt()
    summary = {"mean": mean.float(), "std": std.float(), "min": x.amin(0).float(), "max": x.amax(0).float()}
    return {**summary, "count": torch.tensor(x.shape[0])}


@pytest.mark.parametrize(
    ("what", "keys"),
    [(["input", "output"], ["input.0", "input.1", "input.bias", "output"]),
     (["input"], ["input.0", "input.1", "input.bias"]),
     (["output"], ["output"])],
)  # fmt: skip
def test_reduce_stats_folds_each_call_under_its_keys(what: list[str], keys: list[str]) -> None:
    model, x = Outer(), _x()
    adds = model.adds
    tensors = {"input.0": x, "input.1": adds.weight, "input.bias": adds.bias, "output": _linear(adds, x)}
    recipe = {"p": {"kind": "capture", "select": "adds", "function": "linear", "what": what, "reduce": "stats"}}
    with surgery.apply(model, recipe, verify=True) as s:
        model(x)
        reduced = s.captures["p"]["adds"].reduced
        assert s.captures["p"]["adds"].calls == []
    assert sorted(reduced) == keys
    for key in keys:
        expected = _stats(tensors[key])
        assert list(reduced[key]) == list(expected)
        assert all(torch.equal(reduced[key][k], expected[k]) for k in expected), key


def test_reduce_mean_over_two_forwards() -> None:
    model, x, y = Outer(), _x(), _x(3)
    out = [_linear(model.adds, v).double() for v in (x, y)]
    recipe = {"p": {"kind": "capture", "select": "adds", "function": "linear", "reduce": "mean"}}
    with surgery.apply(model, recipe) as s:
        model(x), model(y)
        reduced = s.captures["p"]["adds"].reduced
    assert list(reduced) == ["output"] and list(reduced["output"]) == ["mean", "count"]
    assert torch.equal(reduced["output"]["mean"], ((out[0].sum(0) + out[1].sum(0)) / 6).float())
    assert torch.equal(reduced["output"]["count"], torch.tensor(6))


def test_to_disk_streams_the_function_calls_and_memory_does_not() -> None:
    model, x = Outer(), _x()
    recipe = {
        "d": {"kind": "capture", "select": "adds", "function": "linear", "to": "disk"},
        "m": {"kind": "capture", "select": "soft", "function": "softmax"},
    }
    with surgery.apply(model, recipe) as s:
        model(x)
        streamed = s.take_streamed()
        assert len(s.captures["m"]["soft"].calls) == 1
    assert list(streamed) == ["d/adds/output"]
    assert torch.equal(streamed["d/adds/output"], _linear(model.adds, x))


def test_plot_marks_the_action_plotted() -> None:
    recipe = {
        "shown": {"kind": "capture", "select": "adds", "function": "linear", "plot": True},
        "hidden": {"kind": "capture", "select": "soft", "function": "softmax"},
    }
    with surgery.apply(Outer(), recipe) as s:
        assert s.plotted == {"shown"}


def test_calls_counts_each_forward_once_and_reset_calls_starts_again() -> None:
    model, xs = Outer(), [_x(s) for s in (2, 3, 4)]
    recipe = {
        "one": {"kind": "capture", "select": "adds", "function": "linear", "calls": [1]},
        "first": {"kind": "capture", "select": "adds", "function": "linear", "calls": [0]},
    }
    with surgery.apply(model, recipe) as s:
        for x in xs:
            model(x)
        s.reset_calls()
        model(xs[2])
        (one,) = s.captures["one"]["adds"].calls
        firsts = s.captures["first"]["adds"].calls
    assert torch.equal(one.output, _linear(model.adds, xs[1]))
    assert [c.output for c in firsts] == [firsts[0].output, firsts[1].output]
    for call, x in zip(firsts, (xs[0], xs[2]), strict=True):
        assert torch.equal(call.output, _linear(model.adds, x))


def test_plan_table_hook_count_and_removal() -> None:
    model = Outer()
    before, hooks = _weights(model), _hooks(model)
    recipe = {"p": {"kind": "capture", "select": "*", "function": "linear"}}
    plan = surgery.plan(model, recipe, example_inputs=(_x(),))
    assert str(plan).splitlines()[2] == "p       capture  torch function mode  2  adds, soft"
    assert plan.to_dict()[0]["mechanism"] == "torch function mode"
    s = surgery.apply(model, plan)
    assert s.hook_count == {"p": 4}
    s.remove()
    assert _hooks(model) == hooks and all(torch.equal(v, before[k]) for k, v in _weights(model).items())


def _fails(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
    raise ValueError("no thanks")


def test_a_failing_replacement_names_action_and_module() -> None:
    model, x = Outer(), _x()
    recipe = {"r": {"kind": "replace_forward", "select": "soft", "function": "softmax", "fn": _fails}}
    with surgery.apply(model, recipe), pytest.raises(ActionError) as info:
        model(x)
    assert str(info.value) == "actions.r on module 'soft': ValueError: no thanks"
    assert torch._C._len_torch_function_stack() == 0


def test_modify_output_on_a_tensor_result_reads_the_module() -> None:
    model, x = Outer(), _x()
    soft = model.soft
    p = torch.softmax(soft.lin(model.adds(x)), -1) * soft.scale
    recipe = {
        "m": {"kind": "modify_output", "select": "soft", "function": "softmax", "op": "expr",
              "expr": "output * module.scale"}
    }  # fmt: skip
    with surgery.apply(model, recipe, verify=True):
        assert torch.equal(model(x), p[:, :2] - p[:, 2:])


def test_replace_forward_expr_reads_module_inputs_and_output() -> None:
    model, x = Outer(), _x()
    adds = model.adds
    expected = model.soft((x * adds.scale + _linear(adds, x)) * 3)
    recipe = {
        "r": {"kind": "replace_forward", "select": "adds", "function": "linear",
              "expr": "inputs[0] * module.scale + output"}
    }  # fmt: skip
    with surgery.apply(model, recipe, verify=True):
        assert torch.equal(model(x), expected)


def _with_kwargs(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] * m.scale - kwargs["bias"] + out


def test_replace_forward_fn_with_kwargs_gets_module_args_result_and_kwargs() -> None:
    model, x = Outer(), _x()
    adds = model.adds
    expected = model.soft((x * adds.scale - adds.bias + _linear(adds, x)) * 3)
    recipe = {"r": {"kind": "replace_forward", "select": "adds", "function": "linear", "fn": _with_kwargs}}
    with surgery.apply(model, recipe, verify=True):
        assert torch.equal(model(x), expected)


def test_the_users_own_forward_hooks_run_outside_the_mode() -> None:
    model, x = Outer(), _x()
    model.soft.register_forward_hook(lambda m, a, out: [torch.softmax(out, -1)] and None)
    recipe = {"p": {"kind": "capture", "select": "soft", "function": "softmax"}}
    with surgery.apply(model, recipe) as s:
        model(x)
        assert len(s.captures["p"]["soft"].calls) == 1


def test_a_function_only_the_users_hook_calls_is_refused() -> None:
    model, x = Outer(), _x()
    model.soft.register_forward_hook(lambda m, a, out: [F.gelu(out)] and None)
    with pytest.raises(ConfigError) as info:
        surgery.plan(model, {"e": {"kind": "capture", "select": "soft", "function": "gelu"}}, example_inputs=(x,))
    assert str(info.value) == (
        "actions.e.function: Softmaxes.forward of 'soft' never calls gelu on the example input (torch.gelu,"
        " torch.nn.functional.gelu or Tensor.gelu); it may use another function (e.g. scaled_dot_product_attention"
        " instead of softmax: attn_implementation='eager')"
    )


class Breaks(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("bad input")


def test_a_probe_forward_that_raises_leaves_no_mode_behind() -> None:
    model = nn.Sequential(Breaks())
    try:
        with pytest.raises(ConfigError, match=r"^input: the model fails on this input before any surgery"):
            surgery.plan(
                model, {"p": {"kind": "capture", "select": "0", "function": "softmax"}}, example_inputs=(_x(),)
            )
        assert torch._C._len_torch_function_stack() == 0
    finally:  # a mode left behind would catch every torch call of the tests after this one
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
