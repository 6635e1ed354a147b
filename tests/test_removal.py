"""Exact removal: the attributes PyTorch sets lazily come back, remove(verify=True) names what differs,
paused() turns hooks off and back on in place, and each ledger call owns its undo."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery.core import ledger as ledger_module
from surgery.core.ledger import Ledger
from surgery.errors import ActionError
from tests.conftest import Snapshot, TinyNet, run_both

GRAD = {"kind": "capture_grad", "select": "fc"}
GRAD_PARAM = {"kind": "capture_grad", "select": "fc", "param": "weight"}


def old_style_backward_hook(model: nn.Module) -> None:
    """What a user may do after surgery: PyTorch refuses it while _is_full_backward_hook is True."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # register_backward_hook is deprecated, still supported
        model.fc.register_backward_hook(lambda *a: None)


@pytest.mark.parametrize("kind", ["capture_grad", "modify_grad"])
def test_a_module_gradient_kind_leaves_no_backward_hook_mode_behind(kind: str, tiny: TinyNet, x_img) -> None:
    config = {"kind": kind, "select": "fc"} | ({"op": "mul", "value": 0.5} if kind == "modify_grad" else {})
    assert tiny.fc._is_full_backward_hook is None
    with surgery.apply(tiny, {"a": config}):
        run_both(tiny, x_img)
        assert tiny.fc._is_full_backward_hook is True
    assert tiny.fc._is_full_backward_hook is None  # was True: the user's next line raised
    old_style_backward_hook(tiny)


def test_a_parameter_hook_leaves_the_tensor_hook_dict_as_none(tiny: TinyNet, x_img) -> None:
    with surgery.apply(tiny, {"a": GRAD_PARAM}):
        run_both(tiny, x_img)
    assert tiny.fc.weight._backward_hooks is None  # was an empty dict
    assert tiny.fc.weight._post_accumulate_grad_hooks is None


def test_the_ledger_puts_back_a_post_accumulate_grad_hook_dict_as_none(tiny: TinyNet) -> None:
    ledger = Ledger()
    ledger.hook(tiny.fc.weight.register_post_accumulate_grad_hook, lambda p: None)
    assert tiny.fc.weight._post_accumulate_grad_hooks is not None
    assert ledger.rollback() == []
    assert tiny.fc.weight._post_accumulate_grad_hooks is None


def test_two_surgeries_removed_in_either_order_give_the_mode_back(tiny: TinyNet) -> None:
    before = Snapshot.of(tiny)
    for order in ((0, 1), (1, 0)):
        both = [surgery.apply(tiny, {"a": GRAD}), surgery.apply(tiny, {"b": GRAD})]
        for i in order:
            both[i].remove()
        before.assert_same(tiny)


def test_a_users_backward_hook_added_meanwhile_keeps_the_mode_it_needs(tiny: TinyNet) -> None:
    s = surgery.apply(tiny, {"a": GRAD})
    handle = tiny.fc.register_full_backward_hook(lambda *a: None)
    s.remove()
    assert tiny.fc._is_full_backward_hook is True and len(tiny.fc._backward_hooks) == 1
    handle.remove()


# ---------------------------------------------------------------- remove(verify=True)


def test_verify_passes_after_an_exact_removal_and_twice(tiny: TinyNet, x_img) -> None:
    s = surgery.apply(tiny, {"a": GRAD, "b": {"kind": "init", "select": "fc", "param": "weight", "method": "zeros"}},
                      verify=True)  # fmt: skip
    run_both(tiny, x_img)
    s.remove(verify=True)
    s.remove(verify=True)  # still compares, still equal


def test_verify_names_a_hook_left_on_a_module(tiny: TinyNet) -> None:
    s = surgery.apply(tiny, {"a": GRAD}, verify=True)
    handle = tiny.conv.register_forward_hook(lambda *a: None)
    with pytest.raises(ActionError, match=r"not restored exactly: module conv: _forward_hooks was \(\), now \(\d+,\)"):
        s.remove()
    handle.remove()
    s.remove(verify=True)


