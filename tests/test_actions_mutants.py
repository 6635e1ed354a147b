"""``init`` and the modify ops, pinned where mutation testing found nothing watching.

Each test asserts what a user sees (numbers against plain ``torch.nn.init`` / torch under the same generator,
bit for bit; the plan table; the exact refusal) for a case the broader tables did not reach: draws that the
truncation bounds redraw, 5- and 6-D ``dirac``, integer parameters, ``allow_empty``, FSDP1/FSDP2 models, an
``index`` that stops fitting, ``module`` reads under ``index``, ``clip_norm`` below its bound, ``mean_ablate`` over
several dims or the last one, and noise under activation checkpointing.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import init
from torch.utils.checkpoint import checkpoint

import surgery
from surgery.actions.base import seed_for
from surgery.actions.noise import noise_stream
from surgery.errors import ActionError, ConfigError


def generator(seed: int, action: str) -> torch.Generator:
    """The generator init draws from, rebuilt from the documented rule (sha256 of "seed/action")."""
    digest = hashlib.sha256(f"{seed}/{action}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def fill(model: nn.Module, select: str, param: str, seed: int = 5, **args: Any) -> torch.Tensor:
    """The parameter after an ``init`` action named ``fill``, while applied."""
    with surgery.apply(model, {"fill": {"kind": "init", "select": select, "param": param, **args}}, seed=seed):
        return model.get_submodule(select).get_parameter(param).detach().clone()


class Holder(nn.Module):
    """A module with one parameter of any shape and dtype."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(tensor, requires_grad=tensor.is_floating_point())


# ---- init


def test_init_plan_table_and_dict_name_the_action_kind_mechanism_and_tensors() -> None:
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
    plan = surgery.plan(model, {"fill": {"kind": "init", "select": "*", "param": "weight", "method": "zeros"}})
    assert str(plan).splitlines() == [
        "action  kind  mechanism   n  matched",
        "-" * 47,
        "fill    init  apply pass  2  0.weight, 2.weight",
    ]
    assert plan.to_dict() == [
        {
            "action": "fill",
            "kind": "init",
            "mechanism": "apply pass",
            "enabled": True,
            "matched": ["0", "2"],
            "matched_real": ["0", "2"],
            "tensors": ["0.weight", "2.weight"],
        }
    ]
    assert plan.steps[0].config.method == "zeros" and plan.steps[0].config.param == "weight"


def test_trunc_normal_defaults_redraw_outside_minus_two_two_as_torch_does() -> None:
    # 4096 standard normal draws: some fall in [-3, -2) and (2, 3], which bounds (-2, 2) redraw and wider ones keep
    got = fill(nn.Sequential(nn.Linear(64, 64)), "0", "weight", method="trunc_normal")
    want = torch.empty(64, 64)
    init.trunc_normal_(want, 0.0, 1.0, -2.0, 2.0, generator=generator(5, "fill"))
    assert torch.equal(got, want)
    assert -2.0 <= float(got.min()) < -1.9 and 1.9 < float(got.max()) <= 2.0


def test_dirac_fills_a_5d_conv3d_weight() -> None:
    got = fill(nn.Sequential(nn.Conv3d(2, 3, 3)), "0", "weight", method="dirac")
    want = torch.empty(3, 2, 3, 3, 3)
    init.dirac_(want)
    assert torch.equal(got, want)


def test_dirac_on_a_6d_tensor_is_refused_at_plan_time() -> None:
    model = nn.Sequential(Holder(torch.zeros(2, 2, 1, 1, 1, 1)))
    with pytest.raises(ConfigError) as caught:
        surgery.plan(model, {"fill": {"kind": "init", "select": "0", "param": "w", "method": "dirac"}})
    assert str(caught.value) == (
        "actions.fill.method (0.w): method 'dirac' needs a 3-, 4- or 5-D tensor, this one has shape [2, 2, 1, 1, 1, 1]"
    )


def test_init_of_an_integer_parameter_is_refused_at_plan_time() -> None:
    model = nn.Sequential(Holder(torch.zeros(3, dtype=torch.int64)))
    with pytest.raises(ConfigError) as caught:
        surgery.plan(model, {"fill": {"kind": "init", "select": "0", "param": "w", "method": "normal"}})
    assert str(caught.value) == (
        "actions.fill.method (0.w): method 'normal' needs a floating-point tensor, this one is torch.int64"
    )


def test_init_with_allow_empty_plans_a_param_glob_that_matches_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    action = {"kind": "init", "select": "0", "param": "gamma", "method": "zeros"}
    with pytest.raises(surgery.NoMatchError):
        surgery.plan(model, {"fill": action})
    before = model[0].weight.detach().clone()
    plan = surgery.plan(model, {"fill": {**action, "allow_empty": True}})
    assert plan.to_dict()[0]["tensors"] == []
    with surgery.apply(model, plan):
        assert torch.equal(model[0].weight, before)


