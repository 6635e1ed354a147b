"""DDP on 2 ranks (torchrun, gloo, CPU): training steps with surgery's hooks against the same hooks by hand.

A 4-layer MLP (64 → 256 → 256 → 256 → 10, ReLU) in ``DistributedDataParallel``, batch 32 per rank,
SGD; one step is zero_grad, forward, cross-entropy, backward (DDP all-reduces the gradients), optimizer
step. The recipe, applied with ``surgery.apply`` to the DDP-wrapped model by bare names:

- ``modify_output type: ReLU op: mul value: 0.9`` (every activation scaled),
- ``capture type: ReLU reduce: mean`` (a running mean of each activation over steps, nothing kept per step),
- ``modify_grad type: Linear param: weight op: clip_norm max_norm: 1.0`` (a tensor hook per weight).

The hand-written variant registers the same hooks on the same modules in plain PyTorch. Before timing,
each rank checks from the same weights that both variants give bit-identical outputs, loss, gradients
(after the all-reduce), captured means and weights after the step. Variants (bare, hand, surgery) run
interleaved, the same fixed schedule on both ranks (a collective needs both); each round's CPU time is
summed over the ranks, its wall time is rank 0's. Target: surgery / hand ≤ 1.05 per step, met only when
the whole interquartile range of the per-round ratio is at or under it.

    python -m scripts.bench.ddp [--quick] [--json out.json]       # launches torchrun itself
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from scripts.bench.common import ROOT, Timing, Variant, machine, nothing, quartiles, verdict, write_json

TARGET = 1.05
SCALE, MAX_NORM = 0.9, 1.0
ACTIONS = {
    "scale": {"kind": "modify_output", "type": "ReLU", "op": "mul", "value": SCALE},
    "stats": {"kind": "capture", "type": "ReLU", "reduce": "mean"},
    "clip": {"kind": "modify_grad", "type": "Linear", "param": "weight", "op": "clip_norm", "max_norm": MAX_NORM},
}


def launch(args: list[str]) -> int:
    """``torchrun --standalone --nproc_per_node=2 -m scripts.bench.ddp --worker ARGS`` (PyTorch's launcher)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "scripts.bench.ddp", "--worker", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=ROOT, env=env, check=False).returncode


def worker(quick: bool, out: str | None) -> None:
    """One rank: check both variants agree, then time them interleaved; rank 0 writes the result."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import surgery

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights on every rank (DDP also broadcasts rank 0's)
    layers: list[nn.Module] = []
    for a, b in [(64, 256), (256, 256), (256, 256)]:
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = DistributedDataParallel(nn.Sequential(*layers, nn.Linear(256, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(32, 64, generator=data), torch.randint(0, 10, (32,), generator=data)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        optimizer.step()
        return out, loss

    means: dict[str, Any] = {}
    hand = hand_hooks(model.module, means)
    findings = check(model, step, hand, means)
    ok = torch.tensor([int(all(findings.values()))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise AssertionError(f"rank {rank}: surgery and the hand-written hooks differ: {findings}")

    def attach_surgery(actions: dict[str, Any]) -> Callable[[], Callable[[], None]]:
        return lambda: surgery.apply(model, actions).remove

    def attach_hand(register: Callable[[], list[Any]]) -> Callable[[], Callable[[], None]]:
        def attach() -> Callable[[], None]:
            handles = register()
            return lambda: [h.remove() for h in handles]

        return attach

    variants = [Variant("bare", nothing, step), Variant("hand", attach_hand(hand), step),
                Variant("surgery", attach_surgery(ACTIONS), step)]  # fmt: skip
    reps = calibrated(step, 0.02 if quick else 0.15, dist)
    cpu, wall = timed(variants, 3 if quick else 21, reps)
    each: list[Variant] = []  # where the difference sits: each action alone, by hand and by surgery
    for name, action in ACTIONS.items():
        each += [Variant(f"hand {name}", attach_hand(hand_hooks(model.module, {}, name)), step),
                 Variant(f"surgery {name}", attach_surgery({name: action}), step)]  # fmt: skip
    each_cpu, _ = timed(each, 3 if quick else 9, reps)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"cpu": {**cpu, **each_cpu}, "wall": wall, "findings": findings})
    if rank == 0:
        both = gathered[0]["cpu"]
        summed = Timing({n: [sum(r) for r in zip(*(g["cpu"][n] for g in gathered))] for n in both})
        write_json(out, result(summed, Timing(wall), reps, world, gathered))
    dist.barrier()  # no rank leaves while another still uses gloo
    dist.destroy_process_group()


def hand_hooks(inner: Any, means: dict[str, Any], only: str | None = None) -> Callable[[], list[Any]]:
    """The recipe (or its action ``only``) in plain PyTorch: a function that registers its hooks, returns handles."""
    import torch
    from torch import nn

    def scale(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * SCALE

    def running_mean(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            x = output.detach().double()
            n, mean = x.shape[0], x.mean(0)
            if name not in means:
                means[name] = [n, mean]
                return
            count, old = means[name]
            total = count + n
            means[name] = [total, old + (mean - old) * (n / total)]

        return hook

    def clip(grad: torch.Tensor) -> torch.Tensor:
        return grad * (MAX_NORM / (torch.linalg.vector_norm(grad) + 1e-6)).clamp(max=1.0)

    def register() -> list[Any]:
        handles = []
        for name, m in inner.named_modules():
            if isinstance(m, nn.ReLU):  # in recipe order: the capture sees the scaled output
                if only in (None, "scale"):
                    handles.append(m.register_forward_hook(scale))
                if only in (None, "stats"):
                    handles.append(m.register_forward_hook(running_mean(name)))
            elif isinstance(m, nn.Linear) and only in (None, "clip"):
                handles.append(m.weight.register_hook(clip))
        return handles

    return register


def check(model: Any, step: Callable[[], Any], hand: Callable[[], list[Any]], means: dict[str, Any]) -> dict[str, bool]:
    """Two steps from the same weights, by hand and by surgery: equal outputs, loss, gradients, means, weights."""
    import torch

    import surgery

    start = {k: v.clone() for k, v in model.state_dict().items()}

    def two_steps(attach: Callable[[], Callable[[], Any]]) -> dict[str, Any]:
        model.load_state_dict(start)
        detach = attach()
        try:
            outs = [step() for _ in range(2)]  # two: the running mean's merge runs too
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            found = {"out": [o for o, _ in outs], "loss": [loss for _, loss in outs], "grads": grads}
            return {**found, "weights": {k: v.clone() for k, v in model.state_dict().items()}}
        finally:
            detach()

    def by_hand() -> Callable[[], Any]:
        means.clear()
        handles = hand()
        return lambda: [h.remove() for h in handles]

    held: dict[str, Any] = {}

    def by_surgery() -> Callable[[], Any]:
        held["s"] = surgery.apply(model, ACTIONS)
        return held["s"].remove

    a = two_steps(by_hand)
    hand_means = {name: mean for name, (_, mean) in means.items()}
    b = two_steps(by_surgery)
    records = held["s"].captures["stats"]
    engine_means = {name.removeprefix("module."): r.reduced["output"]["mean"] for name, r in records.items()}
    model.load_state_dict(start)

    def equal(p: Any, q: Any) -> bool:
        if isinstance(p, dict):
            return p.keys() == q.keys() and all(equal(p[k], q[k]) for k in p)
        if isinstance(p, list):
            return len(p) == len(q) and all(equal(u, v) for u, v in zip(p, q))
        return bool(torch.equal(p, q))

    found = {k: equal(a[k], b[k]) for k in ("out", "loss", "grads", "weights")}
    names_match = sorted(engine_means) == sorted(hand_means)
    found["captured means"] = names_match and all(
        torch.equal(engine_means[k].float(), hand_means[k].float()) for k in hand_means
    )
    return found


def calibrated(step: Callable[[], Any], block_s: float, dist: Any) -> int:
    """Steps per timed block (about ``block_s`` CPU seconds), decided on rank 0 so both ranks run as many."""
    step()
    start = time.process_time()
    for _ in range(3):
        step()
    reps = [max(1, round(block_s / max((time.process_time() - start) / 3, 1e-6)))]
    dist.broadcast_object_list(reps, src=0)
    return int(reps[0])


def timed(variants: Sequence[Variant], rounds: int, reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """common.interleave's schedule (A B C, C B A, ...), fixed so both ranks agree; per-step CPU and wall seconds."""
    cpu: dict[str, list[float]] = {v.name: [] for v in variants}
    wall: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for variant in variants if r % 2 == 0 else list(reversed(variants)):
            detach = variant.attach()
            try:
                variant.step()
                gc.collect(1)
                c, w = time.process_time_ns(), time.perf_counter_ns()
                for _ in range(reps):
                    variant.step()
                cpu[variant.name].append((time.process_time_ns() - c) / reps / 1e9)
                wall[variant.name].append((time.perf_counter_ns() - w) / reps / 1e9)
            finally:
                detach()
    return cpu, wall


def result(cpu: Timing, wall: Timing, reps: int, world: int, gathered: list[Any]) -> dict[str, Any]:
    """The JSON: per-step times, surgery/hand and hand/bare ratios with quartiles, the verdict, the checks."""
    by_action = {}
    for n in ACTIONS:
        engine, by_hand = f"surgery {n}", f"hand {n}"
        extra_ms = (cpu.median(engine) - cpu.median(by_hand)) * 1e3
        by_action[n] = {
            "ratio": cpu.ratio(engine, by_hand),
            "quartiles": cpu.spread(engine, by_hand),
            "extra_ms": extra_ms,
        }
    low, high = cpu.spread("surgery", "hand")
    ratio = cpu.ratio("surgery", "hand")
    print(f"DDP {world} ranks: hand {cpu.median('hand') * 1e3:.2f} ms CPU per step (both ranks),"
          f" surgery/hand {ratio:.3f} ({low:.3f}-{high:.3f}), wall {wall.ratio('surgery', 'hand'):.3f}",
          flush=True)  # fmt: skip
    return {
        "machine": machine(),
        "world_size": world,
        "actions": ACTIONS,
        "model": "MLP 64 → 256 → 256 → 256 → 10 (ReLU), batch 32 per rank, SGD lr 1e-3, cross-entropy",
        "reps": reps,
        "rounds": len(cpu.rounds["hand"]),
        "cpu_s": {n: cpu.median(n) for n in ("bare", "hand", "surgery")},
        "by_action": by_action,
        "wall_s": {n: wall.median(n) for n in wall.rounds},
        "ratio": ratio,
        "quartiles": [low, high],
        "wall_ratio": wall.ratio("surgery", "hand"),
        "wall_quartiles": list(wall.spread("surgery", "hand")),
        "hand_over_bare": cpu.ratio("hand", "bare"),
        "hand_over_bare_quartiles": list(quartiles(cpu.ratios("hand", "bare"))),
        "target": TARGET,
        "verdict": verdict(low, high, TARGET),
        "checks": [g["findings"] for g in gathered],
        "all_rounds_cpu_s": {n: cpu.rounds[n] for n in ("bare", "hand", "surgery")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short blocks, 3 rounds")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by launch() for each rank
    args = parser.parse_args(argv)
    if not args.worker:
        return launch([*(["--quick"] if args.quick else []), *(["--json", args.json] if args.json else [])])
    worker(args.quick, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
