"""Silent wrong results the actions must not give (issue 11): each test compares with plain PyTorch, exactly."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import surgery


class AddOneInPlace(nn.Module):
    """Model code that writes into its input, like ``out += identity`` in a residual block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += 1
        return x


def test_patch_gives_the_same_output_every_call_when_the_model_writes_in_place(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = torch.randn(2, 4)
    save_file({"c/0/output": source}, str(tmp_path / "captures.safetensors"))
    model = nn.Sequential(nn.Linear(4, 4), AddOneInPlace())
    patch = {"kind": "modify_output", "select": "0", "op": "patch"}
    patch["from"] = {"file": str(tmp_path / "captures.safetensors"), "key": "c/0/output"}
    x = torch.randn(2, 4)
    with torch.no_grad(), surgery.apply(model, {"p": patch}):
        outputs = [model(x) for _ in range(3)]
    for out in outputs:
        assert torch.equal(out, source + 1)


def _linear_and_input() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(4, 3), torch.randn(5, 4)


def test_capture_grad_of_a_parameter_keeps_each_calls_own_gradient() -> None:
    model, x = _linear_and_input()
    (expected,) = torch.autograd.grad(model(x).square().sum(), model.weight)
    action = {"g": {"kind": "capture_grad", "select": "<root>", "param": "weight"}}
    with surgery.apply(model, action) as s:
        model(x).square().sum().backward()
        model(x).square().sum().backward()  # no zero_grad: .grad accumulates in place
        calls = s.captures["g"]["weight"].calls
    assert torch.equal(model.weight.grad, expected * 2)
    assert [torch.equal(c.grad, expected) for c in calls] == [True, True]


def test_capture_grad_of_a_module_keeps_each_calls_own_grad_input() -> None:
    model, x = _linear_and_input()
    x.requires_grad_(True)
    (expected,) = torch.autograd.grad(model(x).square().sum(), x)
    with surgery.apply(model, {"g": {"kind": "capture_grad", "select": "<root>"}}) as s:
        model(x).square().sum().backward()
        model(x).square().sum().backward()  # x.grad accumulates in place
        calls = s.captures["g"]["<root>"].calls
    assert torch.equal(x.grad, expected * 2)
    assert [torch.equal(c.grad_input[0], expected) for c in calls] == [True, True]


@pytest.mark.parametrize("reduce", ["mean", "stats"])
def test_reduced_capture_counts_every_call_when_threads_run_the_model(reduce: str) -> None:
    model, _ = _linear_and_input()
    torch.manual_seed(1)
    inputs = [torch.randn(8, 4) for _ in range(4)]
    rounds = 100
    with torch.no_grad(), surgery.apply(model, {"c": {"kind": "capture", "select": "<root>", "reduce": reduce}}) as s:

        def work(x: torch.Tensor) -> None:
            for _ in range(rounds):
                model(x)

        threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        reduced = s.captures["c"]["<root>"].reduced["output"]
        outputs = torch.cat([model(x) for x in inputs]).double()
    assert int(reduced["count"]) == rounds * 8 * len(inputs)
    torch.testing.assert_close(reduced["mean"], outputs.mean(0).float())  # merge order varies with the threads
    if reduce == "stats":
        assert torch.equal(reduced["min"], outputs.amin(0).float())
        assert torch.equal(reduced["max"], outputs.amax(0).float())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


def _noisy_gradients(mode: str, steps: int = 2) -> list[torch.Tensor]:
    """Gradients of every parameter and the input over ``steps`` forward/backward rounds, under one apply."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block())
    x = torch.randn(3, 6, requires_grad=True)
    action = {"n": {"kind": "modify_output", "type": "Linear", "op": "noise", "std": 0.5}}
    got = []
    with surgery.apply(model, action, seed=3):
        for _ in range(steps):
            h = x
            for block in model:
                h = block(h) if mode == "plain" else checkpoint(block, h, use_reentrant=mode == "reentrant")
            h.square().sum().backward()
            got += [h.detach()] + [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
            model.zero_grad()
            x.grad = None
    return got


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_noise_under_activation_checkpointing_gives_the_gradients_of_the_plain_run(mode: str) -> None:
    expected = _noisy_gradients("plain")
    got = _noisy_gradients(mode)
    assert [torch.equal(a, b) for a, b in zip(got, expected)] == [True] * len(expected)


def test_mean_ablate_output_can_be_changed_in_place_by_the_next_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=True))
    x = torch.randn(5, 4)
    with torch.no_grad():
        y = model[0](x)
        expected = torch.relu(y.mean(0, keepdim=True).expand_as(y))
        with surgery.apply(model, {"m": {"kind": "modify_output", "select": "0", "op": "mean_ablate"}}):
            got = model(x)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("rename", [{}, {"module.**": "**"}])
def test_on_load_before_add_parameter_forgives_the_added_tensor(rename: dict[str, str]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3))
    checkpoint_ = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    actions = {
        "load": {"kind": "on_load", "rename": rename},  # listed first: the tensor it must forgive comes later
        "add": {"kind": "add_parameter", "select": "0", "name": "g", "shape": [3]},
    }
    with surgery.apply(model, actions) as s:
        s.load_state_dict(checkpoint_, strict=True)
        assert torch.equal(model[0].weight, checkpoint_["0.weight"])
        assert torch.equal(model[0].g, torch.zeros(3))
