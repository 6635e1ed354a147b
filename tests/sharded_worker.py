"""Worker for tests/test_sharded.py: run by ``torchrun --standalone --nproc_per_node=2`` (gloo, CPU).

Every scenario runs on both ranks (collectives need both); each rank's findings are gathered and rank 0
writes them all to the JSON file named by argv[1]: {scenario: [rank 0's dict, rank 1's dict]}.
A scenario that raises records the error's type and message instead, so one failure spoils no other.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.nn.parallel import DistributedDataParallel

import surgery


class Net(nn.Module):
    """fc1 (8 → 32), act, fc2 (32 → 4): fc1.weight's 32 rows split 16/16 over two ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def net() -> Net:
    torch.manual_seed(0)  # the same weights on every rank and in every scenario
    return Net()


def fsdp2(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp1(use_orig_params: bool) -> nn.Module:
    return FullyShardedDataParallel(net(), use_orig_params=use_orig_params, device_id=torch.device("cpu"))


def local_input() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + dist.get_rank()))


def error_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the message is the finding
        return f"{type(e).__name__}: {e}"
    return ""


INIT = {"i": {"kind": "init", "select": "fc1", "param": "weight", "method": "normal"}}


def fsdp2_type() -> dict[str, Any]:
    model = fsdp2(net())
    plan = surgery.plan(model, {"c": {"kind": "capture", "type": "Linear"}})
    return {"class": type(model.fc1).__name__, "matched": plan.to_dict()[0]["matched"]}


def fsdp2_init() -> dict[str, Any]:
    reference = net()
    surgery.apply(reference, INIT, seed=3)
    model = fsdp2(net())
    done = surgery.apply(model, INIT, seed=3, verify=True)  # remove() checks hooks, flags and versions came back
    full = model.fc1.weight.full_tensor()
    local = model.fc1.weight.to_local().clone()
    done.remove()
    return {
        "equals_unsharded": torch.equal(full, reference.fc1.weight),
        "shards_repeat": torch.equal(full[:16], full[16:]),
        "local_rows": local.shape[0],
        "restored": torch.equal(model.fc1.weight.full_tensor(), net().fc1.weight),
    }


def fsdp2_grads() -> dict[str, Any]:
    plain = fsdp2(net())
    plain(local_input()).sum().backward()
    expected = plain.fc1.weight.grad.full_tensor()
    model = fsdp2(net())
    actions = {
        "g": {"kind": "modify_grad", "select": "fc1", "param": "weight", "op": "mul", "value": 2.0},
        "c": {"kind": "capture_grad", "select": "fc1", "param": "weight"},
    }
    done = surgery.apply(model, actions)  # no forward yet: one unshard makes the unsharded parameter
    model(local_input()).sum().backward()
    doubled = model.fc1.weight.grad.full_tensor()
    captured = done.captures["c"]["fc1.weight"].calls[-1].grad
    done.remove()
    by_hand = net()  # the gradient autograd computes on this rank before FSDP reduces it, in plain PyTorch
    by_hand(local_input()).sum().backward()
    model.zero_grad()
    model(local_input()).sum().backward()  # after remove(): the hooks are gone
    return {
        "doubled": torch.equal(doubled, 2 * expected),
        "changed": not torch.equal(doubled, expected),
        "captured_is_local_grad": torch.equal(captured, 2 * by_hand.fc1.weight.grad),  # after g doubled it
        "captured_shape": list(captured.shape),
        "after_remove": torch.equal(model.fc1.weight.grad.full_tensor(), expected),
    }


def fsdp2_linear() -> dict[str, Any]:
    model = fsdp2(net())
    x = local_input()
    with torch.no_grad():
        plain = model(x)
    linear = {"r": {"kind": "replace_forward", "select": "fc1", "fn": "linear"}}
    done = surgery.apply(model, linear, verify=True)  # after a forward: FSDP2 has set itself up
    out = model(x)
    out.sum().backward()
    done.remove()
    return {"same_output": torch.equal(out.detach(), plain), "grad_made": model.fc1.weight.grad is not None}


def fsdp1_orig() -> dict[str, Any]:
    model = fsdp1(use_orig_params=True)
    grad = {"g": {"kind": "modify_grad", "select": "fc1", "param": "weight", "op": "zero"}}
    capture = {"c": {"kind": "capture_grad", "select": "fc1", "param": "weight"}}
    hooks = surgery.plan(model, {"h": {"kind": "capture", "select": "fc1"}})
    return {
        "init": error_of(lambda: surgery.plan(model, INIT)),
        "modify_grad": error_of(lambda: surgery.plan(model, grad)),
        "capture_grad": error_of(lambda: surgery.plan(model, capture)),
        "module_hook_matched": hooks.to_dict()[0]["matched"],
    }


def fsdp1_flat() -> dict[str, Any]:
    model = fsdp1(use_orig_params=False)
    return {"capture_grad": error_of(lambda: surgery.plan(model, {"c": {"kind": "capture_grad", "select": "fc1",
                                                                        "param": "weight"}}))}  # fmt: skip


def ddp() -> dict[str, Any]:
    model = DistributedDataParallel(net())
    actions = {
        "f": {"kind": "freeze", "select": "fc1", "param": "weight"},
        "a": {"kind": "add_parameter", "select": "fc2", "name": "gate", "shape": [4]},
        "r": {"kind": "replace_module", "select": "act", "with": {"_target_": "torch.nn.GELU"}},
        "c": {"kind": "capture", "select": "fc1"},
    }
    bare = surgery.plan(net(), actions)
    return {"warnings": surgery.plan(model, actions).warnings, "bare_warnings": bare.warnings}


SCENARIOS = [fsdp2_type, fsdp2_init, fsdp2_grads, fsdp2_linear, fsdp1_orig, fsdp1_flat, ddp]


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results: dict[str, list[Any]] = {}
    for scenario in SCENARIOS:
        try:
            found: Any = scenario()
        except Exception as e:  # noqa: BLE001 - reported to the test, which names the scenario
            found = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, found)
        results[scenario.__name__] = gathered
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()  # no rank tears gloo down while another still uses it (a rank aborted once at exit without this)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
