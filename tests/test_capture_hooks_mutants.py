"""capture's hooks (surgery/actions/capture_hooks.py) against hand-written PyTorch hooks: every key's effect, exactly.

What a record holds (the same tensor, a detached view, a private copy), whether a later in-place change warns,
which calls ``keep``/``calls``/``always`` keep, and the errors a failing hook raises.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery.core.records import RecordChangedWarning
from surgery.errors import ActionError
from tests.test_capture_calls import Twice


class Root(nn.Module):
    """``lin(x)``, optionally written in place afterwards (like a ReLU(inplace=True) after the module)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.mul_(2.0) if self.inplace else h


class Pair(nn.Module):
    """Returns its output as a ``kind`` container: tuple, list or dict."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        a = self.lin(x)
        b = a * 2.0
        return {"a": a, "b": b} if self.kind == "dict" else [a, b] if self.kind == "list" else (a, b)


class PairRoot(nn.Module):
    def __init__(self, kind: str = "tuple") -> None:
        super().__init__()
        self.pair = Pair(kind)

    def forward(self, x: torch.Tensor) -> Any:
        return self.pair(x)


class Shift(nn.Module):
    def forward(self, x: torch.Tensor, *, by: torch.Tensor) -> torch.Tensor:
        return x + by


class ByKeyword(nn.Module):
    """``shift(shift(x, by=b1), by=b2)`` with parameters as the keyword inputs (they require grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = Shift()
        self.b1 = nn.Parameter(torch.tensor([[1.0, 2.0, 3.0]]))
        self.b2 = nn.Parameter(torch.tensor([[-0.5, 0.25, 4.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shift(self.shift(x, by=self.b1), by=self.b2)


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


class BoomRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.boom = Boom()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.boom(x)


class KwRoot(nn.Module):
    """A root whose forward needs a keyword input before the captured module runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.after = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
        return self.after(self.lin(x + shift))


def x_of(seed: int = 1) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))


def cap(select: str = "lin", **keys: Any) -> dict[str, Any]:
    return {"c": {"kind": "capture", "select": select, **keys}}


@contextmanager
def no_warning() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# output-only hook: the tensor itself, a detached view, or (keep: last) the last call's


@pytest.mark.parametrize("keep", ["all", "last"])
def test_output_hook_keeps_the_tensor_itself_without_detach_and_a_detached_view_with_it(keep: str) -> None:
    for detach in (False, True):
        model, x = Root(), x_of()
        seen: list[torch.Tensor] = []
        with surgery.apply(model, cap(detach=detach, keep=keep)) as s:
            handle = model.lin.register_forward_hook(lambda m, a, o, seen=seen: seen.append(o))
            model(x)
            model(x_of(2))
            handle.remove()
            calls = s.captures["c"]["lin"].calls
            assert len(calls) == (1 if keep == "last" else 2)
            got = calls[-1].output
            if detach:
                assert got is not seen[1] and not got.requires_grad and got.grad_fn is None
                assert got.data_ptr() == seen[1].data_ptr() and torch.equal(got, seen[1])
            else:
                assert got is seen[1] and got.requires_grad
            if keep == "all":
                assert torch.equal(calls[0].output, seen[0])


@pytest.mark.parametrize("keep", ["all", "last"])
def test_output_hook_warns_when_the_output_is_written_in_place_after_it(keep: str) -> None:
    model, x = Root(inplace=True), x_of()
    with surgery.apply(model, cap(keep=keep)) as s:
        model(x)
        with pytest.warns(RecordChangedWarning, match=r"^c/lin: call 0 was changed in place after it was captured"):
            assert s.captures["c"]["lin"].calls


@pytest.mark.parametrize("keep", ["all", "last"])
@pytest.mark.parametrize("detach", [False, True])
def test_output_hook_keeps_a_tuple_output_element_by_element(keep: str, detach: bool) -> None:
    model = PairRoot()
    seen: list[Any] = []
    with surgery.apply(model, cap("pair", detach=detach, keep=keep)) as s:
        handle = model.pair.register_forward_hook(lambda m, a, o: seen.append(o))
        model(x_of(1))
        model(x_of(2))
        handle.remove()
        calls = s.captures["c"]["pair"].calls
        assert len(calls) == (1 if keep == "last" else 2)
        got = calls[-1].output
        assert type(got) is tuple and len(got) == 2
        for g, t in zip(got, seen[1], strict=True):
            assert torch.equal(g, t)
            assert (g is t) != detach and g.requires_grad != detach
        if keep == "all":
            assert all(torch.equal(g, t) for g, t in zip(calls[0].output, seen[0], strict=True))


# clone: a private copy (detached or not), of tensors and of tuples, lists and dicts


@pytest.mark.parametrize("detach", [False, True])
def test_clone_keeps_a_private_copy_of_a_tensor_output(detach: bool) -> None:
    model, x = Root(inplace=True), x_of()
    seen: list[torch.Tensor] = []
    with surgery.apply(model, cap(clone=True, detach=detach)) as s:
        handle = model.lin.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
        model(x)
        handle.remove()
        with no_warning():
            got = s.captures["c"]["lin"].output
            assert torch.equal(got, seen[0])  # what lin gave, before the root wrote it in place
            assert got.requires_grad != detach and (got.grad_fn is None) == detach
            got.add_(1.0)  # the record's own copy: writing it is no later in-place change of the model's
            assert s.captures["c"]["lin"].calls


@pytest.mark.parametrize("kind", ["tuple", "list", "dict"])
@pytest.mark.parametrize("detach", [False, True])
def test_clone_copies_each_element_of_a_container_output(kind: str, detach: bool) -> None:
    model = PairRoot(kind)
    seen: list[Any] = []
    with surgery.apply(model, cap("pair", clone=True, detach=detach)) as s:
        handle = model.pair.register_forward_hook(lambda m, a, o: seen.append(o))
        model(x_of())
        handle.remove()
        got = s.captures["c"]["pair"].output
        assert type(got) is type(seen[0])
        pairs = [(got[k], seen[0][k]) for k in ("a", "b")] if kind == "dict" else list(zip(got, seen[0], strict=True))
        for g, t in pairs:
            assert torch.equal(g, t) and g.data_ptr() != t.data_ptr()
            assert g.requires_grad != detach


# whole calls: inputs, keyword inputs, item by name or position, index, clone, keep: last


def test_input_capture_keep_last_keeps_only_the_last_call() -> None:
    model, x = Twice(), x_of()
    with torch.no_grad():
        t = torch.tanh(model.lin(x))
    with surgery.apply(model, cap(what=["input"], keep="last")) as s:
        model(x)
        calls = s.captures["c"]["lin"].calls
        assert len(calls) == 1 and torch.equal(calls[0].input[0], t)


@pytest.mark.parametrize("detach", [False, True])
def test_keyword_item_records_the_keyword_input_and_a_name_not_passed_by_keyword_the_first_input(
    detach: bool,
) -> None:
    model, x = ByKeyword(), x_of()
    with surgery.apply(model, cap("shift", what=["input"], item="by", detach=detach)) as s:
        model(x)
        got = [c.input for c in s.captures["c"]["shift"].calls]
    assert got[0] is not None and torch.equal(got[0], model.b1) and torch.equal(got[1], model.b2)
    assert got[0].requires_grad != detach and got[0].data_ptr() == model.b1.data_ptr()
    with surgery.apply(model, cap("shift", what=["input"], item="by", clone=True)) as s:
        model(x)
        got = [c.input for c in s.captures["c"]["shift"].calls]
    assert torch.equal(got[0], model.b1) and got[0].data_ptr() != model.b1.data_ptr()
    with surgery.apply(model, cap("shift", what=["input"], item="by", index="[0, 1:]")) as s:
        model(x)
        got = [c.input for c in s.captures["c"]["shift"].calls]
    assert torch.equal(got[1], model.b2.detach()[0, 1:])
    with surgery.apply(model, cap("shift", what=["input"], item="x", index="[1:]")) as s:
        model(x)
        got = [c.input for c in s.captures["c"]["shift"].calls]
    assert torch.equal(got[0], x[1:]) and torch.equal(got[1], (x + model.b1).detach()[1:])


@pytest.mark.parametrize("keys", [{"item": 0}, {}])
def test_input_capture_detaches_and_clones_as_configured(keys: dict[str, Any]) -> None:
    model = Root()
    for detach, clone in ((True, False), (False, False), (True, True), (False, True)):
        x = x_of().requires_grad_()
        with surgery.apply(model, cap(what=["input"], detach=detach, clone=clone, **keys)) as s:
            model(x)
            got = s.captures["c"]["lin"].input
        got = got if "item" in keys else got[0]
        assert torch.equal(got, x) and got.requires_grad != detach
        assert (got.data_ptr() == x.data_ptr()) != clone


def test_keyword_inputs_are_detached_and_cloned_as_configured() -> None:
    model, x = ByKeyword(), x_of()
    for detach, clone in ((True, False), (False, False), (True, True)):
        with surgery.apply(model, cap("shift", what=["input"], detach=detach, clone=clone)) as s:
            model(x)
            got = s.captures["c"]["shift"].calls[0].kwargs["by"]
        assert torch.equal(got, model.b1) and got.requires_grad != detach
        assert (got.data_ptr() == model.b1.data_ptr()) != clone


def test_recorded_inputs_keyword_inputs_and_outputs_warn_when_written_in_place_afterwards() -> None:
    model, x = ByKeyword(), x_of()
    message = r"^c/shift: call 0 was changed in place after it was captured"
    with surgery.apply(model, cap("shift", what=["input"])) as s:
        model(x)
        x.add_(1.0)
        with pytest.warns(RecordChangedWarning, match=message):
            assert s.captures["c"]["shift"].calls
    with surgery.apply(model, cap("shift", what=["input", "output"])) as s:
        model(x)
        with torch.no_grad():
            model.b1.add_(1.0)
        with pytest.warns(RecordChangedWarning, match=message):
            assert s.captures["c"]["shift"].calls
    with surgery.apply(model, cap("shift", what=["input", "output"])) as s:
        model(x)
        x.add_(1.0)
        with pytest.warns(RecordChangedWarning, match=message):
            assert s.captures["c"]["shift"].calls
    model2 = Root(inplace=True)
    with surgery.apply(model2, cap(what=["input", "output"])) as s:
        model2(x)
        with pytest.warns(RecordChangedWarning, match=r"^c/lin: call 0 was changed in place"):
            assert s.captures["c"]["lin"].calls


@pytest.mark.parametrize("keys", [{"clone": True}, {"index": "[1:]"}, {"clone": True, "index": "[1:]"}])
def test_copied_records_never_warn_even_when_the_user_writes_them(keys: dict[str, Any]) -> None:
    model, x = ByKeyword(), x_of()
    with surgery.apply(model, cap("shift", what=["input", "output"], item=0, **keys)) as s:
        model(x)
        x.add_(1.0)
        with no_warning():
            call = s.captures["c"]["shift"].calls[0]
            call.input.add_(1.0)
            call.output.add_(1.0)
            assert s.captures["c"]["shift"].calls


# always: a pre-hook records the inputs, the forward hook adds the output


def test_always_records_inputs_keyword_inputs_and_outputs_of_each_call() -> None:
    model, x = ByKeyword(), x_of()
    with torch.no_grad():
        h1 = x + model.b1
        h2 = h1 + model.b2
    with surgery.apply(model, cap("shift", what=["input", "output"], always=True)) as s:
        model(x)
        calls = s.captures["c"]["shift"].calls
    assert len(calls) == 2
    assert torch.equal(calls[0].input[0], x) and torch.equal(calls[0].kwargs["by"], model.b1)
    assert torch.equal(calls[1].input[0], h1) and torch.equal(calls[1].kwargs["by"], model.b2)
    assert torch.equal(calls[0].output, h1) and torch.equal(calls[1].output, h2)
    with surgery.apply(model, cap("shift", what=["input"], always=True, item="by")) as s:
        model(x)
        assert torch.equal(s.captures["c"]["shift"].calls[1].input, model.b2)
    with surgery.apply(model, cap("shift", what=["input"], always=True)) as s:
        model(x)
        calls = s.captures["c"]["shift"].calls
    assert [c.output for c in calls] == [None, None] and torch.equal(calls[1].input[0], h1)


def test_always_keeps_the_inputs_of_a_forward_that_raises() -> None:
    model, x = BoomRoot(), x_of()
    with surgery.apply(model, cap("boom", what=["input", "output"], always=True)) as s:
        with pytest.raises(RuntimeError, match="^boom$"):
            model(x)
        calls = s.captures["c"]["boom"].calls
    assert len(calls) == 1 and torch.equal(calls[0].input[0], x) and calls[0].output is None


def test_calls_selects_which_calls_a_whole_call_capture_records() -> None:
    model, x = Twice(), x_of()
    with torch.no_grad():
        t = torch.tanh(model.lin(x))
    for always in (False, True):
        with surgery.apply(model, cap(what=["input"], calls=[1], always=always)) as s:
            model(x)
            calls = s.captures["c"]["lin"].calls
        assert len(calls) == 1 and torch.equal(calls[0].input[0], t)


def test_a_failing_whole_call_hook_names_the_action_and_module() -> None:
    model, x = Root(), x_of()
    with surgery.apply(model, cap(what=["input"], always=True, item=5)) as s:
        with pytest.raises(ActionError) as e:
            model(x)
        assert str(e.value) == (
            "actions.c.item on module 'lin': input 5 was not passed; the module got 1 positional input(s) and"
            " keywords []"
        )
    assert s is not None
    model2 = PairRoot()
    with surgery.apply(model2, cap("pair", item=5)):
        with pytest.raises(ActionError) as e:
            model2(x)
        assert str(e.value) == "actions.c on module 'pair': IndexError: tuple index out of range"


# stop: the root's forward ends with None, its keyword inputs still reach the model


def test_stop_passes_the_roots_keyword_inputs_and_ends_with_none() -> None:
    model, x, shift = KwRoot(), x_of(), x_of(3)
    with torch.no_grad():
        want = model.lin(x + shift)
    with surgery.apply(model, cap(stop=True)) as s:
        assert model(x, shift=shift) is None
        assert torch.equal(s.captures["c"]["lin"].output, want)
    assert torch.equal(model(x, shift=shift), model.after(model.lin(x + shift)))
    assert "forward" not in model.__dict__


def test_two_stopping_captures_end_the_forward_and_remove_leaves_no_wrapper() -> None:
    model, x, shift = KwRoot(), x_of(), x_of(3)
    actions = {**cap(stop=True), "d": {"kind": "capture", "select": "lin", "stop": True}}
    with torch.no_grad():
        want = model.lin(x + shift)
    with surgery.apply(model, actions) as s:
        assert model(x, shift=shift) is None
        assert torch.equal(s.captures["c"]["lin"].output, want)
        assert s.captures["d"]["lin"].calls == []  # c's stop hook ended the forward before d's hooks ran
    assert "forward" not in model.__dict__


def test_an_output_index_is_checked_on_the_whole_output_and_records_that_part() -> None:
    model, x = Root(), x_of()
    plan = surgery.plan(model, cap(index="[:, -1]"), example_inputs=(x,))
    with surgery.apply(model, plan) as s:
        model(x)
        got = s.captures["c"]["lin"].output
    with torch.no_grad():
        assert torch.equal(got, model.lin(x)[:, -1])
