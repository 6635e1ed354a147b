"""Hook overhead of surgery against the same hooks written by hand, timed interleaved in one process.

Tasks (scripts/bench/cases.py): the engine's fast paths (capture outputs, add to outputs,
``replace_forward`` with an ``expr``, ``modify_grad`` on a weight) on every model, and its slower
paths (input capture, ``item``, ``index``, an ``expr`` op, noise, in-place modules) on the
small MLP, where a hook's cost shows. Before timing, every task is checked: the engine and the
hand-written hooks give identical outputs, captures and gradients, and hook exactly the same
modules (unselected modules carry no hook at all).

Variants per case: ``bare`` (no hooks), ``hand``, ``surgery`` (applied once, outside the timer:
persistent, like hooks a user keeps) and ``surgery scoped`` (apply + forward + remove inside the
timer, per call, as nnsight's ``trace`` and TransformerLens' ``run_with_hooks`` do). A capture's
records are built inside the timer (they are lazy: built when read).

    python -m scripts.bench.overhead                 # full sizes, table on stdout
    python -m scripts.bench.overhead --quick --json out.json
    python -m scripts.bench.overhead --peers         # also nnsight, pyvene, TransformerLens
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
from torch import nn

import surgery
from scripts.bench.cases import TASKS, ModelCase, Task, gpt2_case, inplace_case, mlp_case, step_for
from scripts.bench.common import (
    Timing,
    Variant,
    fmt_ratio,
    fmt_time,
    interleave,
    machine,
    nothing,
    quartiles,
    verdict,
    write_json,
)
from surgery.core.restore import hooks_on

TARGET = 1.03  # engine / hand-written, every case on the small MLP
MARGIN = TARGET - 1  # rounds are added until the quartiles of surgery/hand are narrower than this
MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def own_hooks(module: nn.Module, skip: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Hooks on this module itself and on its own parameters (not its children's); ``skip``: tensor ids."""
    count = sum(len(getattr(module, name)) for name in MODULE_HOOK_DICTS)
    for tensor in module._parameters.values():
        if tensor is not None and id(tensor) not in skip:
            count += len(tensor._backward_hooks or {})
    return count


