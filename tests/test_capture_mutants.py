"""capture and log (surgery/actions/capture.py), each user-visible detail against plain PyTorch: records, plan text,
error messages, the lines ``log`` prints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError
from tests.test_capture_calls import Twice


class Chain(nn.Module):
    """``b(a(x))``: two Linears, each called once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1


class Holder(nn.Module):
    """Wraps one submodule ``m`` and returns the first element of what it gives (or its whole result)."""

    def __init__(self, m: nn.Module, first: bool = False) -> None:
        super().__init__()
        self.m, self.first = m, first

    def forward(self, *args: Any) -> Any:
        out = self.m(*args)
        return out[0] if self.first else out


def data(seed: int = 1) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))


def by_hand(model: Twice, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first call's output, second call's input, second call's output)."""
    with torch.no_grad():
        h1 = F.linear(x, model.lin.weight, model.lin.bias)
        t = torch.tanh(h1)
        return h1, t, F.linear(t, model.lin.weight, model.lin.bias)


def running_mean(*tensors: torch.Tensor) -> torch.Tensor:
    """What ``reduce: mean`` keeps, by hand: float64 sums over rows, divided by the row count, as float32."""
    total = sum(t.detach().double().sum(0) for t in tensors)
    return (total / sum(t.shape[0] for t in tensors)).float()  # type: ignore[union-attr]


# ---- the plan


def test_the_plan_table_names_the_forward_hook_of_capture_and_log() -> None:
    model = Chain()
    plan = surgery.plan(model, {"c": {"kind": "capture", "select": "a"}, "l": {"kind": "log", "select": "*"}})
    assert str(plan).splitlines() == [
        "action  kind     mechanism     n  matched",
        "-----------------------------------------",
        "c       capture  forward hook  1  a",
        "l       log      forward hook  2  a, b",
    ]
    assert [(d["mechanism"], d["matched"]) for d in plan.to_dict()] == [
        ("forward hook", ["a"]),
        ("forward hook", ["a", "b"]),
    ]


def test_only_to_disk_captures_stream() -> None:
    model = Chain()
    recipe = {"d": {"kind": "capture", "select": "a", "to": "disk"}, "m": {"kind": "capture", "select": "b"}}
    plan = surgery.plan(model, recipe)
    assert [(s.name, s.streams) for s in plan.steps] == [("d", True), ("m", False)]


def test_a_malformed_index_names_its_key() -> None:
    with pytest.raises(ConfigError) as e:
        surgery.plan(Chain(), {"c": {"kind": "capture", "select": "a", "index": "[:, 9"}})
    assert str(e.value) == "actions.c.index: an index must be written in brackets, like '[:, 3:5]'; got '[:, 9'"


def test_an_input_index_is_checked_against_the_input_with_example_inputs() -> None:
    model, x = Chain(), data()
    surgery.plan(
        model, {"c": {"kind": "capture", "select": "a", "what": ["input"], "index": "[:, 2]"}}, example_inputs=(x,)
    )
    recipe = {"c": {"kind": "capture", "select": "a", "what": ["input"], "index": "[:, 3]"}}
    with pytest.raises(ConfigError) as e:
        surgery.plan(model, recipe, example_inputs=(x,))
    assert str(e.value) == (
        "actions.c.index: [:, 3] does not fit the input of 'a', shape [4, 3]:"
        " index 3 is out of bounds for dimension 1 with size 3"
    )


def test_a_tuple_output_captured_whole_passes_the_example_input_probe() -> None:
    model, x = Holder(Pair(), first=True), data()
    plan = surgery.plan(model, {"c": {"kind": "capture", "select": "m"}}, example_inputs=(x,))
    with surgery.apply(model, plan) as s:
        model(x)
    out = s.captures["c"]["m"].output
    assert isinstance(out, tuple) and torch.equal(out[0], x * 2) and torch.equal(out[1], x + 1)


# ---- what apply registers


def test_hooks_are_counted_per_action_and_reduce_hooks_every_selected_module() -> None:
    model, x = Chain(), data()
    recipe = {
        "r": {"kind": "capture", "select": "*", "reduce": "mean"},
        "c": {"kind": "capture", "select": "b", "plot": True},
        "l": {"kind": "log", "select": "a"},
    }
    with surgery.apply(model, recipe) as s:
        assert s.hook_count == {"r": 2, "c": 1, "l": 1}
        assert s.plotted == {"c"}
        with torch.no_grad():
            h = F.linear(x, model.a.weight, model.a.bias)
            y = F.linear(h, model.b.weight, model.b.bias)
        model(x)
    assert torch.equal(s.captures["r"]["a"].reduced["output"]["mean"], running_mean(h))
    assert torch.equal(s.captures["r"]["b"].reduced["output"]["mean"], running_mean(y))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("kind", ["capture", "log"])
def test_a_module_that_takes_no_hooks_is_named_and_nothing_stays(kind: str) -> None:
    model = Chain()
    model.b = torch.jit.script(nn.Linear(3, 3))  # a ScriptModule refuses register_forward_hook
    with pytest.raises(ActionError) as e:
        surgery.apply(model, {"c": {"kind": kind, "select": "*"}})
    assert str(e.value) == (
        "actions.c: failed on 'b': RuntimeError: register_forward_hook is not supported on ScriptModules."
        " Nothing was changed."
    )
    assert not model.a._forward_hooks


# ---- reduce


def test_reduce_takes_only_the_calls_asked_for() -> None:
    model, x = Twice(), data()
    _, _, h2 = by_hand(model, x)
    with surgery.apply(model, {"c": {"kind": "capture", "select": "lin", "reduce": "mean", "calls": "1:"}}) as s:
        model(x)
    reduced = s.captures["c"]["lin"].reduced
    assert list(reduced) == ["output"]
    assert torch.equal(reduced["output"]["mean"], running_mean(h2)) and int(reduced["output"]["count"]) == 4


def test_reduce_of_input_and_output_skips_an_output_that_is_not_a_tensor() -> None:
    class Sink(nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            return None

    model, x = Holder(Sink()), data()
    with surgery.apply(
        model, {"c": {"kind": "capture", "select": "m", "reduce": "mean", "what": ["input", "output"]}}
    ) as s:
        model(x)
    reduced = s.captures["c"]["m"].reduced
    assert list(reduced) == ["input.0"] and torch.equal(reduced["input.0"]["mean"], running_mean(x))


def test_reduce_names_the_action_and_module_when_shapes_change_between_calls() -> None:
    model = Holder(nn.Identity())
    with surgery.apply(model, {"c": {"kind": "capture", "select": "m", "reduce": "mean"}}):
        model(torch.ones(2, 3))
        with pytest.raises(ActionError) as e:
            model(torch.ones(2, 2))
    assert str(e.value) == "actions.c on module 'm': reduce needs the same shape on every call: [3] then [2]"


def test_reduce_of_a_function_inside_the_forward() -> None:
    class Scores(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x, -1) * 2

    model, x = Holder(Scores()), data()
    recipe = {
        "c": {"kind": "capture", "select": "m", "function": "softmax", "reduce": "mean", "what": ["input", "output"]}
    }
    with surgery.apply(model, recipe) as s:
        model(x)
    reduced = s.captures["c"]["m"].reduced
    assert sorted(reduced) == ["input.0", "output"]  # the dim -1 is no tensor
    assert torch.equal(reduced["input.0"]["mean"], running_mean(x))
    assert torch.equal(reduced["output"]["mean"], running_mean(torch.softmax(x, -1)))


# ---- fn


def project(m: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """Reads the module and its inputs: ``output - x W^T``, i.e. the bias broadcast (plus rounding)."""
    return output - F.linear(args[0], m.weight)


def test_fn_sees_the_module_and_its_inputs_and_records_detached() -> None:
    model, x = Twice(), data()
    h1, t, h2 = by_hand(model, x)
    with surgery.apply(model, {"c": {"kind": "capture", "select": "lin", "fn": project}}) as s:
        model(x)
    calls = s.captures["c"]["lin"].calls
    with torch.no_grad():
        want = [h1 - F.linear(x, model.lin.weight), h2 - F.linear(t, model.lin.weight)]
    assert len(calls) == 2 and all(torch.equal(c.output, w) for c, w in zip(calls, want))
    assert not any(c.output.requires_grad for c in calls)


def test_fn_with_detach_false_keeps_the_graph() -> None:
    model, x = Twice(), data()
    with surgery.apply(model, {"c": {"kind": "capture", "select": "lin", "fn": project, "detach": False}}) as s:
        model(x)
    out = s.captures["c"]["lin"].output
    assert out.requires_grad and out.grad_fn is not None


def test_fn_with_keep_last_holds_only_the_last_call() -> None:
    model, x = Twice(), data()
    _, t, h2 = by_hand(model, x)
    with surgery.apply(model, {"c": {"kind": "capture", "select": "lin", "fn": project, "keep": "last"}}) as s:
        model(x)
    calls = s.captures["c"]["lin"].calls
    with torch.no_grad():
        assert len(calls) == 1 and torch.equal(calls[0].output, h2 - F.linear(t, model.lin.weight))


def test_fn_takes_only_the_calls_asked_for() -> None:
    model, x = Twice(), data()
    h1, _, _ = by_hand(model, x)
    with surgery.apply(model, {"c": {"kind": "capture", "select": "lin", "fn": project, "calls": [0]}}) as s:
        model(x)
    calls = s.captures["c"]["lin"].calls
    with torch.no_grad():
        assert len(calls) == 1 and torch.equal(calls[0].output, h1 - F.linear(x, model.lin.weight))


def test_a_failing_fn_names_the_action_and_module() -> None:
    def boom(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        raise ValueError("no lens here")

    model = Twice()
    with surgery.apply(model, {"c": {"kind": "capture", "select": "lin", "fn": boom}}):
        with pytest.raises(ActionError) as e:
            model(data())
    assert str(e.value) == "actions.c on module 'lin': ValueError: no lens here"


# ---- item, index, stop


def test_item_of_an_output_keeps_that_element() -> None:
    model, x = Holder(Pair(), first=True), data()
    with surgery.apply(model, {"c": {"kind": "capture", "select": "m", "item": 1}}) as s:
        model(x)
    assert torch.equal(s.captures["c"]["m"].output, x + 1)


def test_index_of_an_output_keeps_that_slice() -> None:
    model, x = Chain(), data()
    with surgery.apply(model, {"c": {"kind": "capture", "select": "a", "index": "[:, -1]"}}) as s:
        model(x)
    with torch.no_grad():
        want = F.linear(x, model.a.weight, model.a.bias)[:, -1]
    assert torch.equal(s.captures["c"]["a"].output, want)


def test_stop_follows_calls() -> None:
    model, x = Twice(), data()
    _, _, h2 = by_hand(model, x)
    with surgery.apply(model, {"c": {"kind": "capture", "select": "lin", "stop": True, "calls": [1]}}) as s:
        assert model(x) is None
    calls = s.captures["c"]["lin"].calls
    assert len(calls) == 1 and torch.equal(calls[0].output, h2)


# ---- log


def stats(t: torch.Tensor) -> str:
    """The stats part of a log line, by hand."""
    v = t.detach().float()
    std = v.std().item() if v.numel() > 1 else 0.0
    return f" mean={v.mean().item():.4g} std={std:.4g} min={v.min().item():.4g} max={v.max().item():.4g}"


def logged(model: nn.Module, args: tuple[Any, ...], capsys: pytest.CaptureFixture[str], **cfg: Any) -> list[str]:
    with surgery.apply(model, {"l": {"kind": "log", "select": "m", **cfg}}):
        with torch.no_grad():
            model(*args)
    return capsys.readouterr().out.splitlines()


def test_log_prints_shapes_and_stats_of_tensors_one_and_two_elements(capsys: pytest.CaptureFixture[str]) -> None:
    one, two = torch.tensor([[0.5]]), torch.tensor([[1.0, 4.0]])
    lines = logged(Holder(nn.Identity()), (one,), capsys) + logged(Holder(nn.Identity()), (two,), capsys)
    assert lines == [
        f"[l] m (Identity): in ((1, 1){stats(one)}) -> out (1, 1){stats(one)}",
        f"[l] m (Identity): in ((1, 2){stats(two)}) -> out (1, 2){stats(two)}",
    ]
    assert "std=0 " in lines[0] and "std=2.121 " in lines[1]


def test_log_without_stats_and_of_integer_inputs_prints_shapes_only(capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    emb, ids, x = nn.Embedding(5, 2), torch.tensor([[1, 3, 4]]), data()
    out = emb(ids)
    assert logged(Holder(emb), (ids,), capsys) == [f"[l] m (Embedding): in ((1, 3)) -> out (1, 3, 2){stats(out)}"]
    assert logged(Holder(nn.Identity()), (x,), capsys, stats=False) == ["[l] m (Identity): in ((4, 3)) -> out (4, 3)"]


def test_log_of_containers_and_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    class Mixed(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
            return {"sum": x + y, "n": 3}

    x, y = data(1), data(2)
    assert logged(Holder(Mixed()), (x, y), capsys) == [
        f"[l] m (Mixed): in ((4, 3){stats(x)}, (4, 3){stats(y)}) -> out {{sum: (4, 3){stats(x + y)}, n: int}}"
    ]


def test_log_takes_only_the_calls_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    with surgery.apply(Twice(), {"l": {"kind": "log", "select": "lin", "calls": [1], "stats": False}}) as s:
        s.model(data())
    assert capsys.readouterr().out.splitlines() == ["[l] lin (Linear): in ((4, 3)) -> out (4, 3)"]


def test_a_failing_log_names_the_action_and_module() -> None:
    class Meta(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(2, 3, device="meta")

    model = Holder(Meta())
    with surgery.apply(model, {"l": {"kind": "log", "select": "m"}}):
        with pytest.raises(ActionError) as e:
            model(data())
    with pytest.raises(RuntimeError) as plain:  # the same stats in plain PyTorch
        torch.zeros(2, 3, device="meta").float().mean().item()
    assert str(e.value) == f"actions.l on module 'm': RuntimeError: {plain.value}"
    assert str(plain.value) == "Tensor.item() cannot be called on meta tensors"
