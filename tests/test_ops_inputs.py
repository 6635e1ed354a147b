"""Every op, with and without ``index``, leaves the tensor it was handed unchanged and returns the plain-torch value.

The hooks get the module's real output, the caller's input, or autograd's gradient: an op writing into that
tensor (e.g. an ``index`` slice assigned in place) would corrupt what the model or the caller still holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import surgery

T = torch.tensor([[-1.0, 2.0, -3.0, 4.0], [0.5, -0.25, 6.0, -7.0]])
INDEX = "[:, 1:3]"
SLICE = (slice(None), slice(1, 3))
PATCH = torch.tensor([[10.0, 20.0, 30.0, 40.0], [50.0, 60.0, 70.0, 80.0]])


def clip_norm(t: torch.Tensor, max_norm: float) -> torch.Tensor:
    return t * (max_norm / (torch.linalg.vector_norm(t) + 1e-6)).clamp(max=1.0)


# (op, arguments, plain torch on the tensor (or on its slice, given the same slice of PATCH); None: random)
TENSOR_ROWS: list[tuple[str, dict[str, Any], Any]] = [
    ("add", {"value": 1.5}, lambda t, p: t + 1.5),
    ("mul", {"value": -2.0}, lambda t, p: t * -2.0),
    ("set", {"value": 7.0}, lambda t, p: torch.full_like(t, 7.0)),
    ("zero", {}, lambda t, p: torch.zeros_like(t)),
    ("clamp", {"min": -1.0, "max": 3.0}, lambda t, p: t.clamp(-1.0, 3.0)),
    ("mean_ablate", {"dim": 0}, lambda t, p: t.mean(0, keepdim=True).expand_as(t)),
    ("fn", {"fn": "tests.helpers_callables:negate"}, lambda t, p: -t),
    ("expr", {}, lambda t, p: t * 3 - 1),  # the expression names the kind's own variable: see action()
    ("patch", {}, lambda t, p: p),
    ("noise", {"std": 0.5}, None),
]
GRAD_ROWS = TENSOR_ROWS + [
    ("clip_value", {"value": 2.5}, lambda t, p: t.clamp(-2.5, 2.5)),
    ("clip_norm", {"max_norm": 0.5}, lambda t, p: clip_norm(t, 0.5)),
]


def rows(table: list[tuple[str, dict[str, Any], Any]]) -> list[Any]:
    return [pytest.param(op, args, want, index, id=f"{op}{'-index' if index else ''}") for op, args, want in table
            for index in (None, INDEX)]  # fmt: skip


def expected(want: Any, t: torch.Tensor, index: str | None) -> torch.Tensor:
    if index is None:
        return want(t, PATCH)
    out = t.clone()
    out[SLICE] = want(t[SLICE], PATCH[SLICE])
    return out


def action(kind: str, op: str, args: dict[str, Any], index: str | None, tmp_path: Path, **extra: Any) -> dict:
    if op == "patch":
        save_file({"c/m/output": PATCH.clone()}, str(tmp_path / "captures.safetensors"))
        args = {"from": {"file": str(tmp_path / "captures.safetensors"), "key": "c/m/output"}}
    if op == "expr":
        args = {"expr": {"modify_output": "output", "modify_input": "x", "modify_grad": "grad"}[kind] + " * 3 - 1"}
    return {"m": {"kind": kind, "op": op, **args, **({"index": index} if index else {}), **extra}}


def check(got: torch.Tensor, handed: torch.Tensor, want: Any, index: str | None) -> None:
    """``got`` is what the op made of ``handed`` (already known unchanged)."""
    if want is not None:
        assert torch.equal(got, expected(want, handed, index))
        return
    changed = got != handed  # noise: the rest of the tensor is kept, the slice is new
    region = torch.zeros_like(handed, dtype=torch.bool)
    region[SLICE if index else (...,)] = True
    assert bool(changed[region].all()) and not bool(changed[~region].any())


class Probe(nn.Module):
    """``x * 1`` that keeps every input it was given and every output it made, each with a copy made then."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append((x, x.detach().clone()))
        out = x * 1.0
        self.outputs.append((out, out.detach().clone()))
        return out


@pytest.mark.parametrize(("op", "args", "want", "index"), rows(TENSOR_ROWS))
def test_modify_output_leaves_the_modules_own_output_unchanged(
    op: str, args: dict, want: Any, index: str | None, tmp_path: Path
) -> None:
    probe = Probe()
    model = nn.Sequential(probe)
    with surgery.apply(model, action("modify_output", op, args, index, tmp_path, select="0")):
        got = model(T.clone())
    output, copy = probe.outputs[0]
    assert torch.equal(output, copy), "the op wrote into the module's output"
    check(got, copy, want, index)


@pytest.mark.parametrize(("op", "args", "want", "index"), rows(TENSOR_ROWS))
def test_modify_input_leaves_the_callers_tensor_unchanged(
    op: str, args: dict, want: Any, index: str | None, tmp_path: Path
) -> None:
    probe = Probe()
    model = nn.Sequential(probe)
    x = T.clone()
    with surgery.apply(model, action("modify_input", op, args, index, tmp_path, select="0")):
        model(x)
    assert torch.equal(x, T), "the op wrote into the caller's input"
    check(probe.inputs[0][1], T, want, index)


@pytest.mark.parametrize(("op", "args", "want", "index"), rows(GRAD_ROWS))
def test_modify_grad_leaves_the_gradient_it_was_handed_unchanged(
    op: str, args: dict, want: Any, index: str | None, tmp_path: Path
) -> None:
    probe = Probe()
    model = nn.Sequential(probe)
    handed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def observe(m: nn.Module, grad_input: tuple, grad_output: tuple) -> None:  # runs before the surgery's hook
        handed.append((grad_input[0], grad_input[0].clone()))

    probe.register_full_backward_hook(observe)
    x = T.clone().requires_grad_(True)
    with surgery.apply(model, action("modify_grad", op, args, index, tmp_path, select="0")):
        (model(x) * T).sum().backward()  # grad_input is T
    grad, copy = handed[0]
    assert torch.equal(grad, copy), "the op wrote into autograd's grad_input"
    assert torch.equal(copy, T)
    check(x.grad, T, want, index)


@pytest.mark.parametrize(("op", "args", "want", "index"), rows(GRAD_ROWS))
def test_modify_grad_of_a_parameter_leaves_the_gradient_it_was_handed_unchanged(
    op: str, args: dict, want: Any, index: str | None, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2, bias=False))
    handed: list[tuple[torch.Tensor, torch.Tensor]] = []
    model[0].weight.register_hook(lambda g: handed.append((g, g.clone())))  # runs before the surgery's hook
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    with surgery.apply(model, action("modify_grad", op, args, index, tmp_path, select="0", param="weight")):
        (model(x) * T[:, :2]).sum().backward()
    grad, copy = handed[0]
    assert torch.equal(grad, copy), "the op wrote into the parameter's incoming gradient"
    check(model[0].weight.grad, copy, want, index)