def test_verify_names_the_lazy_attributes_when_the_undo_forgets_them(
    tiny: TinyNet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check sees the two leaks of issue 11 item 10 if the ledger stops putting them back."""
    monkeypatch.setattr(ledger_module, "_unhook", lambda handle, owner: handle.remove())
    s = surgery.apply(tiny, {"a": GRAD, "b": GRAD_PARAM}, verify=True)
    with pytest.raises(ActionError) as info:
        s.remove()
    message = str(info.value)
    assert "module fc: _is_full_backward_hook was None, now True" in message
    assert "tensor fc.weight: _backward_hooks was None, now ()" in message


def test_verify_names_a_weight_written_outside_the_ledger(tiny: TinyNet) -> None:
    s = surgery.apply(tiny, {"a": GRAD}, verify=True)
    with torch.no_grad():
        tiny.fc.bias.add_(1)
    with pytest.raises(ActionError, match="tensor fc.bias: written in place while the surgery was applied"):
        s.remove()


def test_verify_names_a_tensor_whose_storage_was_swapped(tiny: TinyNet) -> None:
    s = surgery.apply(tiny, {"a": GRAD}, verify=True)
    tiny.fc.bias.data = tiny.fc.bias.data.clone()
    with pytest.raises(ActionError, match="tensor fc.bias: storage was"):
        s.remove()


def test_verify_needs_the_state_taken_at_apply(tiny: TinyNet) -> None:
    s = surgery.apply(tiny, {"a": GRAD})
    with pytest.raises(ActionError, match="apply it with verify=True"):
        s.remove(verify=True)
    s.remove()


def test_a_failed_check_does_not_hide_the_error_leaving_a_with_block(tiny: TinyNet) -> None:
    with pytest.raises(KeyError), surgery.apply(tiny, {"a": GRAD}, verify=True):
        tiny.conv.register_forward_hook(lambda *a: None)  # would fail the check
        raise KeyError("the user's error")


# ---------------------------------------------------------------- paused()

HOOKS = {
    "out": {"kind": "modify_output", "select": "fc", "op": "mul", "value": 0.5},
    "in": {"kind": "modify_input", "select": "conv", "op": "add", "value": 1.0},
    "grad": {"kind": "modify_grad", "select": "pool", "op": "mul", "value": 3.0},
    "cap": {"kind": "capture", "select": "fc"},
}


def grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    model.zero_grad(set_to_none=True)
    out = run_both(model, x)
    return (out.detach(), *(p.grad.clone() for p in model.parameters()))


def test_paused_runs_as_the_unmodified_model_and_resumes_the_surgered_one(tiny: TinyNet, x_img) -> None:
    plain = grads(tiny, x_img)
    s = surgery.apply(tiny, HOOKS)
    surgered = grads(tiny, x_img)
    assert not torch.equal(surgered[0], plain[0]) and not torch.equal(surgered[1], plain[1])
    with s.paused():
        assert all(torch.equal(a, b) for a, b in zip(grads(tiny, x_img), plain, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads(tiny, x_img), surgered, strict=True))
    assert len(s.captures["cap"]["fc"].calls) == 2  # nothing recorded while paused
    s.remove()


def test_paused_puts_each_hook_back_in_its_place_without_wrapping_it(tiny: TinyNet, x_img) -> None:
    first = tiny.fc.register_forward_hook(lambda *a: None)
    s = surgery.apply(tiny, HOOKS)
    last = tiny.fc.register_forward_hook(lambda *a: None)
    order = list(tiny.fc._forward_hooks.items())
    with s.paused():
        assert list(tiny.fc._forward_hooks) == [first.id, last.id]
        during = tiny.fc.register_forward_hook(lambda *a: None)
        with s.paused():  # nested: nothing more to do
            pass
        assert len(tiny.fc._forward_hooks) == 3
    assert list(tiny.fc._forward_hooks.items())[: len(order)] == order  # same functions, same order: no per-call check
    assert list(tiny.fc._forward_hooks)[-1] == during.id
    for handle in (first, last, during):
        handle.remove()
    s.remove()


def test_removing_inside_paused_removes_for_good(tiny: TinyNet, x_img) -> None:
    before = Snapshot.of(tiny)
    s = surgery.apply(tiny, HOOKS)
    with s.paused():
        s.remove()
    before.assert_same(tiny)
    with s.paused():  # a removed surgery has nothing to pause
        pass
    before.assert_same(tiny)


# ---------------------------------------------------------------- one ledger call per change, each owning its undo


def test_every_ledger_change_is_undone_exactly(tiny: TinyNet) -> None:
    before = Snapshot.of(tiny)
    ledger = Ledger()
    ledger.overwrite(tiny.fc.weight, torch.zeros_like(tiny.fc.weight))
    ledger.overwrite(tiny.conv.bias, lambda t: t.fill_(3.0))
    ledger.set_attr(tiny.fc.bias, "requires_grad", False)
    ledger.set_attr(tiny.fc, "new_flag", 1)
    ledger.swap_child(tiny, "act", nn.GELU())
    ledger.add_tensor(tiny.fc, "extra", torch.ones(3), "buffers", persistent=False)
    ledger.add_tensor(tiny.fc, "scale", torch.ones(3), "parameters")
    ledger.hook(tiny.fc.register_forward_hook, lambda *a: None, with_kwargs=False)
    assert torch.equal(tiny.conv.bias, torch.full_like(tiny.conv.bias, 3.0)) and not tiny.fc.bias.requires_grad
    assert list(tiny._modules) == ["conv", "norm", "act", "pool", "fc"] and type(tiny.act) is nn.GELU
    assert tiny.fc._non_persistent_buffers_set == {"extra"} and isinstance(tiny.fc.scale, nn.Parameter)
    assert ledger.rollback() == []
    before.assert_same(tiny)
    assert not hasattr(tiny.fc, "new_flag")


def test_swap_child_refuses_a_name_that_is_not_a_child(tiny: TinyNet) -> None:
    with pytest.raises(KeyError, match="no child module 'nope'"):
        Ledger().swap_child(tiny, "nope", nn.ReLU())


def test_an_undo_is_owned_before_the_write_so_a_failing_fill_is_undone(tiny: TinyNet) -> None:
    before = Snapshot.of(tiny)
    ledger = Ledger()

    def half_then_fail(t: torch.Tensor) -> Any:
        t[0].zero_()
        raise RuntimeError("fill failed")

    with pytest.raises(RuntimeError):
        ledger.overwrite(tiny.fc.weight, half_then_fail)
    ledger.rollback()
    before.assert_same(tiny)
