"""Parameter-level kinds on FSDP2, FSDP1 and DDP models (SPEC §10), in this process on a gloo group of one rank.

tests/test_sharded.py runs the same scenarios on two ranks under torchrun; these run in-process so that
what they check is seen by the mutation run too. References are plain PyTorch on the unsharded model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import surgery
from surgery.errors import ConfigError, NoMatchError
from tests.conftest import fully_shard_one_rank

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

FSDP1_REFUSAL = (
    " cannot be honoured under FSDP1 (FullyShardedDataParallel): it flattens parameters into one FlatParameter, so"
    " per-parameter values and gradient hooks are not the ones autograd and the optimizer use; shard with FSDP2"
    " (torch.distributed.fsdp.fully_shard), or apply before wrapping"
)
FLAT_HINT = (
    " FSDP1 (FullyShardedDataParallel) with use_orig_params=False keeps parameters only as a flattened _flat_param;"
    " wrap with use_orig_params=True or FSDP2 fully_shard to reach them by name."
)


def net() -> nn.Sequential:
    """The same float64 MLP every call (float64 so that a draw made in the default dtype would differ)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()


def fsdp2(model: nn.Module) -> nn.Module:
    """``model`` under ``fully_shard``: each Linear, then the root, on a CPU mesh of one rank."""
    return fully_shard_one_rank(model, (model[0], model[2]))


