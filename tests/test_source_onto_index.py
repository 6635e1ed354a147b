"""A ``from:`` source that broadcasts onto the whole tensor but not onto the ``index``ed part (issue 25): a
``[T, D]`` reference mean written into ``[..., 16:24]`` of ``[B, T, D]`` is broadcast onto the whole tensor,
then cut by ``index``; each case against the same hook written by hand in plain torch, bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError

B, T, D = 3, 5, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(D, 2)).eval()


def by_hand(m: nn.Module, hook, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    handle = m[0].register_forward_hook(hook)
    try:
        return m(x)
    finally:
        handle.remove()


@pytest.mark.parametrize("op", ["set", "patch", "add", "mul"])
def test_a_reference_mean_is_written_into_an_index_of_every_example(op: str) -> None:
    m, x = model(), torch.randn(B, T, D)
    ref = torch.randn(T, D)  # broadcasts onto [B, T, D], not onto the [B, T, 8] part
    action = {"p": {"kind": "modify_output", "select": "0", "op": op, "from": ref, "index": "[..., 16:24]"}}
    with surgery.apply(m, action, example_inputs=(x,)):
        got = m(x)
    combine = {"set": lambda a, b: b, "patch": lambda a, b: b, "add": torch.add, "mul": torch.mul}[op]

    def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        new = out.clone()
        new[..., 16:24] = combine(out[..., 16:24], ref.expand(out.shape)[..., 16:24])
        return new

    assert torch.equal(got, by_hand(m, hook, x))


def test_a_captured_mean_is_written_into_an_index(tmp_path) -> None:  # noqa: ANN001
    m, x, clean = model(), torch.randn(B, T, D), torch.randn(B, T, D)
    with torch.no_grad():
        mean = m[0](clean).mean(0)  # [T, D]
    save_file({"ref": mean.contiguous()}, str(tmp_path / "ref.safetensors"))
    source = {"file": str(tmp_path / "ref.safetensors"), "key": "ref"}
    action = {"p": {"kind": "modify_output", "select": "0", "op": "patch", "from": source, "index": "[:, 1:3, 16:24]"}}
    with surgery.apply(m, action, example_inputs=(x,)):
        got = m(x)

    def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        new = out.clone()
        new[:, 1:3, 16:24] = mean.expand(out.shape)[:, 1:3, 16:24]
        return new

    assert torch.equal(got, by_hand(m, hook, x))


def test_a_source_that_fits_the_part_still_broadcasts_onto_the_part() -> None:
    m, x = model(), torch.randn(B, T, D)
    v = torch.randn(8)  # a steering vector for the 8 indexed features
    action = {"p": {"kind": "modify_output", "select": "0", "op": "add", "from": v, "index": "[..., 16:24]"}}
    with surgery.apply(m, action, example_inputs=(x,)):
        got = m(x)

    def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        new = out.clone()
        new[..., 16:24] = out[..., 16:24] + v
        return new

    assert torch.equal(got, by_hand(m, hook, x))


def test_a_source_that_fits_neither_is_refused_before_and_while_running() -> None:
    m, x = model(), torch.randn(B, T, D)
    action = {
        "p": {"kind": "modify_output", "select": "0", "op": "set", "from": torch.randn(4, D), "index": "[..., :8]"}
    }
    with pytest.raises(
        ConfigError, match=r"actions\.p\.from: .*\[4, 32\].*nor onto the whole output, shape \[3, 5, 32\]"
    ):
        surgery.plan(m, action, example_inputs=(x,))
    with (
        surgery.apply(m, action),
        pytest.raises(ActionError, match=r"actions\.p\.from .*neither onto the indexed part"),
    ):
        m(x)
