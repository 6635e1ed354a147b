"""The messages of ``Surgery.remove``: what a user reads when removal cannot be checked or is not exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ActionError

DOUBLE_FIRST = {"a": {"kind": "modify_output", "select": "0", "op": "mul", "value": 2.0}}


def test_verify_at_remove_needs_verify_at_apply_and_removes_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    s = surgery.apply(model, DOUBLE_FIRST)
    with pytest.raises(ActionError) as info:
        s.remove(verify=True)
    assert str(info.value) == (
        "remove(verify=True): this surgery was applied without verify; apply it with verify=True to keep"
        " the state to compare with"
    )
    assert s.active and len(model[0]._forward_hooks) == 1  # refused before anything was undone
    s.remove()
    assert not model[0]._forward_hooks


def test_a_hook_the_user_left_on_seven_modules_names_five_and_counts_the_rest() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(7)))
    s = surgery.apply(model, DOUBLE_FIRST, verify=True)
    for layer in model:
        layer.register_forward_hook(lambda *args: None)
    with pytest.raises(ActionError) as info:
        s.remove()
    message = str(info.value)
    assert message.startswith("remove: the model is not restored exactly: module 0: _forward_hooks was (")
    parts = message.removeprefix("remove: the model is not restored exactly: ").split("; ")
    assert [p.split(":")[0] for p in parts] == [f"module {i}" for i in range(5)]
    assert parts[-1].endswith(" (and 2 more)")
    assert "train" not in message  # no hint: nothing was written


def test_six_differences_say_one_more_and_five_say_nothing_more() -> None:
    for count, tail in ((6, " (and 1 more)"), (5, ")")):
        model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(count)))
        s = surgery.apply(model, DOUBLE_FIRST, verify=True)
        for layer in model:
            layer.register_forward_hook(lambda *args: None)
        with pytest.raises(ActionError) as info:
            s.remove()
        assert str(info.value).endswith(tail) and "more" not in str(info.value).removesuffix(tail)


def test_a_tensor_written_in_place_gets_the_training_hint() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    s = surgery.apply(model, DOUBLE_FIRST, verify=True)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(ActionError) as info:
        s.remove()
    assert str(info.value) == (
        "remove: the model is not restored exactly: tensor 0.weight: written in place while the surgery was applied"
        " and not restored (a model trained, or run in train mode, while the surgery was applied changes its tensors)"
    )


def test_verify_false_skips_the_check_of_a_verified_surgery() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    s = surgery.apply(model, DOUBLE_FIRST, verify=True)
    model[1].register_forward_hook(lambda *args: None)
    s.remove(verify=False)
    assert not s.active and not model[0]._forward_hooks


def test_a_weight_holding_nan_is_restored_and_verified_bit_for_bit() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    with torch.no_grad():
        model[0].weight[1, 2] = float("nan")
    before = model[0].weight.detach().clone()
    s = surgery.apply(model, {"z": {"kind": "init", "select": "0", "param": "weight", "method": "zeros"}}, verify=True)
    assert torch.equal(model[0].weight, torch.zeros(2, 3))
    s.remove()  # NaN != NaN must not read as "values differ"
    after = model[0].weight.detach()
    assert torch.equal(after.isnan(), before.isnan()) and after.isnan().sum() == 1
    assert torch.equal(after.view(torch.int32), before.view(torch.int32))
