"""What a capture's records hold and say: in-place-change warnings, odd outputs, running statistics, flat keys.

Every expected value is what a hand-written PyTorch hook (or plain torch arithmetic) gives for the same run.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery.core.records import RecordChangedWarning
from surgery.errors import ActionError, SurgeryError
from surgery.integrations.training import record_statistics


def changed(key: str, call: int) -> str:
    """The exact text of the warning for ``key``'s call ``call``, as a regex."""
    return re.escape(
        f"{key}: call {call} was changed in place after it was captured (e.g. by a ReLU(inplace=True) after the"
        " module), so it no longer holds what the module gave; capture with clone: true"
    )


class Shift(nn.Module):
    def forward(self, x: torch.Tensor, *, by: torch.Tensor) -> torch.Tensor:
        return x + by


class Rewrites(nn.Module):
    """``h = lin1(x)`` is read by ``lin2`` (positionally) and ``shift`` (as keyword ``by``), then rectified in place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2, self.shift = nn.Linear(3, 3), nn.Linear(3, 3), Shift()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin1(x)
        o = self.lin2(h)
        p = self.shift(x, by=h)
        h.relu_()
        return o + p + h


def run(model: nn.Module, actions: dict[str, Any], x: torch.Tensor) -> surgery.Surgery:
    with torch.no_grad(), surgery.apply(model, actions) as s:
        model(x)
    return s


def data(rows: int = 4, cols: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def at_users_line(filename: str) -> bool:
    """Whether a warning names this file: the first frame outside the surgery package.

    Under mutation testing mutmut's trampoline sits between surgery's frames and is that first frame.
    """
    return filename == __file__ or filename.endswith(os.path.join("mutmut", "mutation", "trampoline.py"))


def by_hand(model: Rewrites, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lin1's output as it left lin1, the same tensor after the in-place ReLU), from plain forward hooks."""
    seen: list[torch.Tensor] = []
    handles = [model.lin1.register_forward_hook(lambda m, a, o: seen.extend([o.clone(), o]))]
    with torch.no_grad():
        model(x)
    handles[0].remove()
    assert not torch.equal(seen[0], seen[1])  # the ReLU did change something
    return seen[0], seen[1]


@pytest.mark.parametrize(
    ("select", "what", "part"),
    [("lin1", ["input", "output"], "output"), ("lin2", ["input"], "input"), ("shift", ["input"], "kwargs")],
)
def test_a_tensor_changed_in_place_after_capture_warns_once_naming_the_call(select: str, what: list, part: str) -> None:
    model, x = Rewrites(), data()
    before, after = by_hand(model, x)
    s = run(model, {"c": {"kind": "capture", "select": select, "what": what}}, x)
    record = s.captures["c"][select]
    with pytest.warns(RecordChangedWarning, match=changed(f"c/{select}", 0)) as caught:
        calls = record.calls
    assert len(caught) == 1 and at_users_line(caught[0].filename)  # the warning names the line that read the record
    got = {
        "output": calls[0].output,
        "input": calls[0].input and calls[0].input[0],
        "kwargs": (calls[0].kwargs or {}).get("by"),
    }
    assert torch.equal(got[part], after) and not torch.equal(got[part], before)  # what a plain hook holds too
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per call: a second read is quiet
        assert len(record.calls) == 1
    assert record.calls[0].stamps is None  # forgotten once warned of


def test_reading_the_last_call_warns_at_the_users_line() -> None:
    model, x = Rewrites(), data()
    s = run(model, {"c": {"kind": "capture", "select": "lin1", "what": ["input", "output"]}}, x)
    with pytest.warns(RecordChangedWarning, match=changed("c/lin1", 0)) as caught:
        assert s.captures["c"]["lin1"].output is not None
    assert len(caught) == 1 and at_users_line(caught[0].filename)


