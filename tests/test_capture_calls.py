"""Every capture path keeps every call of a module that runs twice in one forward, each call's own tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import surgery


class Twice(nn.Module):
    """The same Linear called twice: ``lin(tanh(lin(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class Shift(nn.Module):
    def forward(self, x: torch.Tensor, *, by: torch.Tensor) -> torch.Tensor:
        return x + by


class TwiceByKeyword(nn.Module):
    """One module called twice with a keyword tensor: ``shift(shift(x, by=b1), by=b2)``."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = Shift()
        self.register_buffer("b1", torch.tensor([[1.0, 2.0, 3.0]]))
        self.register_buffer("b2", torch.tensor([[-0.5, 0.25, 4.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shift(self.shift(x, by=self.b1), by=self.b2)


def data(seed: int = 1) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))


def by_hand(model: Twice, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first call's output, second call's input, second call's output), computed as the model does."""
    with torch.no_grad():
        h1 = F.linear(x, model.lin.weight, model.lin.bias)
        t = torch.tanh(h1)
        return h1, t, F.linear(t, model.lin.weight, model.lin.bias)


def capture(what: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    action: dict[str, Any] = {"kind": "capture", "select": "lin", **extra}
    if what is not None:
        action["what"] = what
    return {"c": action}


def test_default_output_capture_keeps_both_calls() -> None:
    model, x = Twice(), data()
    h1, _, h2 = by_hand(model, x)
    with surgery.apply(model, capture()) as s:
        model(x)
    record = s.captures["c"]["lin"]
    assert len(record.calls) == 2
    assert torch.equal(record.calls[0].output, h1) and torch.equal(record.calls[1].output, h2)
    assert record.calls[0].input is None and record.calls[0].kwargs is None
    assert torch.equal(record.output, h2)  # the attribute reads the last call


def test_default_output_capture_keeps_calls_across_forwards_and_reads() -> None:
    model, x, y = Twice(), data(1), data(2)
    with surgery.apply(model, capture()) as s:
        model(x)
        assert len(s.captures["c"]["lin"].calls) == 2  # reading in between must not lose or repeat calls
        model(y)
    calls = s.captures["c"]["lin"].calls
    expected = [by_hand(model, x)[0], by_hand(model, x)[2], by_hand(model, y)[0], by_hand(model, y)[2]]
    assert len(calls) == 4
    for call, want in zip(calls, expected, strict=True):
        assert torch.equal(call.output, want)


def test_input_capture_keeps_both_calls_inputs_only() -> None:
    model, x = Twice(), data()
    _, t, _ = by_hand(model, x)
    with surgery.apply(model, capture(["input"])) as s:
        model(x)
    calls = s.captures["c"]["lin"].calls
    assert len(calls) == 2
    assert len(calls[0].input) == 1 and torch.equal(calls[0].input[0], x)
    assert len(calls[1].input) == 1 and torch.equal(calls[1].input[0], t)
    assert calls[0].output is None and calls[1].output is None
    assert calls[0].kwargs is None


def test_input_and_output_capture_keeps_both_calls() -> None:
    model, x = Twice(), data()
    h1, t, h2 = by_hand(model, x)
    with surgery.apply(model, capture(["input", "output"])) as s:
        model(x)
    calls = s.captures["c"]["lin"].calls
    assert len(calls) == 2
    assert torch.equal(calls[0].input[0], x) and torch.equal(calls[0].output, h1)
    assert torch.equal(calls[1].input[0], t) and torch.equal(calls[1].output, h2)


def test_keyword_inputs_are_kept_per_call() -> None:
    model, x = TwiceByKeyword(), data()
    with surgery.apply(model, {"c": {"kind": "capture", "select": "shift", "what": ["input", "output"]}}) as s:
        model(x)
    calls = s.captures["c"]["shift"].calls
    assert len(calls) == 2
    first, second = x + model.b1, x + model.b1 + model.b2
    assert torch.equal(calls[0].input[0], x) and torch.equal(calls[0].kwargs["by"], model.b1)
    assert torch.equal(calls[1].input[0], first) and torch.equal(calls[1].kwargs["by"], model.b2)
    assert torch.equal(calls[0].output, first) and torch.equal(calls[1].output, second)
    assert set(calls[0].kwargs) == {"by"}


@pytest.mark.parametrize("reduce", ["mean", "stats"])
def test_reduce_folds_both_calls_of_every_captured_tensor(reduce: str) -> None:
    model, x = Twice(), data()
    h1, t, h2 = by_hand(model, x)
    with surgery.apply(model, capture(["input", "output"], reduce=reduce)) as s:
        model(x)
    record = s.captures["c"]["lin"]
    assert record.calls == []
    got = record.reduced
    assert set(got) == {"input.0", "output"}
    for what, calls in (("input.0", [x, t]), ("output", [h1, h2])):
        every = torch.cat(calls).double()
        assert got[what]["count"].item() == 8  # 2 calls x batch 4
        torch.testing.assert_close(got[what]["mean"], every.mean(0).float(), rtol=0, atol=1e-7)
        if reduce == "stats":
            torch.testing.assert_close(got[what]["std"], every.std(0).float(), rtol=0, atol=1e-7)
            assert torch.equal(got[what]["min"], every.amin(0).float())
            assert torch.equal(got[what]["max"], every.amax(0).float())
        else:
            assert set(got[what]) == {"mean", "count"}


@pytest.mark.parametrize("stats", [False, True])
def test_running_moments_are_the_mean_and_m2_of_every_row(stats: bool) -> None:
    from surgery.core.running import Running

    running, rows = (
        Running(stats=stats),
        [torch.randn(3, 5, generator=torch.Generator().manual_seed(i)) for i in range(4)],
    )
    for batch in rows:
        running.add(batch)
    every = torch.cat(rows).double()
    mean, m2 = running.moments()
    assert running.count == 12
    torch.testing.assert_close(mean, every.mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(m2, ((every - every.mean(0)) ** 2).sum(0), rtol=0, atol=1e-10)


def test_reduce_of_keyword_inputs_folds_both_calls() -> None:
    model, x = TwiceByKeyword(), data()
    with surgery.apply(model, {"c": {"kind": "capture", "select": "shift", "what": ["input"], "reduce": "mean"}}) as s:
        model(x)
    got = s.captures["c"]["shift"].reduced
    assert set(got) == {"input.0", "input.by"}
    assert got["input.by"]["count"].item() == 2  # a [1, 3] keyword tensor: one row per call
    assert torch.equal(got["input.by"]["mean"], ((model.b1.double() + model.b2.double()) / 2).squeeze(0).float())
    assert got["input.0"]["count"].item() == 8
    every = torch.cat([x, x + model.b1]).double()
    torch.testing.assert_close(got["input.0"]["mean"], every.mean(0).float(), rtol=0, atol=1e-7)


def test_disk_capture_streams_both_calls_and_forgets_them() -> None:
    model, x, y = Twice(), data(1), data(2)
    with surgery.apply(model, capture(to="disk")) as s:
        model(x)
        first = s.take_streamed()
        model(y)
        second = s.take_streamed()
        assert s.take_streamed() == {}
    hx, hy = by_hand(model, x), by_hand(model, y)
    assert set(first) == {"c/lin/output/0", "c/lin/output/1"}
    assert torch.equal(first["c/lin/output/0"], hx[0]) and torch.equal(first["c/lin/output/1"], hx[2])
    assert set(second) == set(first)
    assert torch.equal(second["c/lin/output/0"], hy[0]) and torch.equal(second["c/lin/output/1"], hy[2])


def plain_grads(model: Twice, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every gradient a backward hook on ``lin`` sees, from the same forward written out in plain torch."""
    x = x.clone().requires_grad_(True)
    h1 = F.linear(x, model.lin.weight, model.lin.bias)
    t = torch.tanh(h1)
    h2 = F.linear(t, model.lin.weight, model.lin.bias)
    for v in (h1, t, h2):
        v.retain_grad()
    (h2 * torch.arange(3.0)).sum().backward()
    grads = {"x": x.grad, "h1": h1.grad, "t": t.grad, "h2": h2.grad, "weight": model.lin.weight.grad}
    model.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in grads.items()}  # type: ignore[union-attr]


def test_capture_grad_keeps_both_calls_backward_in_reverse_order() -> None:
    model, x = Twice(), data()
    want = plain_grads(model, x)
    with surgery.apply(model, {"g": {"kind": "capture_grad", "select": "lin"}}) as s:
        xg = x.clone().requires_grad_(True)
        (model(xg) * torch.arange(3.0)).sum().backward()
    calls = s.captures["g"]["lin"].calls
    assert len(calls) == 2
    # backward runs the second call first
    assert torch.equal(calls[0].grad_output[0], want["h2"]) and torch.equal(calls[0].grad_input[0], want["t"])
    assert torch.equal(calls[1].grad_output[0], want["h1"]) and torch.equal(calls[1].grad_input[0], want["x"])
    assert torch.equal(s.captures["g"]["lin"].grad_input[0], want["x"])


def test_capture_grad_of_a_parameter_used_twice_records_its_whole_gradient_per_backward() -> None:
    model, x, y = Twice(), data(1), data(2)
    want_x, want_y = plain_grads(model, x)["weight"], plain_grads(model, y)["weight"]
    with surgery.apply(model, {"g": {"kind": "capture_grad", "select": "lin", "param": "weight"}}) as s:
        for batch in (x, y):
            (model(batch) * torch.arange(3.0)).sum().backward()
            model.zero_grad(set_to_none=True)
    calls = s.captures["g"]["lin.weight"].calls
    assert [c.grad is not None for c in calls] == [True, True]  # one call per backward: both uses summed
    assert torch.equal(calls[0].grad, want_x) and torch.equal(calls[1].grad, want_y)
