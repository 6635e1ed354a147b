"""The ledger's promise, seen from outside: after remove() the model is what it was in every attribute PyTorch
keeps (hook dicts and their order, lazy hook attributes, instance vs class attributes, tensor slots), paused()
puts every hook back exactly where it was, hook counts and record names are exact, and surgeries that touched
different things can be removed in any order. Compared with tests/conftest.py's independent snapshot."""

from __future__ import annotations

import types
import warnings
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery.core.ledger import Ledger
from surgery.errors import ActionError, SurgeryError
from surgery.integrations.training import record_statistics
from tests.conftest import Snapshot, TinyNet, hook_attr, module_facts, run_both

GRAD = {"kind": "capture_grad", "select": "fc"}
GRAD_WEIGHT = {"kind": "capture_grad", "select": "fc", "param": "weight"}
HALF = {"kind": "modify_output", "select": "fc", "op": "mul", "value": 0.5}
PLUS = {"kind": "modify_input", "select": "conv", "op": "add", "value": 1.0}
TRIPLE_GRAD = {"kind": "modify_grad", "select": "fc", "param": "weight", "op": "mul", "value": 3.0}


def out_and_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The output and every parameter's gradient of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = run_both(model, x)
    return [out.detach(), *(p.grad.clone() for p in model.parameters())]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- lazy hook attributes come back as they were


def test_remove_gives_back_a_backward_hook_mode_the_user_left_true(tiny: TinyNet, x_img) -> None:
    tiny.fc.register_full_backward_hook(lambda *a: None).remove()  # PyTorch leaves the mode True
    assert tiny.fc._is_full_backward_hook is True
    before = Snapshot.of(tiny)
    with surgery.apply(tiny, {"g": GRAD}):
        run_both(tiny, x_img)
    before.assert_same(tiny)
    assert tiny.fc._is_full_backward_hook is True


def test_remove_gives_back_a_tensor_hook_dict_the_user_left_empty(tiny: TinyNet, x_img) -> None:
    tiny.fc.weight.register_hook(lambda g: None).remove()  # the dict PyTorch made stays, empty
    assert tiny.fc.weight._backward_hooks == {}
    before = Snapshot.of(tiny)
    with surgery.apply(tiny, {"g": GRAD_WEIGHT}):
        run_both(tiny, x_img)
    before.assert_same(tiny)
    assert tiny.fc.weight._backward_hooks == {}


def test_a_tensor_hook_the_user_adds_meanwhile_survives_remove(tiny: TinyNet, x_img) -> None:
    seen: list[torch.Tensor] = []
    s = surgery.apply(tiny, {"g": GRAD_WEIGHT})
    handle = tiny.fc.weight.register_hook(lambda g: seen.append(g.clone()))
    s.remove()
    assert list(tiny.fc.weight._backward_hooks) == [handle.id]
    run_both(tiny, x_img)
    assert len(seen) == 1 and torch.equal(seen[0], tiny.fc.weight.grad)
    handle.remove()


def test_a_failed_apply_names_the_module_and_changes_nothing(tiny: TinyNet) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # register_backward_hook is deprecated, still supported
        tiny.fc.register_backward_hook(lambda *a: None)  # full backward hooks now refuse fc
    before = Snapshot.of(tiny)
    with pytest.raises(ActionError, match=r"^actions\.g: failed on 'fc': RuntimeError: Cannot use both regular"):
        surgery.apply(tiny, {"g": {"kind": "capture_grad", "select": ["conv", "fc"]}})
    before.assert_same(tiny)  # conv's hook, made before, was taken out again


# ---------------------------------------------------------------- counts and records


def test_hook_count_is_exact_per_action(tiny: TinyNet) -> None:
    actions = {"g": {"kind": "capture_grad", "select": ["conv", "fc"]}, "p": {**GRAD_WEIGHT, "param": "*"},
               "o": HALF, "c": {"kind": "capture", "select": "fc", "what": ["input", "output"]}}  # fmt: skip
    s = surgery.apply(tiny, actions)
    assert s.hook_count == {"g": 2, "p": 2, "o": 1, "c": 1}
    s.remove()
    assert s.hook_count == {}


