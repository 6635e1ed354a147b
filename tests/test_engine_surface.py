"""The Surgery object as a user meets it: repr, apply's options and refusals, load_state_dict, calls, streamed
captures, removal order, ``with`` and the torch.compile warning, each checked against plain PyTorch or by its
exact text."""

from __future__ import annotations

import copy
import gc
import os
import re
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import surgery
from surgery.core import engine
from surgery.errors import ActionError, CompiledModelWarning, ConfigError

ADD = {"kind": "modify_output", "select": "0", "op": "add", "value": 1.0}
DOUBLE = {"kind": "modify_output", "select": "0", "op": "mul", "value": 2.0}
ZERO_BIAS = {"kind": "init", "select": "0", "param": "bias", "method": "zeros"}
X = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))


def seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))


def same_state(model: nn.Module, expected: nn.Module) -> bool:
    """Every parameter and buffer of ``model`` equals the one of the same name in ``expected``, bit for bit."""
    mine, theirs = model.state_dict(), expected.state_dict()
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


# ---------------------------------------------------------------- repr and the active flag


def test_repr_says_active_or_removed_and_lists_every_step_in_order() -> None:
    model = seq()
    s = surgery.apply(model, {"first": ADD, "second": DOUBLE})
    assert repr(s) == "<Surgery active: first, second>"
    assert s.active is True
    s.remove()
    assert repr(s) == "<Surgery removed: first, second>"
    assert s.active is False


# ---------------------------------------------------------------- apply: options, disabled steps, refusals


def test_a_disabled_step_is_skipped_and_the_steps_after_it_still_apply() -> None:
    model = seq()
    expected = model[2](model[1](model[0](X) + 1.0))
    with surgery.apply(model, {"off": {**DOUBLE, "enabled": False}, "on": ADD}):
        assert torch.equal(model(X), expected)


def test_compile_options_given_to_apply_reach_the_compiler() -> None:
    model = seq()
    expected = model(X) * 2.0
    actions = {"gone": {**ADD, "select": "no_such_module"}, "last": {**DOUBLE, "select": "2"}}
    with surgery.apply(model, actions, strict=False):  # strict=True would refuse the selector matching nothing
        assert torch.equal(model(X), expected)


def test_a_plan_compiled_for_another_model_is_refused() -> None:
    plan = surgery.plan(seq(), {"a": ADD})
    with pytest.raises(ConfigError) as info:
        surgery.apply(seq(), plan)
    assert str(info.value) == "apply: this plan was compiled for another model; compile it for this one"


def test_compile_options_with_a_compiled_plan_are_refused_by_name() -> None:
    model = seq()
    plan = surgery.plan(model, {"a": ADD})
    with pytest.raises(ConfigError) as info:
        surgery.apply(model, plan, strict=False, seed=3)
    assert str(info.value) == "apply: options ['seed', 'strict'] only apply when compiling; the plan is compiled"
    assert not model[0]._forward_hooks


class CtrlCOnHook(nn.Linear):
    """A Linear whose hook registration is where Ctrl-C lands."""

    def register_forward_hook(self, *args: object, **kwargs: object):  # type: ignore[override]
        raise KeyboardInterrupt


def test_ctrl_c_while_applying_comes_out_as_itself_after_the_rollback() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), CtrlCOnHook(2, 2))
    before = copy.deepcopy(model)
    actions = {"zero": ZERO_BIAS, "add": {**ADD, "select": "1"}}
    with pytest.raises(KeyboardInterrupt):
        surgery.apply(model, actions)
    assert same_state(model, before)  # the init that ran first was undone
    assert not model[0]._forward_hooks and not model[1]._forward_hooks


# ---------------------------------------------------------------- load_state_dict through the surgery


def test_load_state_dict_is_strict_by_default_like_torch() -> None:
    model, plain = seq(), seq()
    partial = {k: v + 1.0 for k, v in seq().state_dict().items() if k != "2.bias"}
    with pytest.raises(RuntimeError) as torch_error:
        plain.load_state_dict(partial)
    s = surgery.apply(model, {"a": ADD})
    with pytest.raises(RuntimeError) as error:
        s.load_state_dict(partial)
    assert str(error.value) == str(torch_error.value)
    with pytest.raises(RuntimeError) as error:
        s.load_state_dict(partial, strict=True)
    assert str(error.value) == str(torch_error.value)
    s.remove()
    assert same_state(model, seq())