def test_untouched_inputs_and_clones_do_not_warn() -> None:
    model, x = Rewrites(), data()
    before, _ = by_hand(model, x)
    actions = {
        "x": {"kind": "capture", "select": "lin1", "what": ["input"]},  # x itself is never written
        "c": {"kind": "capture", "select": "lin1", "what": ["input", "output"], "clone": True},
    }
    s = run(model, actions, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(s.captures["x"]["lin1"].input[0], x)
        assert torch.equal(s.captures["c"]["lin1"].output, before)


class TwiceThenRectified(nn.Module):
    """``lin`` runs twice; only the second call's output is rectified in place."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x).clone()).relu_()


def test_only_the_changed_call_warns_with_its_index() -> None:
    model, x = TwiceThenRectified(), data()
    s = run(model, {"c": {"kind": "capture", "select": "lin", "what": ["input", "output"]}}, x)
    with pytest.warns(RecordChangedWarning) as caught:
        calls = s.captures["c"]["lin"].calls
    assert [str(w.message) for w in caught] == [changed("c/lin", 1).replace("\\", "")]
    assert len(calls) == 2


class Containers(nn.Module):
    """``pair`` returns a tuple, ``listed`` a list, ``named`` a dict; ``named`` also takes a keyword tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.pair, self.listed, self.named = Pair(), Listed(), Named()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.pair(x)
        c, d = self.listed(a)
        out = self.named(c, by=d)
        return out["sum"] + out["diff"] + b


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x * 2


class Listed(nn.Module):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x - 3, x / 4]