def test_a_gradient_record_is_named_and_keeps_calls(tiny: TinyNet, x_img) -> None:
    plain = TinyNet().eval()
    plain.load_state_dict(tiny.state_dict())
    kept: list[tuple[Any, Any]] = []
    plain.fc.register_full_backward_hook(lambda m, gi, go: kept.append((gi[0].clone(), go[0].clone())))
    run_both(plain, x_img)
    with surgery.apply(tiny, {"g": GRAD}) as s:
        record = s.captures["g"]["fc"]
        assert repr(record) == "Record('g/fc', calls=0)"
        with pytest.raises(SurgeryError, match=r"^g/fc: no call was recorded \(did the model run through it\?\)$"):
            _ = record.grad_input
        run_both(tiny, x_img)
        stats = record_statistics(record)  # what the training callbacks log: computed from the kept call

    def by_hand(t: torch.Tensor) -> dict[str, float]:
        x = t.double()
        return {"mean": x.mean().item(), "std": x.std(correction=0).item(), "norm": torch.linalg.vector_norm(x).item()}

    (grad_input, grad_output), = kept  # fmt: skip
    assert stats == {"grad_input.0": by_hand(grad_input), "grad_output.0": by_hand(grad_output)}


class Scores(nn.Module):
    """softmax(x W), the softmax called through torch.nn.functional."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.w(x), dim=-1)


def test_a_function_capture_keeps_the_statistics_it_was_asked_for() -> None:
    torch.manual_seed(0)
    model, x = Scores(), torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    p = F.softmax(model.w(x), dim=-1).detach().double()
    action = {"kind": "capture", "select": "<root>", "function": "softmax", "what": ["output"], "reduce": "stats"}
    with surgery.apply(model, {"r": action}, example_inputs=(x,)) as s:
        model(x)
        reduced = s.captures["r"]["<root>"].reduced
    assert sorted(reduced) == ["output"] and sorted(reduced["output"]) == ["count", "max", "mean", "min", "std"]
    assert torch.equal(reduced["output"]["min"], p.amin(0).float())
    assert torch.equal(reduced["output"]["max"], p.amax(0).float())
    assert torch.equal(reduced["output"]["mean"], p.mean(0).float())


def test_a_fresh_surgery_streams_nothing_plots_what_was_asked_and_is_not_in_a_source_pass(tiny: TinyNet, x_img) -> None:
    actions = {
        "c": {"kind": "capture", "select": "pool", "plot": True},
        "ablate": {"kind": "modify_output", "select": "pool", "op": "set",
                   "from": {"capture": "c", "reduce": "mean", "dim": 0}},
    }  # fmt: skip
    with surgery.apply(tiny, actions) as s:
        assert s.plotted == {"c"} and s.take_streamed() == {}
        got = tiny(x_img)
    handle = tiny.pool.register_forward_hook(lambda m, a, o: o.mean(0, keepdim=True).expand_as(o).clone())
    expected = tiny(x_img)  # the ablation acts outside a source pass, written by hand
    handle.remove()
    assert torch.equal(got, expected)


# ---------------------------------------------------------------- added tensors keep their options


def test_added_tensors_keep_requires_grad_and_persistence(tiny: TinyNet) -> None:
    before = Snapshot.of(tiny)
    actions = {
        "p": {"kind": "add_parameter", "select": "fc", "name": "gain", "shape": [3], "requires_grad": False},
        "b": {"kind": "add_buffer", "select": "fc", "name": "seen", "shape": [3], "persistent": False},
    }
    with surgery.apply(tiny, actions):
        assert isinstance(tiny.fc.gain, nn.Parameter) and tiny.fc.gain.requires_grad is False
        assert tiny.fc._non_persistent_buffers_set == {"seen"} and "fc.seen" not in tiny.state_dict()
    before.assert_same(tiny)


def test_remove_reports_an_undo_that_failed_and_still_undoes_the_rest(tiny: TinyNet) -> None:
    before = Snapshot.of(tiny)
    s = surgery.apply(tiny, {"p": {"kind": "add_parameter", "select": "fc", "name": "gain", "shape": [3]}, "g": GRAD})
    del tiny.fc.gain  # the user took it off already
    message = "removing the surgery hit 1 error(s); first: AttributeError(\"'Linear' object has no attribute 'gain'\")"
    with pytest.raises(ActionError) as info:
        s.remove()
    assert str(info.value) == message
    before.assert_same(tiny)


# ---------------------------------------------------------------- removal order: only a real overlap refuses

CHANGES = {
    "freeze": lambda m: {"kind": "freeze", "select": m, "param": "weight"},
    "init": lambda m: {"kind": "init", "select": m, "param": "bias", "method": "zeros"},
    "add_parameter": lambda m: {"kind": "add_parameter", "select": m, "name": "extra", "shape": [2]},
}


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_surgeries_changing_different_modules_come_off_in_apply_order(kind: str, tiny: TinyNet) -> None:
    before = Snapshot.of(tiny)
    first = surgery.apply(tiny, {"a": CHANGES[kind]("fc")})
    second = surgery.apply(tiny, {"b": CHANGES[kind]("conv")})
    first.remove()  # nothing shared: no need for reverse order
    second.remove()
    before.assert_same(tiny)


@pytest.mark.parametrize("kind", ["freeze", "init"])
def test_surgeries_changing_the_same_tensor_must_come_off_in_reverse(kind: str, tiny: TinyNet) -> None:
    before = Snapshot.of(tiny)
    first = surgery.apply(tiny, {"a": CHANGES[kind]("fc")})
    second = surgery.apply(tiny, {"b": CHANGES[kind]("fc")})
    with pytest.raises(ActionError, match=r"^remove the later surgery first \(b\)"):
        first.remove()
    second.remove()
    first.remove()
    before.assert_same(tiny)


# ---------------------------------------------------------------- paused(): hooks out and back, exactly


def test_paused_twice_turns_the_hooks_off_both_times(tiny: TinyNet, x_img) -> None:
    plain = out_and_grads(tiny, x_img)
    s = surgery.apply(tiny, {"out": HALF, "in": PLUS, "grad": TRIPLE_GRAD})
    surgered = out_and_grads(tiny, x_img)
    assert not same(surgered, plain)
    for _ in range(2):
        with s.paused():
            assert same(out_and_grads(tiny, x_img), plain)
        assert same(out_and_grads(tiny, x_img), surgered)
    s.remove()
    assert same(out_and_grads(tiny, x_img), plain)


def test_paused_puts_back_every_hook_dict_exactly_around_the_users_changes(tiny: TinyNet, x_img) -> None:
    kept = tiny.fc.register_forward_hook(lambda *a: None)
    dropped = tiny.fc.register_forward_hook(lambda *a: None)
    s = surgery.apply(tiny, {"out": HALF, "in": PLUS, "grad": TRIPLE_GRAD, "cap": {"kind": "capture", "select": "fc"}})
    tensor_hooks = list(tiny.fc.weight._backward_hooks.items())
    fc_hooks = list(tiny.fc._forward_hooks.items())
    facts = {name: module_facts(m) for name, m in tiny.named_modules()}
    with s.paused():
        assert list(tiny.fc._forward_hooks) == [kept.id, dropped.id] and not tiny.fc.weight._backward_hooks
        dropped.remove()
        added = tiny.fc.register_forward_hook(lambda *a: None)
    expected = [(k, f) for k, f in fc_hooks if k != dropped.id] + [(added.id, tiny.fc._forward_hooks[added.id])]
    assert list(tiny.fc._forward_hooks.items()) == expected  # ours in place, the user's new one after
    facts["fc"]["_forward_hooks"] = hook_attr(dict(expected))
    assert {name: module_facts(m) for name, m in tiny.named_modules()} == facts  # every other dict as it was
    assert list(tiny.fc.weight._backward_hooks.items()) == tensor_hooks
    kept.remove()
    added.remove()
    s.remove()


def test_paused_skips_a_hook_the_user_already_took_out(tiny: TinyNet, x_img) -> None:
    plain = out_and_grads(tiny, x_img)
    s = surgery.apply(tiny, {"in": PLUS, "out": HALF})  # conv's hook is registered first
    tiny.conv._forward_pre_hooks.clear()  # e.g. a library clearing a module's hooks by hand
    with s.paused():  # fc's hook still comes out
        assert same(out_and_grads(tiny, x_img), plain)
    assert not tiny.conv._forward_pre_hooks and len(tiny.fc._forward_hooks) == 1
    s.remove()
    assert same(out_and_grads(tiny, x_img), plain)


# ---------------------------------------------------------------- stop: an instance forward over the class's


def stop_action() -> dict[str, Any]:
    return {"kind": "capture", "select": "pool", "stop": True}


def test_stop_leaves_forward_as_the_class_method_after_remove(tiny: TinyNet, x_img) -> None:
    expected = tiny(x_img)
    before = Snapshot.of(tiny)
    with surgery.apply(tiny, {"s": stop_action()}) as s:
        assert "forward" in vars(tiny) and tiny(x_img) is None
        assert torch.equal(
            s.captures["s"]["pool"].output, F.adaptive_avg_pool2d(F.relu(tiny.norm(tiny.conv(x_img))), 2)
        )
    assert "forward" not in vars(tiny)
    before.assert_same(tiny)
    assert torch.equal(tiny(x_img), expected)


def test_stop_puts_back_the_users_own_instance_forward(tiny: TinyNet, x_img) -> None:
    calls: list[int] = []

    def logged(self: TinyNet, x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return TinyNet.forward(self, x)

    mine = types.MethodType(logged, tiny)
    tiny.forward = mine  # type: ignore[method-assign]  # e.g. a library wrapping forward on the instance
    with surgery.apply(tiny, {"s": stop_action()}):
        assert tiny(x_img) is None and calls == [1]
    assert vars(tiny)["forward"] is mine
    tiny(x_img)
    assert calls == [1, 1]


def test_remove_is_clean_when_the_user_already_deleted_the_stop_wrapper(tiny: TinyNet, x_img) -> None:
    before = Snapshot.of(tiny)
    s = surgery.apply(tiny, {"s": stop_action()})
    del tiny.forward
    s.remove()
    assert "forward" not in vars(tiny)
    before.assert_same(tiny)


# ---------------------------------------------------------------- the ledger's own calls (its natural unit)


def test_set_attr_deletes_an_attribute_that_was_not_there(tiny: TinyNet) -> None:
    ledger = Ledger()
    ledger.set_attr(tiny.fc, "flag", 1)
    ledger.set_attr(tiny.fc.bias, "requires_grad", False)
    assert tiny.fc.flag == 1 and not tiny.fc.bias.requires_grad
    assert ledger.rollback() == []
    assert not hasattr(tiny.fc, "flag") and tiny.fc.bias.requires_grad


def test_add_tensor_defaults_to_a_persistent_buffer_and_wraps_a_plain_parameter(tiny: TinyNet) -> None:
    before = Snapshot.of(tiny)
    ledger = Ledger()
    values = torch.arange(3.0)
    ledger.add_tensor(tiny.fc, "kept", values.clone(), "buffers")
    ledger.add_tensor(tiny.fc, "gain", values.clone(), "parameters")
    assert "fc.kept" in tiny.state_dict() and not tiny.fc._non_persistent_buffers_set
    assert type(tiny.fc.gain) is nn.Parameter and torch.equal(tiny.fc.gain.detach(), values)
    assert ledger.rollback() == []
    before.assert_same(tiny)


def test_overwrite_with_values_writes_them_and_undo_restores(tiny: TinyNet) -> None:
    before = Snapshot.of(tiny)
    ledger = Ledger()
    ledger.overwrite(tiny.fc.bias, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(tiny.fc.bias.detach(), torch.tensor([1.0, 2.0, 3.0]))
    assert ledger.rollback() == []
    before.assert_same(tiny)
    assert ledger.originals == {}  # a copy of the old values is kept past rollback only when asked (verify)


def test_swap_child_names_the_parent_class_and_the_missing_child(tiny: TinyNet) -> None:
    with pytest.raises(KeyError) as info:
        Ledger().swap_child(tiny, "nope", nn.ReLU())
    assert info.value.args == ("TinyNet has no child module 'nope'",)


def test_hook_takes_any_register_callable_and_passes_its_options(tiny: TinyNet, x_img) -> None:
    before = Snapshot.of(tiny)
    order: list[str] = []
    user = tiny.fc.register_forward_pre_hook(lambda *a: order.append("user"))
    ledger = Ledger()
    ledger.action = "a"
    ledger.hook(tiny.fc.register_forward_pre_hook, lambda *a: order.append("first"), prepend=True)
    ledger.hook(partial(tiny.fc.register_forward_pre_hook), lambda *a: order.append("last"))  # no __self__
    ledger.hook(tiny.fc.register_full_backward_pre_hook, lambda *a: order.append("grad last"))
    ledger.hook(tiny.fc.register_full_backward_pre_hook, lambda *a: order.append("grad first"), True)  # prepend
    assert ledger.hook_count == {"a": 4}
    run_both(tiny, x_img)
    assert order == ["first", "user", "last", "grad first", "grad last"]
    assert ledger.rollback() == []
    user.remove()
    before.assert_same(tiny)
