"""Real-data evaluation: ``surgery.evaluate`` against a hand-written loop, and memory as the data set grows.

    python -m scripts.bench.data [--quick] [--json out.json]

Speed: the trained CNN on the digits (all 1797, batches of 64) with ``linearize``, scored for the surgered
and the unmodified model. ``surgery.evaluate`` against the same hooks registered by hand and the same
metrics (accuracy, loss, agreement, kl) computed by hand on the same DataLoader, the unmodified pass with
the hooks switched off. Both sides build their DataLoader iterator inside the timer. Target ≤ 1.05.

Memory: peak RSS of a child process evaluating N and 10·N examples streamed from a .safetensors file
(read a batch at a time). Target: growth ≤ 10 %.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from scripts.bench.common import ROOT, Variant, interleave, machine, nothing, run_child, verdict, write_json

SPEED_TARGET = 1.05
MEMORY_TARGET = 1.10


def speed(rounds: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import surgery
    from surgery.data.loader import data_loader, dataset_input
    from surgery.models.cnn import digits_cnn

    torch.set_num_threads(1)
    model = digits_cnn().eval()
    loader = data_loader(dataset_input({"source": "digits", "split": "all", "shape": [1, 1, 28, 28]}))
    plan = surgery.plan(model, "linearize")
    acts = [m for m in model.modules() if isinstance(m, torch.nn.ReLU)]
    on = [True]

    def identity(m: Any, args: tuple[Any, ...], out: Any) -> Any:
        return args[0] if on[0] else None

    def by_hand() -> dict[str, float]:
        handles = [m.register_forward_hook(identity) for m in acts]
        sums = dict.fromkeys(("accuracy", "loss", "agreement", "kl"), 0.0)
        n = 0
        try:
            with torch.no_grad():
                for x, y in loader:
                    on[0] = True
                    after = model(x).double()
                    on[0] = False
                    before = model(x).double()
                    sums["accuracy"] += float((after.argmax(-1) == y).sum())
                    sums["loss"] += float(F.cross_entropy(after, y, reduction="sum"))
                    sums["agreement"] += float((after.argmax(-1) == before.argmax(-1)).sum())
                    p, q = before.log_softmax(-1), after.log_softmax(-1)
                    sums["kl"] += float(F.kl_div(q, p, log_target=True, reduction="sum"))
                    n += len(y)
        finally:
            for handle in handles:
                handle.remove()
        return {k: v / n for k, v in sums.items()}

    def engine() -> dict[str, Any]:
        return surgery.evaluate(model, loader, plan, metrics=["accuracy", "loss", "agreement", "kl"])

    mine, theirs = engine()["surgered"], by_hand()
    assert all(abs(mine[k] - theirs[k]) < 1e-9 for k in mine), (mine, theirs)  # the same numbers first
    timing = interleave(
        [Variant("hand-written loop", nothing, by_hand), Variant("surgery.evaluate", nothing, engine)],
        rounds=rounds,
        reps=1,
    )
    ratio = timing.ratio("surgery.evaluate", "hand-written loop")
    low, high = timing.spread("surgery.evaluate", "hand-written loop")
    return {
        "examples": len(loader.dataset),  # type: ignore[arg-type]
        "hand_s": timing.median("hand-written loop"),
        "surgery_s": timing.median("surgery.evaluate"),
        "ratio": ratio,
        "quartiles": [low, high],
        "rounds": len(timing.rounds["surgery.evaluate"]),
        "verdict": verdict(low, high, SPEED_TARGET),
        "accuracy": {"unmodified": engine()["unmodified"]["accuracy"], "surgered": mine["accuracy"]},
    }


def child(path: str) -> dict[str, Any]:
    """One evaluation over the file at ``path`` in this (fresh) process."""
    import torch

    import surgery
    from surgery.data.loader import data_loader, dataset_input
    from surgery.models.cnn import digits_cnn

    torch.set_num_threads(1)
    loader = data_loader(dataset_input({"path": path, "batch_size": 64}))
    result = surgery.evaluate(digits_cnn().eval(), loader, "linearize", metrics=["accuracy", "kl"])
    return {"examples": len(loader.dataset), "accuracy": result["surgered"]["accuracy"]}  # type: ignore[arg-type]


def write_data(path: str, n: int) -> None:
    """``n`` random 1×28×28 images and labels as a .safetensors file (run in its own process, see ``memory``)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    save_file({"x": x, "y": y}, path)


def memory(small: int) -> dict[str, Any]:
    """Peak RSS of evaluating ``small`` and ``10 * small`` examples, each in a fresh process.

    The files are written by separate processes: a child's peak RSS on Linux starts from what its parent
    held when it forked, so a parent holding the larger data set would make it look as if memory grew.
    """
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for n in (small, 10 * small):
            path = Path(directory) / f"d{n}.safetensors"
            run_child([sys.executable, "-m", "scripts.bench.data", "--write", str(path), "--n", str(n)], cwd=ROOT)
            run = run_child([sys.executable, "-m", "scripts.bench.data", "--child", str(path)], cwd=ROOT)
            rows.append({"examples": n, "file_mib": path.stat().st_size / 2**20, "peak_rss_mib": run.peak_rss_mib})
    growth = rows[1]["peak_rss_mib"] / rows[0]["peak_rss_mib"]
    return {"rows": rows, "growth": growth, "met": growth <= MEMORY_TARGET}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, a smaller data set")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--write", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write:
        write_data(args.write, args.n)
        return 0
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    mem = memory(500 if args.quick else 2000)  # before speed(): children fork from a parent without torch loaded
    fast = speed(3 if args.quick else 9)
    print(f"evaluate / hand-written loop: {fast['ratio']:.3f} (quartiles {fast['quartiles'][0]:.3f}"
          f"–{fast['quartiles'][1]:.3f}) over {fast['examples']} examples: {fast['verdict']}")  # fmt: skip
    print(f"peak RSS {mem['rows'][0]['peak_rss_mib']:.0f} → {mem['rows'][1]['peak_rss_mib']:.0f} MiB over 10× the"
          f" examples: ×{mem['growth']:.3f} ({'met' if mem['met'] else 'not met'})")  # fmt: skip
    write_json(args.json, {"machine": machine(), "speed": fast, "memory": mem})
    return 0


if __name__ == "__main__":
    sys.exit(main())