class Named(nn.Module):
    def forward(self, x: torch.Tensor, *, by: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": x + by, "diff": x - by}


def plain_calls(model: nn.Module, names: list[str], x: torch.Tensor) -> dict[str, tuple]:
    """(args, kwargs, output) of each named module's one call, seen by a plain forward hook."""
    seen: dict[str, tuple] = {}
    handles = [
        getattr(model, n).register_forward_hook(lambda m, a, k, o, n=n: seen.update({n: (a, k, o)}), with_kwargs=True)
        for n in names
    ]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return seen


def test_tuple_and_list_outputs_are_kept_whole() -> None:
    model, x = Containers(), data()
    plain = plain_calls(model, ["pair", "listed"], x)
    s = run(model, {"c": {"kind": "capture", "select": ["pair", "listed"]}}, x)
    pair, listed = s.captures["c"]["pair"].output, s.captures["c"]["listed"].output
    assert type(pair) is tuple and len(pair) == 2 and all(map(torch.equal, pair, plain["pair"][2]))
    assert type(listed) is list and len(listed) == 2 and all(map(torch.equal, listed, plain["listed"][2]))


def test_disk_captures_flatten_tuples_keywords_and_dicts_to_their_keys() -> None:
    model, x = Containers(), data()
    plain = plain_calls(model, ["pair", "named"], x)
    actions = {"c": {"kind": "capture", "select": ["pair", "named"], "what": ["input", "output"], "to": "disk"}}
    with torch.no_grad(), surgery.apply(model, actions) as s:
        model(x)
        flat = s.take_streamed()
    (pair_in,), _, pair_out = plain["pair"]
    (named_in,), named_kw, named_out = plain["named"]
    want = {
        "c/pair/input.0": pair_in,
        "c/pair/output.0": pair_out[0],
        "c/pair/output.1": pair_out[1],
        "c/named/input.0": named_in,
        "c/named/input.by": named_kw["by"],
        "c/named/output.sum": named_out["sum"],
        "c/named/output.diff": named_out["diff"],
    }
    assert set(flat) == set(want)
    assert all(torch.equal(flat[k], v) for k, v in want.items())


def test_reading_a_record_no_call_reached_names_it() -> None:
    model = Rewrites()
    with surgery.apply(model, {"c": {"kind": "capture", "select": "lin2"}}) as s:
        with pytest.raises(
            SurgeryError, match=re.escape("c/lin2: no call was recorded (did the model run through it?)")
        ):
            assert s.captures["c"]["lin2"].output is None


class Total(nn.Module):
    """A scalar (0-d) output, like a loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


@pytest.mark.parametrize("reduce", ["mean", "stats"])
def test_reduce_counts_a_scalar_output_as_one_row_per_call(reduce: str) -> None:
    model = nn.Sequential(Total())
    xs = [data(seed=s) for s in (1, 2, 3)]
    with torch.no_grad(), surgery.apply(model, {"c": {"kind": "capture", "select": "0", "reduce": reduce}}) as s:
        for x in xs:
            model(x)
    got = s.captures["c"]["0"].reduced["output"]
    rows = torch.stack([x.sum() for x in xs]).double()
    assert got["count"].item() == 3
    torch.testing.assert_close(got["mean"], rows.mean().float(), rtol=0, atol=1e-6)
    if reduce == "stats":
        torch.testing.assert_close(got["std"], rows.std().float(), rtol=1e-6, atol=0)
        assert torch.equal(got["min"], rows.min().float())
        assert torch.equal(got["max"], rows.max().float())


def test_stats_over_two_rows_divide_by_one() -> None:
    model, x = nn.Sequential(nn.Identity()), data(rows=2)
    with torch.no_grad(), surgery.apply(model, {"c": {"kind": "capture", "select": "0", "reduce": "stats"}}) as s:
        model(x)
    got = s.captures["c"]["0"].reduced["output"]
    assert got["count"].item() == 2
    torch.testing.assert_close(got["std"], x.double().std(0).float(), rtol=1e-6, atol=0)  # unbiased: / (2 - 1)


@pytest.mark.parametrize("reduce", ["mean", "stats"])
def test_reduce_refuses_a_call_of_another_shape(reduce: str) -> None:
    model = nn.Sequential(nn.Identity())
    with torch.no_grad(), surgery.apply(model, {"c": {"kind": "capture", "select": "0", "reduce": reduce}}):
        model(data(cols=3))
        message = "actions.c on module '0': reduce needs the same shape on every call: [3] then [5]"
        with pytest.raises(ActionError, match=re.escape(message) + "$"):
            model(data(cols=5))


def chan_call_by_call(calls: list[torch.Tensor]) -> dict[str, Any]:
    """Each call folded in as it comes (Chan et al.), in plain torch: what ``Running`` gave before it waited."""
    count, mean, m2, low, high = 0, None, None, None, None
    for call in calls:
        x = call.detach().double()
        x = x.unsqueeze(0) if x.dim() == 0 else x
        n, m = x.shape[0], x.mean(0)
        d = x - m
        s2, (lo, hi) = d.mul_(d).sum(0), torch.aminmax(x, dim=0)
        if mean is None:
            count, mean, m2, low, high = n, m, s2, lo, hi
            continue
        total, delta = count + n, m - mean
        mean, m2 = mean + delta * (n / total), m2 + s2 + delta**2 * (count * n / total)
        low, high, count = torch.minimum(low, lo), torch.maximum(high, hi), total
    return {"count": count, "mean": mean, "m2": m2, "min": low, "max": high}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, NaN payloads and the sign of zero included."""
    return t.contiguous().view(torch.int64 if t.dtype == torch.float64 else torch.int32)


@pytest.mark.parametrize("pending", [0, 1 << 10, 1 << 20])  # fold at every call, every few calls, when read
def test_stats_folded_late_or_several_at_once_have_the_bits_of_each_call_folded(pending: int, monkeypatch: Any) -> None:
    from surgery.core.running import Running

    monkeypatch.setattr(Running, "HELD_BYTES", pending)
    g = torch.Generator().manual_seed(3)
    kinds = (((32, 64), torch.float32), ((4, 2, 5), torch.float16), ((), torch.float64), ((7,), torch.bfloat16))
    for shape, dtype in kinds:
        calls = [(torch.randn((8, *shape), generator=g) * 10**i).to(dtype) for i in range(-3, 3)]
        calls += [calls[0][:3], calls[1]]  # a smaller batch between two full ones
        calls[2].view(-1)[:2] = torch.tensor([0.0, float("nan")]).to(dtype)
        calls[3].view(-1)[:1] = -0.0
        running, seen = Running(stats=True), []
        for i, call in enumerate(calls):
            running.add(call)
            seen.append(call)
            if i in (2, 4, len(calls) - 1):  # read in the middle too (at 2 only the moments, as a training log does)
                want, (mean, m2) = chan_call_by_call(seen), running.moments()
                assert running.count == want["count"]
                assert torch.equal(bits(mean), bits(want["mean"])) and torch.equal(bits(m2), bits(want["m2"]))
                if i != 2:
                    summary = running.summary()
                    assert torch.equal(bits(summary["min"]), bits(want["min"].float()))
                    assert torch.equal(bits(summary["max"]), bits(want["max"].float()))


def test_a_call_folded_late_keeps_what_it_was_when_the_model_wrote_it_afterwards() -> None:
    from surgery.core.running import Running

    running, x = Running(stats=True), data(rows=2, cols=3).double()
    running.add(x)
    kept = x.clone()
    x.mul_(100)  # e.g. a ReLU(inplace=True) after the module: the copy, not the model's tensor, waits to be folded
    mean, _ = running.moments()
    assert torch.equal(mean, kept.mean(0))


def test_training_statistics_of_a_mean_capture_pool_every_row_and_element() -> None:
    model = nn.Sequential(nn.Identity())
    xs = [0.01 * data(seed=s) + 0.5 for s in (1, 2)]  # small spread: each element's M2 is well below 1
    with torch.no_grad(), surgery.apply(model, {"c": {"kind": "capture", "select": "0", "reduce": "mean"}}) as s:
        for x in xs:
            model(x)
        got = record_statistics(s.captures["c"]["0"])["output"]
    every = torch.cat(xs).double()
    assert got["mean"] == pytest.approx(every.mean().item(), rel=1e-12)
    assert got["std"] == pytest.approx(every.std(correction=0).item(), rel=1e-9)
    assert got["norm"] == pytest.approx(every.pow(2).sum(1).mean().sqrt().item(), rel=1e-12)


@pytest.mark.parametrize("shape", [(8, 5), (8,), (8, 2, 3)])
def test_training_statistics_of_a_stats_capture_have_the_bits_of_the_formula_in_torch(shape: tuple[int, ...]) -> None:
    model = nn.Sequential(nn.Identity())
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(shape, generator=g) * 3 + i for i in range(4)]
    with torch.no_grad(), surgery.apply(model, {"c": {"kind": "capture", "select": "0", "reduce": "stats"}}) as s:
        for x in xs:
            model(x)
        got = record_statistics(s.captures["c"]["0"])["output"]
    want = chan_call_by_call(xs)
    mean, m2, rows = want["mean"], want["m2"], want["count"]
    overall = mean.mean()
    total_m2 = m2.sum() + rows * ((mean - overall) ** 2).sum()
    square_norm = (m2 / rows + mean**2).sum()
    assert got == {
        "mean": overall.item(),
        "std": math.sqrt(max(total_m2.item(), 0.0) / (rows * mean.numel())),
        "norm": math.sqrt(max(square_norm.item(), 0.0)),
    }


