"""Hook overhead of surgery against the same hooks written by hand, timed interleaved in one process.

Tasks (each on every selected module, none elsewhere): capture every Linear output; add a
constant to every Linear output; ``replace_forward`` with an ``expr`` on every activation;
``modify_grad`` clip_norm on every Linear weight (a tensor hook). Models: a 12-layer MLP at
width 64 and 1024 (batch 8) and GPT-2 small from a config with random weights. Before timing,
every task is checked: the engine and the hand-written hooks give identical outputs, captures and
gradients, and hook exactly the same modules (unselected modules carry no hook at all).

    python scripts/bench_overhead.py                 # full sizes, table on stdout
    python scripts/bench_overhead.py --quick --json out.json
    python scripts/bench_overhead.py --peers         # also nnsight, pyvene, TransformerLens
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from bench_common import Timing, Variant, fmt_ratio, fmt_time, interleave, machine, nothing, write_json
from torch import nn
from torch.utils.hooks import RemovableHandle

import surgery
from surgery.core.engine import hooks_on
from surgery.models.mlp import MLP

LINEAR = ("Linear", "Conv1D")  # GPT-2's linear layers are transformers' Conv1D
ACTIVATION = ("ReLU", "NewGELUActivation")
ADD = 1.0
MAX_NORM = 1.0
TARGET = 1.03  # engine / hand-written, every case
MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


# ----------------------------------------------------------------------------- models


@dataclass
class ModelCase:
    """A model, its keyword inputs, and how to get the output tensor from what it returns."""

    name: str
    model: nn.Module
    inputs: dict[str, torch.Tensor]
    rounds: int
    block_s: float  # CPU seconds per variant per round
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    peer_modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    is_gpt2: bool = False

    def output(self, out: Any) -> torch.Tensor:
        return out.logits if hasattr(out, "logits") else out


def mlp_case(
    width: int, rounds: int, block_s: float, batch: int = 8, peer_modes: tuple[str, ...] = ("fwd", "fwd+bwd")
) -> ModelCase:
    torch.manual_seed(0)
    model = MLP(in_features=width, hidden=width, depth=12, out_features=width).eval()
    inputs = {"x": torch.randn(batch, width)}
    return ModelCase(f"MLP w{width}", model, inputs, rounds, block_s, peer_modes=peer_modes)


def gpt2_case(small: bool, rounds: int, block_s: float, length: int = 8) -> ModelCase:
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
    return ModelCase(name, model, {"input_ids": ids}, rounds, block_s, is_gpt2=True, peer_modes=("fwd",))


# ----------------------------------------------------------------------------- tasks


@dataclass
class Task:
    """One job done by surgery (``actions``) and by hand (``hand(model) -> handles, store``)."""

    name: str
    actions: dict[str, Any]
    hand: Callable[[nn.Module], tuple[list[RemovableHandle], dict[str, list[torch.Tensor]]]]
    selects: Callable[[nn.Module], bool]
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")


def _is(types: tuple[str, ...]) -> Callable[[nn.Module], bool]:
    return lambda m: type(m).__name__ in types


def hand_capture(model: nn.Module) -> tuple[list[RemovableHandle], dict[str, list[torch.Tensor]]]:
    handles, store = [], {}
    for name, m in model.named_modules():
        if type(m).__name__ in LINEAR:
            calls: list[torch.Tensor] = []
            store[name] = calls
            handles.append(m.register_forward_hook(lambda mod, args, out, calls=calls: calls.append(out.detach())))
    return handles, store


def hand_add(model: nn.Module) -> tuple[list[RemovableHandle], dict[str, list[torch.Tensor]]]:
    hook = lambda mod, args, out: out + ADD  # noqa: E731
    return [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ in LINEAR], {}


def hand_replace(model: nn.Module) -> tuple[list[RemovableHandle], dict[str, list[torch.Tensor]]]:
    hook = lambda mod, args, out: args[0] * torch.sigmoid(args[0])  # noqa: E731
    return [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ in ACTIVATION], {}


def clip_norm(grad: torch.Tensor) -> torch.Tensor:
    return grad * (MAX_NORM / (torch.linalg.vector_norm(grad) + 1e-6)).clamp(max=1.0)


def hand_clip(model: nn.Module) -> tuple[list[RemovableHandle], dict[str, list[torch.Tensor]]]:
    modules = [m for m in model.modules() if type(m).__name__ in LINEAR]
    return [m.weight.register_hook(clip_norm) for m in modules], {}


TASKS = [
    Task("capture Linear outputs", {"cap": {"kind": "capture", "type": list(LINEAR)}}, hand_capture, _is(LINEAR)),
    Task(
        "add to Linear outputs",
        {"add": {"kind": "modify_output", "type": list(LINEAR), "op": "add", "value": ADD}},
        hand_add,
        _is(LINEAR),
    ),
    Task(
        "replace_forward expr on activations",
        {"act": {"kind": "replace_forward", "type": list(ACTIVATION), "expr": "x * sigmoid(x)"}},
        hand_replace,
        _is(ACTIVATION),
    ),
    Task(
        "modify_grad clip_norm on Linear weights",
        {
            "clip": {
                "kind": "modify_grad",
                "type": list(LINEAR),
                "param": "weight",
                "op": "clip_norm",
                "max_norm": MAX_NORM,
            }
        },
        hand_clip,
        _is(LINEAR),
        modes=("fwd+bwd",),
    ),
]


# ----------------------------------------------------------------------------- running


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


def own_hooks(module: nn.Module, skip: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Hooks on this module itself and on its own parameters (not its children's); ``skip``: tensor ids."""
    count = sum(len(getattr(module, name)) for name in MODULE_HOOK_DICTS)
    for tensor in module._parameters.values():
        if tensor is not None and id(tensor) not in skip:
            count += len(tensor._backward_hooks or {})
    return count