def test_load_state_dict_not_strict_returns_what_torch_returns_and_remove_undoes_it() -> None:
    model, plain = seq(), seq()
    partial = {k: v + 1.0 for k, v in seq().state_dict().items() if k != "2.bias"}
    expected = plain.load_state_dict(partial, strict=False)
    s = surgery.apply(model, {"a": ADD})
    got = s.load_state_dict(partial, strict=False)
    assert got == expected and got.missing_keys == ["2.bias"]
    assert same_state(model, plain)
    s.remove()
    assert same_state(model, seq())
    with pytest.raises(ActionError) as info:
        s.load_state_dict(partial)
    assert str(info.value) == "load_state_dict: this surgery was removed; apply it again first"


# ---------------------------------------------------------------- calls: and streamed captures


class Twice(nn.Module):
    """One Linear called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


def test_reset_calls_makes_the_next_call_call_zero_again() -> None:
    model = Twice()
    lin = model.lin
    first_doubled = lin(torch.relu(lin(X) * 2.0))
    untouched = lin(torch.relu(lin(X)))
    with surgery.apply(model, {"a": {**DOUBLE, "select": "lin", "calls": [0]}}) as s:
        assert torch.equal(model(X), first_doubled)
        assert torch.equal(model(X), untouched)  # calls 2 and 3
        s.reset_calls()
        assert torch.equal(model(X), first_doubled)
        s.reset_calls()
        assert torch.equal(model(X), first_doubled)


def test_take_streamed_skips_a_disk_capture_that_matched_nothing() -> None:
    model = Twice()
    lin = model.lin
    inner = lin(X)
    outer = lin(torch.relu(inner))
    actions = {
        "none": {"kind": "capture", "select": "no_such_module", "to": "disk", "allow_empty": True},
        "c": {"kind": "capture", "select": "lin", "to": "disk"},
    }
    with torch.no_grad(), surgery.apply(model, actions) as s:
        model(X)
        taken = s.take_streamed()
        assert s.take_streamed() == {}
    assert sorted(taken) == ["c/lin/output/0", "c/lin/output/1"]
    assert torch.equal(taken["c/lin/output/0"], inner) and torch.equal(taken["c/lin/output/1"], outer)


# ---------------------------------------------------------------- removal order and bookkeeping


def test_removing_one_surgery_still_works_after_another_was_dropped_without_remove() -> None:
    model = seq()
    expected = model(X)
    dropped = surgery.apply(model, {"a": {**ADD, "select": "2"}})
    del dropped  # its hooks stay on the model; only the Surgery object is gone
    gc.collect()
    s = surgery.apply(model, {"b": DOUBLE})
    s.remove()
    assert torch.equal(model(X), expected + 1.0)


def test_the_refusal_names_every_step_of_the_later_surgery() -> None:
    model = seq()
    first = surgery.apply(model, {"a": ZERO_BIAS})
    second = surgery.apply(model, {"b": ZERO_BIAS, "c": ADD})
    with pytest.raises(ActionError) as info:
        first.remove()
    assert str(info.value) == (
        "remove the later surgery first (b, c): it changed the same tensors or modules after this one, so removing"
        " this one first could not restore the model exactly; remove surgeries in reverse order"
    )
    assert first.active
    second.remove()
    first.remove()
    assert same_state(model, seq()) and not model[0]._forward_hooks


def test_removing_an_unrelated_surgery_keeps_the_order_check_of_the_others() -> None:
    model = seq()
    first = surgery.apply(model, {"a": ZERO_BIAS})
    unrelated = surgery.apply(model, {"u": {**ZERO_BIAS, "select": "2"}})
    unrelated.remove()
    later = surgery.apply(model, {"b": ZERO_BIAS})
    with pytest.raises(ActionError, match=r"^remove the later surgery first \(b\)"):
        first.remove()
    later.remove()
    first.remove()
    assert same_state(model, seq())


def test_apply_and_remove_in_a_loop_leave_no_bookkeeping_behind() -> None:
    model = seq()
    kept = surgery.apply(model, {"a": ADD})
    for _ in range(20):
        surgery.apply(model, {"b": {**ADD, "select": "2"}}).remove()
    gc.collect()
    assert [ref() for ref in engine._ACTIVE[model]] == [kept]  # one weak reference per live surgery, no more
    kept.remove()
    assert engine._ACTIVE[model] == []


def test_leaving_the_with_block_checks_the_model_when_applied_with_verify() -> None:
    model = seq()
    with pytest.raises(ActionError) as info:
        with surgery.apply(model, {"a": ADD}, verify=True):
            with torch.no_grad():
                model[2].weight.mul_(3.0)
    assert str(info.value) == (
        "remove: the model is not restored exactly: tensor 2.weight: written in place while the surgery was"
        " applied and not restored (a model trained, or run in train mode, while the surgery was applied changes"
        " its tensors)"
    )
    assert not model[0]._forward_hooks  # the hooks came off before the check


# ---------------------------------------------------------------- torch.compile: the warning's text and line

WRAPPER_TEXT = (
    "surgery {} on a torch.compile-d model: if it has already run compiled, torch keeps using the graph it compiled"
    " and ignores this change. Apply surgery before the first compiled call, or call torch._dynamo.reset() after"
    " applying and after removing."
)
RAN_TEXT = (
    "surgery applied to a model that has already run compiled (torch.compile, .compile() or a compiled function"
    " calling it) while Dynamo still holds its graphs: compiled calls keep using the graph compiled before and may"
    " ignore this change (eager calls see it). Apply surgery before the first compiled call, or call"
    " torch._dynamo.reset() after applying (compiling again reuses the old graph)."
)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def at_users_line(caught: warnings.WarningMessage) -> bool:
    """The warning names this file (mutation testing puts its trampoline's frame between, outside surgery)."""
    return caught.filename == __file__ or caught.filename.endswith(os.path.join("mutmut", "mutation", "trampoline.py"))


def net() -> nn.Module:
    """A model of a class no other test compiles (Dynamo caches graphs per forward code object)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).relu()

    return Net().eval()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_compiled_wrapper_warning_text_on_apply_and_on_remove(fresh_dynamo: None) -> None:
    compiled = torch.compile(net(), backend="eager")
    actions = {"a": {**ADD, "select": "fc"}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = surgery.apply(compiled, actions)
        s.remove()
        with surgery.apply(compiled, actions):
            pass
    assert [str(w.message) for w in caught] == [WRAPPER_TEXT.format(d) for d in ("applied", "removed") * 2]
    assert all(w.category is CompiledModelWarning and at_users_line(w) for w in caught)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_warning_after_a_compiled_run_gives_its_full_text_at_the_users_line(fresh_dynamo: None) -> None:
    model = net()
    torch.compile(model, backend="eager")(X)
    with pytest.warns(CompiledModelWarning, match=f"^{re.escape(RAN_TEXT)}$") as caught:
        s = surgery.apply(model, {"a": {**ADD, "select": "fc"}})
    assert len(caught) == 1 and at_users_line(caught[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompiledModelWarning)
        s.remove()  # removing is seen by Dynamo's hook guards: no warning


def test_an_apply_failure_ends_in_one_full_stop_whatever_the_error_ends_with() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    before = copy.deepcopy(model.state_dict())
    plan = surgery.plan(model, {"z": {"kind": "init", "select": "0", "param": "weight", "method": "zeros"}})

    def fails(ledger: object) -> None:
        raise RuntimeError(".boomX.")  # a leading dot, an X before the last dot: only that last dot goes

    plan.steps[0].apply = fails
    with pytest.raises(ActionError) as info:
        surgery.apply(model, plan)
    assert str(info.value) == "actions.z: failed on '': RuntimeError: .boomX. Nothing was changed."
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
