"""Capture records of outputs that are not bare tensors (SPEC §3 capture, ``clone``/``detach``/``index``):
namedtuples, ``torch.return_types`` and dict subclasses keep their type, and ``clone: true`` copies every
tensor inside them; an ``index`` on a whole tuple is refused naming ``index`` and ``item``."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError

Pair = namedtuple("Pair", ["low", "high"])
X = torch.randn(2, 3)


class Output(OrderedDict):
    """A dict subclass with attribute access, like Hugging Face's ModelOutput."""

    def __getattr__(self, key: str) -> torch.Tensor:
        return self[key]


class Returns(nn.Module):
    """Returns ``kind`` of two tensors computed from x with a graph: namedtuple, structseq, dict subclass, tuple."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> object:
        y = x * self.w
        if self.kind == "namedtuple":
            return Pair(y - 1, y + 1)
        if self.kind == "structseq":
            return torch.sort(y, dim=-1)
        if self.kind == "dict":
            return Output(low=y - 1, high=y + 1)
        return y - 1, y + 1


class Outer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inner = Returns(kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        first, second = (out["low"], out["high"]) if isinstance(out, dict) else (out[0], out[1])
        first.add_(100)  # in place after the module: a record holding the same tensor would change
        return first.sum() + second.sum()


def by_hand(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's output items, computed in plain PyTorch before anything writes to them."""
    y = x * torch.ones(3)
    if kind == "structseq":
        values, indices = torch.sort(y, dim=-1)
        return values, indices
    return y - 1, y + 1


@pytest.mark.parametrize("kind", ["namedtuple", "structseq", "dict", "tuple"])
@pytest.mark.parametrize("detach", [True, False])
def test_clone_copies_every_tensor_of_any_output_container_and_keeps_its_type(kind: str, detach: bool) -> None:
    m, x = Outer(kind), torch.randn(2, 3)
    with surgery.apply(m, {"c": {"kind": "capture", "select": "inner", "clone": True, "detach": detach}}) as s:
        m(x)
        out = s.captures["c"]["inner"].output
    want = by_hand(kind, x)
    got = (out["low"], out["high"]) if kind == "dict" else (out[0], out[1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # not the +100 written afterwards
    assert type(out) is type(m.inner(x))
    assert all((t.grad_fn is None) == (detach or not t.is_floating_point()) for t in got)
    if kind == "structseq":
        assert torch.equal(out.values, want[0]) and torch.equal(out.indices, want[1])
    if kind == "namedtuple":
        assert torch.equal(out.high, want[1])


@pytest.mark.parametrize("kind", ["namedtuple", "structseq", "dict"])
def test_a_detached_record_keeps_the_output_type_and_holds_no_graph(kind: str) -> None:
    m, x = nn.Sequential(Returns(kind)), torch.randn(2, 3)
    with surgery.apply(m, {"c": {"kind": "capture", "select": "0"}}) as s:
        live = m(x)
        out = s.captures["c"]["0"].output
    assert type(out) is type(live)
    items = list(out.values()) if kind == "dict" else list(out)
    assert all(t.grad_fn is None for t in items)
    assert all(torch.equal(a, b) for a, b in zip(items, live.values() if kind == "dict" else live))


def test_an_index_on_a_whole_tuple_output_is_refused_naming_index_and_item() -> None:
    m, x = Outer("tuple"), torch.randn(2, 3)
    actions = {"c": {"kind": "capture", "select": "inner", "index": "[:, 0]"}}
    with pytest.raises(ConfigError) as info:
        surgery.plan(m, actions, example_inputs=(x,))
    assert str(info.value) == (
        "actions.c.index: the output of 'inner' on this input is a tuple, and index cuts a tensor;"
        " pick one with item (e.g. item: 0)"
    )
    with pytest.raises(ActionError) as raised:
        with surgery.apply(m, actions):
            m(x)
    assert str(raised.value) == (
        "actions.c.index on module 'inner': the output is a tuple, and index cuts a tensor;"
        " pick one with item (e.g. item: 0)"
    )
    with surgery.apply(m, {"c": {**actions["c"], "item": 0}}) as s:  # the suggestion, pasted
        m(x)
        assert torch.equal(s.captures["c"]["inner"].output, by_hand("tuple", x)[0][:, 0])


def test_an_item_that_does_not_fit_the_output_is_refused_by_the_probe() -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(Outer("tuple"), {"c": {"kind": "capture", "select": "inner", "item": 5}}, example_inputs=(X,))
    assert (
        str(info.value)
        == "actions.c.item: 5 does not fit the output of 'inner' on this input: tuple index out of range"
    )
    surgery.plan(Outer("tuple"), {"c": {"kind": "capture", "select": "inner"}}, example_inputs=(X,))  # no item: whole