def fsdp1(use_orig_params: bool) -> nn.Module:
    """``net()`` under FSDP1 (deprecated, so its warning is silenced)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FullyShardedDataParallel(net(), use_orig_params=use_orig_params, device_id="cpu")


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as the whole logical tensor, detached."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[operator]


def x_in() -> torch.Tensor:
    return torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


INIT = {"i": {"kind": "init", "select": "0", "param": "weight", "method": "normal"}}


def test_fsdp2_seeded_init_equals_the_unsharded_draw_and_remove_restores(gloo_group: None) -> None:
    reference = net()
    surgery.apply(reference, INIT, seed=3)
    model = fsdp2(net())
    before = full(model)
    done = surgery.apply(model, INIT, seed=3, verify=True)
    after = full(model)
    assert torch.equal(after["0.weight"], reference[0].weight.detach())
    assert all(torch.equal(after[n], before[n]) for n in before if n != "0.weight")
    done.remove()
    assert all(torch.equal(t, before[n]) for n, t in full(model).items())


@pytest.mark.parametrize("forward_first", [False, True])
def test_fsdp2_gradient_hooks_act_on_the_gradient_autograd_uses(gloo_group: None, forward_first: bool) -> None:
    plain = net()
    plain(x_in()).sum().backward()
    model = fsdp2(net())
    if forward_first:  # FSDP2 already made its unsharded parameters
        model(x_in()).sum().backward()
        model.zero_grad()
    actions = {
        "g": {"kind": "modify_grad", "select": "0", "param": "weight", "op": "mul", "value": 2.0},
        "c": {"kind": "capture_grad", "select": "0", "param": "weight"},
    }
    done = surgery.apply(model, actions)
    model(x_in()).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    assert torch.equal(grads["0.weight"], 2 * plain[0].weight.grad)  # type: ignore[operator]
    assert torch.equal(grads["0.bias"], plain[0].bias.grad)  # type: ignore[arg-type]
    assert torch.equal(grads["2.weight"], plain[2].weight.grad)  # type: ignore[arg-type]
    captured = done.captures["c"]["0.weight"].calls[-1].grad
    assert torch.equal(captured, 2 * plain[0].weight.grad)  # type: ignore[operator]
    done.remove()
    model.zero_grad()
    model(x_in()).sum().backward()  # the hooks are gone
    assert torch.equal(model[0].weight.grad.full_tensor(), plain[0].weight.grad)  # type: ignore[union-attr]


def test_fsdp2_replace_forward_linear_reads_the_whole_weight(gloo_group: None) -> None:
    model = fsdp2(net())
    with torch.no_grad():
        want = net()(x_in())
        model(x_in())  # FSDP2 sets itself up (adds its state-dict hooks) at the first forward, not during surgery
    done = surgery.apply(model, {"r": {"kind": "replace_forward", "select": "0", "fn": "linear"}}, verify=True)
    got = model(x_in())
    done.remove()
    assert torch.equal(got.detach(), want)


@pytest.mark.parametrize(
    ("action", "where", "what"),
    [
        ({"kind": "init", "select": "0", "param": "weight", "method": "zeros"}, "actions.a.param", "init on '0'"),
        ({"kind": "capture_grad", "select": "0", "param": "weight"}, "actions.a.param", "a gradient hook on '0'"),
        (
            {"kind": "modify_grad", "select": "2", "param": "*", "op": "zero"},
            "actions.a.param",
            "a gradient hook on '2'",
        ),
    ],
)
def test_fsdp1_per_parameter_kinds_are_refused_at_plan_time(
    gloo_group: None, action: dict, where: str, what: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        surgery.plan(fsdp1(use_orig_params=True), {"a": action})
    assert str(caught.value) == f"{where}: {what}{FSDP1_REFUSAL}"


def test_fsdp1_module_hooks_are_not_refused(gloo_group: None) -> None:
    plan = surgery.plan(fsdp1(use_orig_params=True), {"h": {"kind": "capture", "select": "0"}})
    assert plan.to_dict()[0]["matched"] == ["0"]


@pytest.mark.parametrize(("use_orig_params", "hint"), [(True, ""), (False, FLAT_HINT)])
def test_fsdp1_flat_parameters_are_named_in_the_no_match_error(
    gloo_group: None, use_orig_params: bool, hint: str
) -> None:
    with pytest.raises(NoMatchError) as caught:
        surgery.plan(fsdp1(use_orig_params), {"c": {"kind": "capture_grad", "select": "0", "param": "nope"}})
    closest = " Closest parameter names: bias, weight." if use_orig_params else ""
    assert str(caught.value) == (
        f"actions.c.param: 'nope' matched no parameter of the 1 selected module(s).{closest}{hint}"
        " Set allow_empty: true if that is expected."
    )


DDP_ACTIONS = {
    "f": {"kind": "freeze", "select": "0", "param": "weight"},
    "off": {"kind": "freeze", "select": "2", "enabled": False},
    "a": {"kind": "add_parameter", "select": "2", "name": "gate", "shape": [2]},
    "r": {"kind": "replace_module", "select": "1", "with": {"_target_": "torch.nn.GELU"}},
    "c": {"kind": "capture", "select": "0"},
}


def test_ddp_changes_to_the_parameter_set_warn_at_plan_time(gloo_group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    assert surgery.plan(net(), DDP_ACTIONS).warnings == []
    assert surgery.plan(nn.Sequential(DistributedDataParallel(net())), {}).warnings == []
    assert surgery.plan(DistributedDataParallel(net()), DDP_ACTIONS).warnings == [
        "actions.f (freeze) on a DDP-wrapped model: DDP expects a gradient for every parameter it saw at wrapping, so"
        " the next step fails; apply it before wrapping in DistributedDataParallel, or wrap with"
        " find_unused_parameters=True",
        "actions.a (add_parameter) on a DDP-wrapped model: DDP does not all-reduce a parameter added after wrapping,"
        " so its gradient differs across ranks; apply it before wrapping in DistributedDataParallel",
        "actions.r (replace_module) on a DDP-wrapped model: DDP still reduces the replaced module's parameters, so the"
        " next step fails; apply it before wrapping in DistributedDataParallel",
    ]


def test_a_torch_without_distributed_still_inits_a_plain_model(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = net()
    surgery.apply(reference, INIT, seed=3)
    monkeypatch.setattr(dist, "is_available", lambda: False)  # as on a torch built without torch.distributed
    model = net()
    surgery.apply(model, INIT, seed=3)
    assert torch.equal(model[0].weight, reference[0].weight)


class FullyShardedDataParallel(nn.Module):
    """A wrapper named like torch's FSDP1 but without its ``_use_orig_params`` (as fairscale's FSDP)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def test_fsdp1_by_name_a_foreign_wrapper_is_managed_and_gets_no_use_orig_params_hint() -> None:
    from surgery.actions.sharded import fsdp1_flattened, fsdp1_hint

    plain = nn.Sequential(nn.Linear(2, 2))
    assert fsdp1_flattened(plain) == (set(), False)
    wrapped = nn.Sequential(FullyShardedDataParallel(nn.Linear(2, 2)))
    managed, flat_only = fsdp1_flattened(wrapped)
    assert managed == {id(wrapped[0]), id(wrapped[0].inner)} and flat_only is False
    assert fsdp1_hint(wrapped) == ""
    with pytest.raises(ConfigError, match="cannot be honoured under FSDP1"):
        surgery.plan(wrapped, {"z": {"kind": "init", "select": "0.inner", "param": "weight", "method": "zeros"}})