class Tagged(torch.Tensor):
    """A tensor subclass: numpy cannot take it, so its calls fold with tensor operations, as on a GPU."""


def test_stats_folded_with_tensor_operations_have_the_bits_of_each_call_folded() -> None:
    from surgery.core.running import Running

    g = torch.Generator().manual_seed(6)
    calls = [(torch.randn(8, 16, generator=g) * 10**i).as_subclass(Tagged) for i in range(-2, 3)]
    running = Running(stats=True)
    for call in calls:
        running.add(call)
    (mean, m2), summary = running.moments(), running.summary()
    want = chan_call_by_call([c.as_subclass(torch.Tensor) for c in calls])
    assert type(mean) is Tagged and running.count == want["count"]
    assert torch.equal(bits(mean.as_subclass(torch.Tensor)), bits(want["mean"]))
    assert torch.equal(bits(m2.as_subclass(torch.Tensor)), bits(want["m2"]))
    assert torch.equal(bits(summary["min"].as_subclass(torch.Tensor)), bits(want["min"].float()))
    assert torch.equal(bits(summary["max"].as_subclass(torch.Tensor)), bits(want["max"].float()))


@pytest.mark.cuda
def test_stats_folded_on_a_gpu_have_the_bits_of_each_call_folded_there() -> None:
    from surgery.core.running import Running

    g = torch.Generator().manual_seed(4)
    calls = [torch.randn(8, 16, generator=g) * 10**i for i in range(-2, 3)]
    gpu = [c.to(torch.device("cuda")) for c in calls]
    running = Running(stats=True)
    for call in gpu:
        running.add(call)
    mean, m2 = running.moments()
    summary, want = running.summary(), chan_call_by_call(gpu)
    assert mean.device.type == "cuda" and running.count == want["count"]
    assert torch.equal(mean, want["mean"]) and torch.equal(m2, want["m2"])  # the same operations on the same device
    assert torch.equal(summary["min"], want["min"].float()) and torch.equal(summary["max"], want["max"].float())
    on_cpu = chan_call_by_call(calls)
    torch.testing.assert_close(mean.cpu(), on_cpu["mean"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m2.cpu(), on_cpu["m2"], rtol=1e-10, atol=1e-10)