def same(a: Any, b: Any) -> bool:
    """Exactly equal: tensors bit for bit (``torch.equal``), containers element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@dataclass
class Outcome:
    output: torch.Tensor
    grads: dict[str, torch.Tensor]
    captures: dict[str, list[Any]]
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


def engine_attach(case: ModelCase, task: Task, plan: surgery.Plan) -> Callable[[], Any]:
    def attach() -> tuple[Callable[[], None], Callable[[], dict[str, list[Any]]]]:
        s = surgery.apply(case.model, plan)

        def captures() -> dict[str, list[Any]]:
            pick = (lambda c: (c.input, c.kwargs)) if task.captured == "input" else (lambda c: c.output)
            return {key: [pick(c) for c in r.calls] for per in s.captures.values() for key, r in per.items()}

        return s.remove, captures

    return attach


def hand_attach(case: ModelCase, task: Task) -> Callable[[], Any]:
    def attach() -> tuple[Callable[[], None], Callable[[], dict[str, list[Any]]]]:
        handles, store = task.hand(case.model)
        return (lambda: [h.remove() for h in handles]), (lambda: {k: list(v) for k, v in store.items()})

    return attach


def check_task(case: ModelCase, task: Task, plan: surgery.Plan, mode: str) -> None:
    """Engine == hand: outputs, gradients, captures, and the hooks on every module; nothing left after."""
    where = f"{case.name} / {task.name} / {mode}"
    if hooks_on(case.model):
        raise AssertionError(f"{where}: the model carries hooks before the check")
    engine = _run_once(case, mode, engine_attach(case, task, plan))
    hand = _run_once(case, mode, hand_attach(case, task))
    if hooks_on(case.model):
        raise AssertionError(f"{where}: hooks left on the model after remove()")
    if not torch.equal(engine.output, hand.output):
        diff = (engine.output - hand.output).abs().max().item()
        raise AssertionError(f"{where}: outputs differ (max abs {diff:g})")
    if not same(engine.grads, hand.grads):
        raise AssertionError(f"{where}: gradients differ")
    if not same(engine.captures, hand.captures):
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


def engine_variants(case: ModelCase, task: Task, plan: surgery.Plan, step: Callable[[], Any]) -> list[Variant]:
    """``surgery`` (applied outside the timer) and ``surgery scoped`` (apply + call + remove inside it).

    A capture's records are read in the step, so the lazy ``Call`` objects are built inside the timer.
    """
    held: dict[str, Any] = {}

    def build_records(s: Any) -> None:
        for per_action in s.captures.values():
            for record in per_action.values():
                record.calls  # noqa: B018  (reading builds them)

    def attach() -> Callable[[], None]:
        held["s"] = surgery.apply(case.model, plan)
        return held["s"].remove

    def persistent() -> Any:
        out = step()
        if task.captured:
            build_records(held["s"])
        return out

    def scoped() -> Any:
        s = surgery.apply(case.model, plan)
        try:
            out = step()
            if task.captured:
                build_records(s)
            return out
        finally:
            s.remove()

    return [Variant("surgery", attach, persistent), Variant("surgery scoped", nothing, scoped)]


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
    extra_us_spread: tuple[float, float] = (0.0, 0.0)  # quartiles of the per-round µs per hook
    verdict: str = ""  # surgery/hand against TARGET: met, within noise, over
    slow: bool = False
    headline: bool = False  # a row of the small MLP, where hook cost shows: the target is judged on these


def bench_case(case: ModelCase, tasks: list[Task], peers: Any, check: bool = True, headline: bool = False) -> list[Row]:
    """Check then time every task and mode of ``case``; ``peers``: the peers module, or None."""
    rows = []
    inplace: ModelCase | None = None
    for task in tasks:
        if task.inplace:
            inplace = inplace or inplace_case(case)
            if inplace is None:
                continue
        on = inplace if task.inplace and inplace is not None else case
        plan = surgery.plan(on.model, task.actions)
        for mode in task.modes:
            if mode not in on.modes:
                continue
            if check:
                check_task(on, task, plan, mode)
            step = step_for(on, mode)
            variants = [
                Variant("bare", nothing, step),
                Variant("hand", hand_variant(on, task), step),
                *engine_variants(on, task, plan, step),
            ]
            notes: list[str] = []
            if peers is not None and mode in on.peer_modes and not task.slow:
                found, notes = peers.variants(on, task, mode, check=check)
                variants += found
            reps, once = calibrate(step, on.block_s)
            on.model.zero_grad(set_to_none=True)
            step()  # gradients exist again before timing, as in every later call

            def settled(timing: Timing) -> bool:
                q1, q3 = timing.spread("surgery", "hand")
                return q3 - q1 < MARGIN

            timing = interleave(variants, on.rounds, reps, warmup=0 if once > 0.1 else 1, settled=settled,
                                max_s=on.max_s)  # fmt: skip
            on.model.zero_grad(set_to_none=True)
            handles, _ = task.hand(on.model)
            for h in handles:
                h.remove()
            row = _row(on, task, mode, timing, reps, len(handles), notes)
            row.headline = headline
            rows.append(row)
            print(_row_line(row), flush=True)
    return rows


def _row(case: ModelCase, task: Task, mode: str, timing: Timing, reps: int, hooks: int, notes: list[str]) -> Row:
    times = {name: timing.median(name) for name in timing.rounds}
    ratios, spreads = {}, {}
    for name in timing.rounds:
        base = "TL bare" if name == "TL hooks" else "hand"
        if name not in ("hand", "TL bare"):
            ratios[name], spreads[name] = timing.ratio(name, base), timing.spread(name, base)
    ratios["hand/bare"] = timing.ratio("hand", "bare")
    extra = [(e - h) / hooks * 1e6 for e, h in zip(timing.rounds["surgery"], timing.rounds["hand"])]
    spread = timing.spread("surgery", "hand")
    rounds = len(timing.rounds["hand"])
    row = Row(case.name, task.name, mode, times, ratios, spread, reps, rounds, hooks, statistics.median(extra), notes,
              spreads, quartiles(extra), verdict(*spread, TARGET), task.slow)  # fmt: skip
    return row


def _row_line(row: Row) -> str:
    skip = ("surgery", "bare", "hand/bare")
    peers = "  ".join(f"{k} {fmt_ratio(v)}" for k, v in row.ratios.items() if k not in skip)
    return (
        f"{row.model:24} {row.task:42} {row.mode:8} hand {fmt_time(row.times['hand']):>9}"
        f"  surgery/hand {fmt_ratio(row.ratios['surgery'])} ({row.spread[0]:.3f}-{row.spread[1]:.3f}, {row.rounds} r)"
        f"  {row.extra_us_per_hook:+.2f} µs/hook  {peers}"
    )


FAST = [t for t in TASKS if not t.slow]
# (case, tasks, headline): the slow paths only on the small MLP, where a hook's cost can show at all
CASES: dict[str, tuple[Callable[[], ModelCase], list[Task], bool]] = {
    "mlp64": (lambda: mlp_case(64, rounds=11, block_s=0.03, max_s=15.0), TASKS, True),
    "mlp1024": (lambda: mlp_case(1024, rounds=7, block_s=0.06, peer_modes=("fwd",), max_s=0.0), FAST, False),
    "gpt2": (lambda: gpt2_case(small=True, rounds=5, block_s=0.15, max_s=0.0), FAST, False),
}
QUICK: dict[str, tuple[Callable[[], ModelCase], list[Task], bool]] = {
    "mlp16": (lambda: mlp_case(16, rounds=3, block_s=0.01, max_s=1.0), TASKS, True),
    "gpt2tiny": (lambda: gpt2_case(small=False, rounds=3, block_s=0.01, max_s=0.0), FAST, False),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few rounds (a smoke run)")
    parser.add_argument("--peers", action="store_true", help="also time nnsight, pyvene and TransformerLens")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(CASES)} (or {', '.join(QUICK)})")
    parser.add_argument("--tasks", help="comma-separated task names (default: each case's own list)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    peers = None
    if args.peers:
        from scripts.bench import peers  # peers imports cases and common, never this module
    rows: list[Row] = []
    table = QUICK if args.quick else CASES
    names = args.only.split(",") if args.only else list(table)
    for name in names:
        start = time.perf_counter()
        make, tasks, headline = {**CASES, **QUICK}[name]
        if args.tasks:
            tasks = [t for t in tasks if t.name in args.tasks.split(",")]
        rows += bench_case(make(), tasks, peers, headline=headline)
        print(f"({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    head = [r for r in rows if r.headline]
    result = {
        "machine": machine(),
        "peers": peers.versions() if peers is not None else {},
        "target": TARGET,
        "headline_worst_ratio": max((r.ratios["surgery"] for r in head), default=None),
        "rows": [r.__dict__ for r in rows],
    }
    write_json(args.json, result)
    for r in head:
        print(f"{r.task} / {r.mode}: {r.verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
