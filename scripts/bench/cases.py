"""What the hook benchmarks time, shared by overhead.py (engine and hand) and peers.py: models, tasks, one call.

Each task is one job done by the engine (``actions``) and the same job written by hand with
plain PyTorch hooks (``hand``), hooking exactly the same modules with the same kinds of hook.
The first four are the engine's fast paths; the rest are its slower ones (input capture, an
``item`` picked from the inputs, an ``index`` slice, an ``expr`` op, seeded noise, a module that
runs in place), so the table shows what each path costs, not only the cheapest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from surgery.actions.base import seed_for
from surgery.actions.noise import noise_stream
from surgery.models.mlp import MLP

LINEAR = ("Linear", "Conv1D")  # GPT-2's linear layers are transformers' Conv1D
ACTIVATION = ("ReLU", "NewGELUActivation")
ADD = 1.0
MAX_NORM = 1.0
STD = 0.1
SEED = 0  # surgery.plan's default seed: the noise task's hand-written stream starts from the same key

Store = dict[str, list[torch.Tensor]]
Hand = Callable[[nn.Module], tuple[list[RemovableHandle], Store]]


@dataclass
class ModelCase:
    """A model, its keyword inputs, and how to get the output tensor from what it returns."""

    name: str
    model: nn.Module
    inputs: dict[str, torch.Tensor]
    rounds: int  # the fewest rounds; more are added while the quartiles are wider than the target's margin
    block_s: float  # CPU seconds per variant per round
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    peer_modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    is_gpt2: bool = False
    max_s: float = 60.0  # cap on the seconds one task/mode may take while rounds are added

    def output(self, out: Any) -> torch.Tensor:
        return out.logits if hasattr(out, "logits") else out


def mlp_case(
    width: int,
    rounds: int,
    block_s: float,
    batch: int = 8,
    peer_modes: tuple[str, ...] = ("fwd", "fwd+bwd"),
    max_s: float = 60.0,
) -> ModelCase:
    torch.manual_seed(0)
    model = MLP(in_features=width, hidden=width, depth=12, out_features=width).eval()
    inputs = {"x": torch.randn(batch, width)}
    return ModelCase(f"MLP w{width}", model, inputs, rounds, block_s, peer_modes=peer_modes, max_s=max_s)


def gpt2_case(small: bool, rounds: int, block_s: float, length: int = 8, max_s: float = 60.0) -> ModelCase:
    """GPT-2 small (n_layer 12, n_embd 768, vocab 50257) from a config, or a tiny one for tests."""
    from surgery.models.hf import gpt2_tiny

    torch.manual_seed(0)
    if small:
        model = gpt2_tiny(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    else:
        model = gpt2_tiny()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    name = f"GPT-2 small (seq {length})" if small else "GPT-2 tiny"
    return ModelCase(name, model, {"input_ids": ids}, rounds, block_s, is_gpt2=True, peer_modes=("fwd",), max_s=max_s)


def inplace_case(case: ModelCase) -> ModelCase | None:
    """A copy of ``case`` whose ReLUs run in place (None when it has none: GPT-2's GELU has no ``inplace``)."""
    model = copy.deepcopy(case.model)
    relus = [m for m in model.modules() if isinstance(m, nn.ReLU)]
    if not relus:
        return None
    for m in relus:
        m.inplace = True
    return ModelCase(**{**case.__dict__, "name": f"{case.name} in-place ReLU", "model": model})


@dataclass
class Task:
    """One job done by surgery (``actions``) and by hand (``hand(model) -> handles, store``)."""

    name: str
    actions: dict[str, Any]
    hand: Hand
    selects: Callable[[nn.Module], bool]
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    slow: bool = False  # one of the engine's slower paths
    captured: str = ""  # what a capture task records per call: "output" or "input" (its first positional)
    inplace: bool = False  # runs on the case's copy with in-place ReLUs


def _is(types: tuple[str, ...]) -> Callable[[nn.Module], bool]:
    return lambda m: type(m).__name__ in types


def _linear(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ in LINEAR]


def hand_capture(model: nn.Module) -> tuple[list[RemovableHandle], Store]:
    handles, store = [], {}
    for name, m in _linear(model):
        calls: list[torch.Tensor] = []
        store[name] = calls
        handles.append(m.register_forward_hook(lambda mod, args, out, calls=calls: calls.append(out.detach())))
    return handles, store


def hand_capture_input(model: nn.Module) -> tuple[list[RemovableHandle], Store]:
    handles, store = [], {}
    for name, m in _linear(model):
        calls: list[tuple[Any, ...]] = []
        store[name] = calls  # type: ignore[assignment]

        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any, calls: list = calls) -> None:
            calls.append((tuple(a.detach() for a in args), {k: v.detach() for k, v in kwargs.items()} or None))

        handles.append(m.register_forward_hook(hook, with_kwargs=True))
    return handles, store


def hand_add(model: nn.Module) -> tuple[list[RemovableHandle], Store]:
    hook = lambda mod, args, out: out + ADD  # noqa: E731
    return [m.register_forward_hook(hook) for _, m in _linear(model)], {}


def hand_index(model: nn.Module) -> tuple[list[RemovableHandle], Store]:
    def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        new = out.clone()
        new[..., :4] = torch.zeros_like(out[..., :4])
        return new

    return [m.register_forward_hook(hook) for _, m in _linear(model)], {}


