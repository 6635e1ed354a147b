"""``init`` fills each tensor exactly as ``torch.nn.init`` does under the same generator, argument by argument."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import init

import surgery

SEED = 11


def generator(seed: int, action: str) -> torch.Generator:
    """The generator init draws from, rebuilt here from the documented rule (sha256 of "seed/action")."""
    digest = hashlib.sha256(f"{seed}/{action}".encode()).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return gen


def by_surgery(model: nn.Module, select: str, param: str, args: dict[str, Any], seed: int = SEED) -> torch.Tensor:
    action = {"fill": {"kind": "init", "select": select, "param": param, **args}}
    with surgery.apply(model, action, seed=seed):
        return model.get_submodule(select).get_parameter(param).detach().clone()


def by_hand(shape: tuple[int, ...], call: Any, seed: int = SEED) -> torch.Tensor:
    expected = torch.full(shape, 7.0)  # a value no method leaves by chance
    call(expected, generator(seed, "fill"))
    return expected


# (surgery arguments, the same fill in plain torch). A 4x6 weight: fan_in 6 and fan_out 4 differ, so mode shows.
LINEAR_CASES: list[tuple[dict[str, Any], Any]] = [
    ({"method": "constant", "value": -0.375}, lambda t, g: init.constant_(t, -0.375)),
    ({"method": "zeros"}, lambda t, g: init.zeros_(t)),
    ({"method": "ones"}, lambda t, g: init.ones_(t)),
    ({"method": "normal"}, lambda t, g: init.normal_(t, 0.0, 1.0, generator=g)),
    ({"method": "normal", "mean": 2.0, "std": 0.25}, lambda t, g: init.normal_(t, 2.0, 0.25, generator=g)),
    ({"method": "uniform"}, lambda t, g: init.uniform_(t, 0.0, 1.0, generator=g)),
    ({"method": "uniform", "a": -3.0, "b": -1.0}, lambda t, g: init.uniform_(t, -3.0, -1.0, generator=g)),
    ({"method": "trunc_normal"}, lambda t, g: init.trunc_normal_(t, 0.0, 1.0, -2.0, 2.0, generator=g)),
    (
        {"method": "trunc_normal", "mean": 0.5, "std": 2.0, "a": -0.5, "b": 1.0},
        lambda t, g: init.trunc_normal_(t, 0.5, 2.0, -0.5, 1.0, generator=g),
    ),
    ({"method": "xavier_uniform"}, lambda t, g: init.xavier_uniform_(t, 1.0, generator=g)),
    ({"method": "xavier_uniform", "gain": 2.5}, lambda t, g: init.xavier_uniform_(t, 2.5, generator=g)),
    ({"method": "xavier_normal"}, lambda t, g: init.xavier_normal_(t, 1.0, generator=g)),
    ({"method": "xavier_normal", "gain": 0.5}, lambda t, g: init.xavier_normal_(t, 0.5, generator=g)),
    ({"method": "kaiming_uniform"}, lambda t, g: init.kaiming_uniform_(t, 0.0, "fan_in", "leaky_relu", generator=g)),
    (
        {"method": "kaiming_uniform", "a": 0.3},
        lambda t, g: init.kaiming_uniform_(t, 0.3, "fan_in", "leaky_relu", generator=g),
    ),
    (
        {"method": "kaiming_uniform", "mode": "fan_out"},
        lambda t, g: init.kaiming_uniform_(t, 0.0, "fan_out", "leaky_relu", generator=g),
    ),
    (
        {"method": "kaiming_uniform", "nonlinearity": "tanh"},
        lambda t, g: init.kaiming_uniform_(t, 0.0, "fan_in", "tanh", generator=g),
    ),
    (
        {"method": "kaiming_uniform", "a": 2.0, "mode": "fan_out", "nonlinearity": "leaky_relu"},
        lambda t, g: init.kaiming_uniform_(t, 2.0, "fan_out", "leaky_relu", generator=g),
    ),
    ({"method": "kaiming_normal"}, lambda t, g: init.kaiming_normal_(t, 0.0, "fan_in", "leaky_relu", generator=g)),
    (
        {"method": "kaiming_normal", "a": 0.3},
        lambda t, g: init.kaiming_normal_(t, 0.3, "fan_in", "leaky_relu", generator=g),
    ),
    (
        {"method": "kaiming_normal", "mode": "fan_out"},
        lambda t, g: init.kaiming_normal_(t, 0.0, "fan_out", "leaky_relu", generator=g),
    ),
    (
        {"method": "kaiming_normal", "nonlinearity": "relu"},
        lambda t, g: init.kaiming_normal_(t, 0.0, "fan_in", "relu", generator=g),
    ),
    (
        {"method": "kaiming_normal", "nonlinearity": "selu", "mode": "fan_out"},
        lambda t, g: init.kaiming_normal_(t, 0.0, "fan_out", "selu", generator=g),
    ),
    ({"method": "orthogonal"}, lambda t, g: init.orthogonal_(t, 1.0, generator=g)),
    ({"method": "orthogonal", "gain": 3.0}, lambda t, g: init.orthogonal_(t, 3.0, generator=g)),
]


def case_id(case: tuple[dict[str, Any], Any]) -> str:
    return "-".join(f"{k}={v}" for k, v in case[0].items() if k != "method") or "defaults"


def ids(cases: list[tuple[dict[str, Any], Any]]) -> list[str]:
    return [f"{c[0]['method']}[{case_id(c)}]" for c in cases]


@pytest.mark.parametrize(("args", "call"), LINEAR_CASES, ids=ids(LINEAR_CASES))
def test_init_on_a_linear_weight_equals_nn_init_bit_for_bit(args: dict[str, Any], call: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    got = by_surgery(model, "0", "weight", args)
    assert torch.equal(got, by_hand((4, 6), call))


CONV_CASES: list[tuple[dict[str, Any], Any]] = [
    ({"method": "dirac"}, lambda t, g: init.dirac_(t)),
    ({"method": "kaiming_normal", "mode": "fan_out", "nonlinearity": "conv2d"},
     lambda t, g: init.kaiming_normal_(t, 0.0, "fan_out", "conv2d", generator=g)),
    ({"method": "xavier_uniform", "gain": 1.5}, lambda t, g: init.xavier_uniform_(t, 1.5, generator=g)),
    ({"method": "orthogonal"}, lambda t, g: init.orthogonal_(t, 1.0, generator=g)),
]  # fmt: skip


@pytest.mark.parametrize(("args", "call"), CONV_CASES, ids=ids(CONV_CASES))
def test_init_on_a_conv_weight_equals_nn_init_bit_for_bit(args: dict[str, Any], call: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 5, 3))  # weight 5x2x3x3: receptive field counts in the fans
    got = by_surgery(model, "0", "weight", args)
    assert torch.equal(got, by_hand((5, 2, 3, 3), call))


def test_init_eye_on_a_non_square_weight() -> None:
    model = nn.Sequential(nn.Linear(6, 4))
    got = by_surgery(model, "0", "weight", {"method": "eye"})
    assert torch.equal(got, torch.eye(4, 6))


def test_init_dirac_on_conv1d_with_more_outputs_than_inputs() -> None:
    model = nn.Sequential(nn.Conv1d(2, 3, 3))
    got = by_surgery(model, "0", "weight", {"method": "dirac"})
    expected = torch.zeros(3, 2, 3)
    expected[0, 0, 1] = expected[1, 1, 1] = 1.0
    assert torch.equal(got, expected)


def test_init_draws_each_module_in_turn_from_one_generator_per_action() -> None:
    """Two selected modules: the second continues the first's stream (visited in module order)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 5))
    action = {"fill": {"kind": "init", "select": "*", "param": "weight", "method": "normal", "std": 0.5}}
    with surgery.apply(model, action, seed=SEED):
        got = [model[0].weight.detach().clone(), model[1].weight.detach().clone()]
    gen = generator(SEED, "fill")
    first, second = torch.empty(2, 3), torch.empty(5, 2)
    nn.init.normal_(first, 0.0, 0.5, generator=gen)
    nn.init.normal_(second, 0.0, 0.5, generator=gen)
    assert torch.equal(got[0], first) and torch.equal(got[1], second)


def test_init_depends_on_the_run_seed_and_the_action_name() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    got = by_surgery(model, "0", "weight", {"method": "uniform"}, seed=12)
    assert torch.equal(got, by_hand((4, 6), lambda t, g: init.uniform_(t, generator=g), seed=12))
    assert not torch.equal(got, by_hand((4, 6), lambda t, g: init.uniform_(t, generator=g), seed=SEED))


def test_init_undoes_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4))
    before = model[0].weight.detach().clone()
    by_surgery(model, "0", "weight", {"method": "kaiming_normal", "a": 0.3})
    assert torch.equal(model[0].weight, before)