def test_init_failing_at_apply_names_the_tensor_and_changes_nothing() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    plan = surgery.plan(model, {"fill": {"kind": "init", "select": "0", "param": "weight", "method": "eye"}})
    model[0].weight = nn.Parameter(torch.ones(2, 3, 4))  # eye_ takes 2-D only: checked at plan time, not now
    with pytest.raises(ActionError) as caught:
        surgery.apply(model, plan)
    assert str(caught.value) == (
        "actions.fill: failed on '0.weight': ValueError: Only tensors with 2 dimensions are supported."
        " Nothing was changed."
    )
    assert torch.equal(model[0].weight, torch.ones(2, 3, 4))


def test_init_under_fsdp1_is_refused_naming_the_key_kind_and_module(gloo_group: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1 is deprecated
        model = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 8)), use_orig_params=True, device_id="cpu")
    with pytest.raises(ConfigError) as caught:
        surgery.plan(model, {"fill": {"kind": "init", "select": "*", "param": "weight", "method": "zeros"}})
    assert str(caught.value).startswith(
        "actions.fill.param: init on '0' cannot be honoured under FSDP1 (FullyShardedDataParallel): it flattens"
    )


def test_init_under_fsdp2_draws_the_whole_tensor_as_unsharded_torch_does(gloo_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    with surgery.apply(model, {"fill": {"kind": "init", "select": "0", "param": "weight", "method": "normal"}}, seed=3):
        got = model[0].weight.full_tensor().detach().clone()
    want = torch.empty(8, 4)
    init.normal_(want, generator=generator(3, "fill"))
    assert torch.equal(got, want)


# ---- ops


def identity_output(action: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    """What ``nn.Identity`` returns for ``x`` under a ``modify_output`` action named ``m``."""
    model = nn.Sequential(nn.Identity())
    with surgery.apply(model, {"m": {"kind": "modify_output", "select": "0", **action}}):
        return model(x)


def test_an_index_that_does_not_fit_the_output_names_the_index_and_shape() -> None:
    with pytest.raises(ActionError) as caught:
        identity_output({"op": "add", "value": 1.0, "index": "[:, 5]"}, torch.zeros(2, 4))
    assert str(caught.value) == (
        "actions.m.index on module '0': [:, 5] does not fit a tensor of shape [2, 4]:"
        " index 5 is out of bounds for dimension 1 with size 4"
    )


def test_an_expression_under_index_reads_the_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3))
    x = torch.randn(2, 3)
    action = {"kind": "modify_output", "select": "0", "op": "expr", "expr": "output * module.weight[0, 0]"}
    with surgery.apply(model, {"m": {**action, "index": "[:, 1:]"}}):
        got = model(x).detach()
    with torch.no_grad():
        want = model[0](x)
        want[:, 1:] = want[:, 1:] * model[0].weight[0, 0]
    assert torch.equal(got, want)


def test_clip_norm_leaves_a_gradient_already_below_the_bound() -> None:
    model = nn.Sequential(nn.Identity())
    x = torch.tensor([0.3, -0.4], requires_grad=True)  # the gradient is [0.3, -0.4] of norm 0.5
    with surgery.apply(model, {"c": {"kind": "modify_grad", "select": "0", "op": "clip_norm", "max_norm": 2.0}}):
        (model(x) * torch.tensor([0.3, -0.4])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.3, -0.4]))


@pytest.mark.parametrize("dim", [[0, 1], 1, -1])
def test_mean_ablate_over_several_dims_or_the_last_keeps_the_shape(dim: Any) -> None:
    x = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    got = identity_output({"op": "mean_ablate", "dim": dim}, x)
    dims = tuple(dim) if isinstance(dim, list) else (dim,)
    assert torch.equal(got, x.mean(dims, keepdim=True).expand_as(x))


def test_noise_adds_the_actions_stream() -> None:
    x = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, -8.0]])
    model = nn.Sequential(nn.Identity())
    with surgery.apply(model, {"m": {"kind": "modify_output", "select": "0", "op": "noise", "std": 0.5}}, seed=9):
        first, second = model(x), model(x)
    draw = noise_stream(seed_for(9, "m"), 0.5)
    assert torch.equal(first, x + draw(x)) and torch.equal(second, x + draw(x))


def test_noise_on_two_modules_under_checkpointing_gives_the_gradients_of_a_plain_run() -> None:
    # each module keeps its own replay memory: a shared one would hand A's recomputation B's noise
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4)
    action = {"n": {"kind": "modify_output", "type": "Linear", "op": "noise", "std": 0.7}}
    grads = []
    for checkpointed in (False, True):
        model.zero_grad()
        with surgery.apply(model, action, seed=1):
            out = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
            (out * torch.arange(12.0).view(3, 4)).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
