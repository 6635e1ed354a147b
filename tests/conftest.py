"""Tiny models and helpers shared by the tests: build fast, check restores exactly (independently of surgery)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from surgery.models.functions import Functions


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_check on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class TinyNet(nn.Module):
    """conv → norm → relu(inplace) → pool → fc: every common layer kind in a few hundred weights."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.act(self.norm(self.conv(x)))).flatten(1))


class PairOut(nn.Module):
    """Returns a tuple, like many third-party blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, y * 2


# Every attribute PyTorch keeps for hooks, read here on purpose rather than through the product's own
# helpers: a restore check built on the code under test would be blind to what that code misses.
MODULE_HOOK_ATTRS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_is_full_backward_hook",
    "_non_persistent_buffers_set",
)
TENSOR_HOOK_ATTRS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def hook_attr(value: Any) -> Any:
    """A hook attribute as comparable data: None stays None (not an empty dict), dicts keep order and hooks."""
    if isinstance(value, (set, frozenset)):
        return ("set", sorted(value))
    if isinstance(value, dict):
        return ("dict", [(key, id(fn)) for key, fn in value.items()])
    return value


def module_facts(module: nn.Module) -> dict[str, Any]:
    """A module's class, identity, mode, children, own tensor slots and every hook attribute."""
    facts: dict[str, Any] = {
        "class": type(module),
        "identity": id(module),
        "training": module.training,
        "children": [(n, id(c)) for n, c in module._modules.items()],
        "parameters": [(n, id(t)) for n, t in module._parameters.items()],
        "buffers": [(n, id(t)) for n, t in module._buffers.items()],
    }
    for name in MODULE_HOOK_ATTRS:
        facts[name] = hook_attr(vars(module).get(name, "<absent>"))
    return facts


def tensor_facts(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor's class, dtype, shape, requires_grad and hook attributes (values are compared apart)."""
    facts = {name: hook_attr(getattr(tensor, name, "<absent>")) for name in TENSOR_HOOK_ATTRS}
    facts.update(
        {"class": type(tensor), "dtype": tensor.dtype, "shape": tuple(tensor.shape), "grad": tensor.requires_grad}
    )
    return facts


def global_hooks() -> dict[str, Any]:
    """PyTorch's module-global hook dicts (surgery must never touch them)."""
    from torch.nn.modules import module as torch_module

    return {name: hook_attr(value) for name, value in vars(torch_module).items() if name.startswith("_global_")}


@dataclass
class Snapshot:
    """Everything remove() must give back: every module's hook attributes, class, children and tensor slots;
    every tensor's hook attributes, flags and values bit for bit; PyTorch's global hooks."""

    state: dict[str, torch.Tensor]  # every parameter and buffer (non-persistent too) by full name
    requires_grad: dict[str, bool]
    modules: dict[str, dict[str, Any]]
    tensors: dict[str, dict[str, Any]]
    globals: dict[str, Any]

    @classmethod
    def of(cls, model: nn.Module) -> Snapshot:
        """Take a deep snapshot of the model."""
        state: dict[str, torch.Tensor] = {}
        modules: dict[str, dict[str, Any]] = {}
        tensors: dict[str, dict[str, Any]] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            modules[path] = module_facts(module)
            for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                full = f"{path}.{name}" if path else name
                if tensor is None:
                    tensors[full] = {"none": True}
                    continue
                tensors[full] = tensor_facts(tensor)
                state[full] = tensor.detach().clone()
        requires_grad = {k: p.requires_grad for k, p in model.named_parameters()}
        return cls(state, requires_grad, modules, tensors, global_hooks())

    def differences(self, model: nn.Module) -> list[str]:
        """What differs between the snapshot and ``model`` now, one line each."""
        now = Snapshot.of(model)
        diffs = [f"module {k!r}: {a}" for k, a in _diff(self.modules, now.modules)]
        diffs += [f"tensor {k!r}: {a}" for k, a in _diff(self.tensors, now.tensors)]
        diffs += [f"global {k}" for k in self.globals if self.globals[k] != now.globals.get(k)]
        for key, value in self.state.items():
            if key in now.state and (now.state[key].dtype != value.dtype or not torch.equal(now.state[key], value)):
                diffs.append(f"tensor {key!r}: values differ")
        if now.requires_grad != self.requires_grad:
            diffs.append(f"requires_grad: {self.requires_grad} -> {now.requires_grad}")
        return diffs

    def assert_same(self, model: nn.Module) -> None:
        """The model is bit-identical to the snapshot in values, structure and every hook attribute."""
        diffs = self.differences(model)
        assert not diffs, "\n".join(diffs)


def _diff(before: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    out = [(k, "gone") for k in before if k not in now] + [(k, "new") for k in now if k not in before]
    for key, facts in before.items():
        if key in now:
            out += [(key, f"{a} {v!r} -> {now[key].get(a)!r}") for a, v in facts.items() if now[key].get(a) != v]
    return out


@pytest.fixture
def tiny() -> TinyNet:
    """A seeded TinyNet in eval mode."""
    torch.manual_seed(0)
    return TinyNet().eval()


@pytest.fixture
def functions() -> Functions:
    """The seeds' exercise model with its default weights."""
    return Functions()


@pytest.fixture
def x_img() -> torch.Tensor:
    """A batch of two 1×6×6 images."""
    return torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def x12() -> tuple[torch.Tensor, torch.Tensor]:
    """The two inputs of the functions model: x1 = [1, 2], x2 = [3, 4] as columns."""
    return torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]])


def run_both(model: nn.Module, *inputs: Any) -> Any:
    """Forward then backward of the output sum, with inputs that require grad."""
    inputs = tuple(x.detach().requires_grad_(True) for x in inputs)
    out = model(*inputs)
    first = out[0] if isinstance(out, tuple) else out
    first.sum().backward()
    return out


@pytest.fixture
def gloo_group() -> Iterator[None]:
    """A gloo process group of one rank in this process, torn down afterwards (skips if one is already set up)."""
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fully_shard_one_rank(model: nn.Module, layers: Sequence[nn.Module] = ()) -> nn.Module:
    """``model`` under FSDP2 ``fully_shard`` on a CPU mesh of one rank: each of ``layers`` first, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.fixture(scope="module")
def tiny_lm() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny GPT-2 (vocab 20) and clean / corrupted token ids [3, 5] differing at position 1: for studies."""
    from tests.lm_helpers import tiny_gpt2

    model = tiny_gpt2(20, 1)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(2, 20, (3, 5), generator=g)
    corrupt = clean.clone()
    corrupt[:, 1] = 5
    return model, clean, corrupt