@dataclass
class Outcome:
    output: torch.Tensor
    grads: dict[str, torch.Tensor]
    captures: dict[str, list[torch.Tensor]]
    hooks: dict[str, int]


def _run_once(
    case: ModelCase, mode: str, attach: Callable[[], tuple[Callable[[], None], Callable[[], Any]]]
) -> Outcome:
    model = case.model
    model.zero_grad(set_to_none=True)
    detach, captures = attach()
    try:
        hooks = {name: own_hooks(m) for name, m in model.named_modules()}
        output = step_for(case, mode)()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return Outcome(output, grads, captures(), hooks)
    finally:
        detach()
        model.zero_grad(set_to_none=True)


def engine_attach(case: ModelCase, plan: surgery.Plan) -> Callable[[], Any]:
    def attach() -> tuple[Callable[[], None], Callable[[], dict[str, list[torch.Tensor]]]]:
        s = surgery.apply(case.model, plan)

        def captures() -> dict[str, list[torch.Tensor]]:
            return {
                key: [c.output for c in record.calls]
                for per_action in s.captures.values()
                for key, record in per_action.items()
            }

        return s.remove, captures

    return attach


def hand_attach(case: ModelCase, task: Task) -> Callable[[], Any]:
    def attach() -> tuple[Callable[[], None], Callable[[], dict[str, list[torch.Tensor]]]]:
        handles, store = task.hand(case.model)
        return (lambda: [h.remove() for h in handles]), (lambda: {k: list(v) for k, v in store.items()})

    return attach


def check_task(case: ModelCase, task: Task, plan: surgery.Plan, mode: str) -> None:
    """Engine == hand: outputs, gradients, captures, and the hooks on every module; nothing left after."""
    where = f"{case.name} / {task.name} / {mode}"
    if hooks_on(case.model):
        raise AssertionError(f"{where}: the model carries hooks before the check")
    engine = _run_once(case, mode, engine_attach(case, plan))
    hand = _run_once(case, mode, hand_attach(case, task))
    if hooks_on(case.model):
        raise AssertionError(f"{where}: hooks left on the model after remove()")
    if not torch.equal(engine.output, hand.output):
        diff = (engine.output - hand.output).abs().max().item()
        raise AssertionError(f"{where}: outputs differ (max abs {diff:g})")
    if engine.grads.keys() != hand.grads.keys() or any(
        not torch.equal(engine.grads[k], hand.grads[k]) for k in hand.grads
    ):
        raise AssertionError(f"{where}: gradients differ")
    if engine.captures.keys() != hand.captures.keys() or any(
        len(engine.captures[k]) != len(hand.captures[k])
        or any(not torch.equal(a, b) for a, b in zip(engine.captures[k], hand.captures[k]))
        for k in hand.captures
    ):
        raise AssertionError(f"{where}: captures differ")
    if engine.hooks != hand.hooks:
        diff = {k: (engine.hooks[k], hand.hooks[k]) for k in hand.hooks if engine.hooks[k] != hand.hooks[k]}
        raise AssertionError(f"{where}: hooks per module differ (engine, hand): {diff}")
    check_unselected(case, task, plan)


def check_unselected(case: ModelCase, task: Task, plan: surgery.Plan) -> None:
    """While the surgery is applied, modules the task does not select carry no hook at all."""
    model = case.model
    selected = {id(m) for m in model.modules() if task.selects(m)}
    selected_tensors = {id(p) for m in model.modules() if id(m) in selected for p in m.parameters(recurse=False)}
    with surgery.apply(model, plan):
        hooked = [
            name
            for name, m in model.named_modules()
            if id(m) not in selected and own_hooks(m, skip=selected_tensors)  # a tied weight counts once
        ]
    if hooked:
        raise AssertionError(f"{case.name} / {task.name}: unselected modules carry hooks: {hooked[:5]}")


def hand_variant(case: ModelCase, task: Task) -> Callable[[], Callable[[], None]]:
    def attach() -> Callable[[], None]:
        handles, _ = task.hand(case.model)
        return lambda: [h.remove() for h in handles]

    return attach


def engine_variant(case: ModelCase, plan: surgery.Plan) -> Callable[[], Callable[[], None]]:
    return lambda: surgery.apply(case.model, plan).remove


