"""Every registered kind honours the contract: plan → apply → forward+backward → remove → identical."""

from __future__ import annotations

import pytest
import torch

import surgery
from surgery.actions import KINDS
from tests.conftest import Snapshot, TinyNet, run_both

# one representative config per kind (several for kinds with two mechanisms)
CASES = {
    "init": {"kind": "init", "type": "Conv2d", "param": "weight", "method": "kaiming_normal"},
    "add_parameter": {"kind": "add_parameter", "select": "fc", "name": "scale", "like": "bias",
                      "init": {"method": "ones"}},
    "add_buffer": {"kind": "add_buffer", "select": "conv", "name": "mask", "shape": [4], "init": {"method": "ones"}},
    "freeze": {"kind": "freeze", "select": ["conv", "fc"], "param": "*"},
    "unfreeze": {"kind": "unfreeze", "select": "norm", "param": "weight"},
    "replace_forward": {"kind": "replace_forward", "type": "ReLU", "expr": "x * sigmoid(x)"},
    "modify_output": {"kind": "modify_output", "select": "conv", "op": "mul", "value": 0.5, "index": "[:, :2]"},
    "modify_input": {"kind": "modify_input", "select": "fc", "op": "noise", "std": 0.1},
    "capture": {"kind": "capture", "select": "**", "type": ["Conv2d", "Linear"], "what": ["input", "output"]},
    "capture_grad": {"kind": "capture_grad", "select": "fc"},
    "capture_grad/param": {"kind": "capture_grad", "select": "conv", "param": "weight"},
    "modify_grad": {"kind": "modify_grad", "select": "pool", "op": "clip_value", "value": 0.01},
    "modify_grad/param": {"kind": "modify_grad", "type": "Linear", "param": "*", "op": "clip_norm", "max_norm": 0.1},
    "log": {"kind": "log", "type": ["Conv2d", "Linear"]},
    "replace_module": {"kind": "replace_module", "type": "ReLU", "with": {"_target_": "torch.nn.GELU"}},
    "on_load": {"kind": "on_load", "rename": {"old_fc.*": "fc.*"}},
}  # fmt: skip


def test_every_registered_kind_has_a_contract_case() -> None:
    covered = {key.split("/")[0] for key in CASES}
    assert covered == set(KINDS.names())


@pytest.mark.parametrize("case", sorted(CASES))
def test_contract(case: str, tiny: TinyNet, x_img: torch.Tensor) -> None:
    tiny.norm.weight.requires_grad_(False)  # so unfreeze has something to change
    before = Snapshot.of(tiny)
    reference = tiny(x_img).detach()
    plan = surgery.plan(tiny, {"act": CASES[case]})
    before.assert_same(tiny)  # planning touches nothing
    with surgery.apply(tiny, plan) as s:
        out = run_both(tiny, x_img)
        assert torch.isfinite(out).all()
        assert sum(s.hook_count.values()) >= (0 if plan.steps[0].mechanism == "apply pass" else 1)
    before.assert_same(tiny)
    assert torch.equal(tiny(x_img).detach(), reference)
    tiny.zero_grad(set_to_none=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_contract_twice_in_a_row(case: str, tiny: TinyNet, x_img: torch.Tensor) -> None:
    """Applying, removing and applying again gives the same output both times."""
    outs = []
    for _ in range(2):
        with surgery.apply(tiny, {"act": CASES[case]}):
            outs.append(tiny(x_img).detach())
    assert torch.equal(outs[0], outs[1])