def hand_item(model: nn.Module) -> tuple[list[RemovableHandle], Store]:
    def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (args[0] * 0.5, *args[1:]), kwargs

    return [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for _, m in _linear(model)], {}


def hand_expr(model: nn.Module) -> tuple[list[RemovableHandle], Store]:
    hook = lambda mod, args, out: out * 0.5 + 1.0  # noqa: E731
    return [m.register_forward_hook(hook) for _, m in _linear(model)], {}


def hand_noise(model: nn.Module) -> tuple[list[RemovableHandle], Store]:
    draw = noise_stream(seed_for(SEED, "noise"), STD)  # the engine's own stream: only the hook around it is timed
    hook = lambda mod, args, out: out + draw(out)  # noqa: E731
    return [m.register_forward_hook(hook) for _, m in _linear(model)], {}


def hand_replace(model: nn.Module) -> tuple[list[RemovableHandle], Store]:
    hook = lambda mod, args, out: args[0] * torch.sigmoid(args[0])  # noqa: E731
    return [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ in ACTIVATION], {}


def hand_replace_inplace(model: nn.Module) -> tuple[list[RemovableHandle], Store]:
    """An in-place module overwrites its input: keep it, hand forward a copy, compute from the original."""
    handles = []
    for m in model.modules():
        if type(m).__name__ in ACTIVATION:
            pending: list[tuple] = []

            def keep(mod: nn.Module, args: tuple, pending: list = pending) -> tuple:
                pending.append(args)
                return tuple(a.clone() for a in args)

            def replace(mod: nn.Module, args: tuple, out: Any, pending: list = pending) -> torch.Tensor:
                x = pending.pop()[0]
                return x * torch.sigmoid(x)

            handles += [m.register_forward_pre_hook(keep), m.register_forward_hook(replace)]
    return handles, {}


def clip_norm(grad: torch.Tensor) -> torch.Tensor:
    return grad * (MAX_NORM / (torch.linalg.vector_norm(grad) + 1e-6)).clamp(max=1.0)


def hand_clip(model: nn.Module) -> tuple[list[RemovableHandle], Store]:
    return [m.weight.register_hook(clip_norm) for _, m in _linear(model)], {}


def _modify(op: dict[str, Any], kind: str = "modify_output") -> dict[str, Any]:
    return {"kind": kind, "type": list(LINEAR), **op}


REPLACE = {"act": {"kind": "replace_forward", "type": list(ACTIVATION), "expr": "x * sigmoid(x)"}}
CLIP = {"clip": _modify({"param": "weight", "op": "clip_norm", "max_norm": MAX_NORM}, "modify_grad")}
TASKS = [
    Task(
        "capture Linear outputs",
        {"cap": {"kind": "capture", "type": list(LINEAR)}},
        hand_capture,
        _is(LINEAR),
        captured="output",
    ),  # fmt: skip
    Task("add to Linear outputs", {"add": _modify({"op": "add", "value": ADD})}, hand_add, _is(LINEAR)),
    Task("replace_forward expr on activations", REPLACE, hand_replace, _is(ACTIVATION)),
    Task("modify_grad clip_norm on Linear weights", CLIP, hand_clip, _is(LINEAR), modes=("fwd+bwd",)),
    # the slower paths
    Task(
        "capture Linear inputs",
        {"cap": {"kind": "capture", "type": list(LINEAR), "what": ["input"]}},
        hand_capture_input,
        _is(LINEAR),
        slow=True,
        captured="input",
    ),  # fmt: skip
    Task(
        "modify_input mul, item 0",
        {"mul": _modify({"op": "mul", "value": 0.5, "item": 0}, "modify_input")},
        hand_item,
        _is(LINEAR),
        slow=True,
    ),  # fmt: skip
    Task(
        "zero an index slice of Linear outputs",
        {"zero": _modify({"op": "zero", "index": "[..., :4]"})},
        hand_index,
        _is(LINEAR),
        slow=True,
    ),  # fmt: skip
    Task(
        "expr op on Linear outputs",
        {"e": _modify({"op": "expr", "expr": "output * 0.5 + 1.0"})},
        hand_expr,
        _is(LINEAR),
        slow=True,
    ),  # fmt: skip
    Task(
        "noise on Linear outputs", {"noise": _modify({"op": "noise", "std": STD})}, hand_noise, _is(LINEAR), slow=True
    ),  # fmt: skip
    Task(
        "replace_forward expr on in-place ReLUs",
        REPLACE,
        hand_replace_inplace,
        _is(ACTIVATION),
        slow=True,
        inplace=True,
    ),  # fmt: skip
]


def step_for(case: ModelCase, mode: str, model: nn.Module | None = None) -> Callable[[], torch.Tensor]:
    """One call of the model: forward under no_grad, or forward + backward of the summed output."""
    model = case.model if model is None else model
    inputs = case.inputs

    if mode == "fwd":

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return case.output(model(**inputs))

        return forward

    def forward_backward() -> torch.Tensor:
        out = case.output(model(**inputs))
        torch.autograd.backward(out.sum())  # not Tensor.backward, which nnsight replaces when imported
        return out.detach()

    return forward_backward