def calibrate(step: Callable[[], Any], block_s: float) -> tuple[int, float]:
    """Calls per timed block so that one block takes about ``block_s`` CPU seconds, and one call's time."""
    step()
    start = time.process_time()
    step()
    once = max(time.process_time() - start, 1e-6)
    return max(1, round(block_s / once)), once


@dataclass
class Row:
    model: str
    task: str
    mode: str
    times: dict[str, float]  # variant -> median per-call CPU seconds
    ratios: dict[str, float]  # variant -> median ratio to "hand" (to "TL bare" for TL)
    spread: tuple[float, float]  # quartiles of the per-round surgery/hand ratios
    reps: int
    rounds: int
    hooks: int  # hooks the task registers (hand-written and engine alike)
    extra_us_per_hook: float  # median over rounds of (surgery - hand) per call, divided by ``hooks``
    notes: list[str] = field(default_factory=list)
    spreads: dict[str, tuple[float, float]] = field(default_factory=dict)  # per ratio: quartiles over rounds


def bench_case(case: ModelCase, tasks: list[Task], peers: Any, check: bool = True) -> list[Row]:
    rows = []
    for task in tasks:
        plan = surgery.plan(case.model, task.actions)
        for mode in task.modes:
            if mode not in case.modes:
                continue
            if check:
                check_task(case, task, plan, mode)
            step = step_for(case, mode)
            variants = [
                Variant("bare", nothing, step),
                Variant("hand", hand_variant(case, task), step),
                Variant("surgery", engine_variant(case, plan), step),
            ]
            notes: list[str] = []
            if peers is not None and mode in case.peer_modes:
                found, notes = peers.variants(case, task, mode, check=check)
                variants += found
            reps, once = calibrate(step, case.block_s)
            case.model.zero_grad(set_to_none=True)
            step()  # gradients exist again before timing, as in every later call
            timing = interleave(variants, case.rounds, reps, warmup=0 if once > 0.1 else 1)
            case.model.zero_grad(set_to_none=True)
            handles, _ = task.hand(case.model)
            for h in handles:
                h.remove()
            rows.append(_row(case, task.name, mode, timing, reps, len(handles), notes))
            print(_row_line(rows[-1]), flush=True)
    return rows


def _row(case: ModelCase, task: str, mode: str, timing: Timing, reps: int, hooks: int, notes: list[str]) -> Row:
    times = {name: timing.median(name) for name in timing.rounds}
    ratios, spreads = {}, {}
    for name in timing.rounds:
        base = "TL bare" if name == "TL hooks" else "hand"
        if name not in ("hand", "TL bare"):
            ratios[name], spreads[name] = timing.ratio(name, base), timing.spread(name, base)
    ratios["hand/bare"] = timing.ratio("hand", "bare")
    extra = statistics.median(e - h for e, h in zip(timing.rounds["surgery"], timing.rounds["hand"])) / hooks * 1e6
    spread = timing.spread("surgery", "hand")
    return Row(case.name, task, mode, times, ratios, spread, reps, case.rounds, hooks, extra, notes, spreads)


def _row_line(row: Row) -> str:
    skip = ("surgery", "bare", "hand/bare")
    peers = "  ".join(f"{k} {fmt_ratio(v)}" for k, v in row.ratios.items() if k not in skip)
    return (
        f"{row.model:24} {row.task:42} {row.mode:8} hand {fmt_time(row.times['hand']):>9}"
        f"  surgery/hand {fmt_ratio(row.ratios['surgery'])}  hand/bare {fmt_ratio(row.ratios['hand/bare'])}  {peers}"
    )


CASES: dict[str, Callable[[], ModelCase]] = {
    "mlp64": lambda: mlp_case(64, rounds=21, block_s=0.04),
    "mlp1024": lambda: mlp_case(1024, rounds=11, block_s=0.08, peer_modes=("fwd",)),
    "gpt2": lambda: gpt2_case(small=True, rounds=5, block_s=0.15),
}
QUICK: dict[str, Callable[[], ModelCase]] = {
    "mlp16": lambda: mlp_case(16, rounds=3, block_s=0.01),
    "gpt2tiny": lambda: gpt2_case(small=False, rounds=3, block_s=0.01),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few rounds (a smoke run)")
    parser.add_argument("--peers", action="store_true", help="also time nnsight, pyvene and TransformerLens")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(CASES)} (or {', '.join(QUICK)})")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    peers = None
    if args.peers:
        sys.modules.setdefault("bench_overhead", sys.modules[__name__])  # one copy of this module, not two
        import bench_peers as peers
    rows: list[Row] = []
    table = QUICK if args.quick else CASES
    names = args.only.split(",") if args.only else list(table)
    for name in names:
        start = time.perf_counter()
        rows += bench_case({**CASES, **QUICK}[name](), TASKS, peers)
        print(f"({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    worst = max(r.ratios["surgery"] for r in rows)
    result = {
        "machine": machine(),
        "peers": peers.versions() if peers is not None else {},
        "target": TARGET,
        "worst_ratio": worst,
        "median_ratio": statistics.median(r.ratios["surgery"] for r in rows),
        "rows": [r.__dict__ for r in rows],
    }
    write_json(args.json, result)
    print(f"worst surgery/hand {worst:.3f} (target <= {TARGET})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
