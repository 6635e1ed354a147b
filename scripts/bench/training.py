"""Inside a training loop: a Lightning fit with ``SurgeryCallback`` against the same hooks written by hand.

    python -m scripts.bench.training [--quick] [--json out.json]

20 training steps of an MLP (32 → 64 → 64 → 10, batch 32, SGD) with the first layer frozen, the last
weight's gradient clipped to norm 0.1 and running statistics of the hidden activations logged every 5
steps (mean, std, norm). By hand: ``requires_grad_(False)``, a tensor hook and a forward hook set up in
the LightningModule, ``self.log`` of the same statistics. Each side builds its Trainer and runs ``fit``
inside the timer (CPU time). Target: ≤ 1.05. A third variant adds a callback that does nothing to the
hand-written fit: what Lightning charges for any callback (it wraps every hook it calls on each one).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from scripts.bench.common import Variant, interleave, machine, nothing, verdict, write_json

TARGET = 1.05
ROUNDS, REPS = 121, 1  # many short rounds: the three fits of a round run within a quarter second
STEPS, EVERY, MAX_NORM = 20, 5, 0.1
RECIPE = {
    "freeze": {"kind": "freeze", "select": "net.0"},
    "clip": {"kind": "modify_grad", "select": "net.4", "param": "weight", "op": "clip_norm", "max_norm": MAX_NORM},
    "acts": {"kind": "capture", "select": "net.3", "reduce": "stats"},
}


def run(rounds: int, reps: int = 1) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from surgery.integrations.lightning import SurgeryCallback

    torch.set_num_threads(1)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(32 * STEPS, 32, generator=gen), torch.randint(0, 10, (32 * STEPS,),
                        generator=gen)), batch_size=32)  # fmt: skip

    class Net(pl.LightningModule):
        def __init__(self, by_hand: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
            self.by_hand, self.seen = by_hand, []

        def setup(self, stage: str) -> None:
            if not self.by_hand:
                return
            self.net[0].requires_grad_(False)

            def clip(g: torch.Tensor) -> torch.Tensor:
                return g * (MAX_NORM / (torch.linalg.vector_norm(g) + 1e-6)).clamp(max=1.0)

            self.net[4].weight.register_hook(clip)
            self.net[3].register_forward_hook(lambda m, a, out: self.seen.append(out.detach().double()))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            if self.by_hand and (batch_idx + 1) % EVERY == 0:
                rows = torch.cat(self.seen)
                self.seen.clear()
                for stat, value in (("mean", rows.mean()), ("std", rows.std(correction=0)),
                                    ("norm", rows.pow(2).sum(1).mean().sqrt())):  # fmt: skip
                    self.log(f"hand/acts/net.3/{stat}", value)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    class Empty(pl.Callback):
        """A callback that does nothing: what Lightning charges for having any callback at all."""

    def fit(by_hand: bool, empty: bool = False) -> nn.Module:
        callbacks = [Empty()] if empty else [] if by_hand else [SurgeryCallback(RECIPE, log_every_n_steps=EVERY)]
        trainer = pl.Trainer(max_steps=STEPS, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                             enable_model_summary=False, callbacks=callbacks, log_every_n_steps=EVERY,
                             accelerator="cpu", devices=1)  # fmt: skip
        model = Net(by_hand)
        trainer.fit(model, loader)
        return model

    hand, mine = fit(True), fit(False)
    fit(True, empty=True)
    for a, b in zip(hand.net.parameters(), mine.net.parameters(), strict=True):
        assert torch.equal(a, b), "the two trainings must end with the same weights"
    timing = interleave(
        [
            Variant("by hand", nothing, lambda: fit(True)),
            Variant("SurgeryCallback", nothing, lambda: fit(False)),
            Variant("by hand + an empty callback", nothing, lambda: fit(True, empty=True)),
        ],
        rounds=rounds,
        reps=reps,
        warmup=0,  # the fits of each variant above warmed everything a fit uses
    )
    low, high = timing.spread("SurgeryCallback", "by hand")
    parts = breakdown(lambda: fit(False), fits=3 if rounds < 10 else 9)
    return {
        "hand_s": timing.median("by hand"),
        "surgery_s": timing.median("SurgeryCallback"),
        "ratio": timing.ratio("SurgeryCallback", "by hand"),
        "quartiles": [low, high],
        "empty_callback_s": timing.median("by hand + an empty callback"),
        "empty_callback_ratio": timing.ratio("by hand + an empty callback", "by hand"),
        "rounds": len(timing.rounds["by hand"]),
        "reps": reps,
        "verdict": verdict(low, high, TARGET),
        "parts_ms": parts,
    }


def breakdown(fit: Callable[[], Any], fits: int) -> dict[str, float]:
    """CPU milliseconds per fit in the callback's own parts (median over ``fits`` fits, after the timed rounds)."""
    import surgery.core.running as running
    import surgery.integrations.training as training

    parts = {  # name → (owner, attribute)
        "setup: plan and apply": (training.TrainingSurgery, "apply"),
        "teardown: remove and check": (training.TrainingSurgery, "remove"),
        "logging: fold and statistics": (training.TrainingSurgery, "statistics"),
        "hooks: take each call's copy": (running.Running, "add"),
    }
    spent = dict.fromkeys(parts, 0)
    originals = {name: getattr(owner, attr) for name, (owner, attr) in parts.items()}

    def timed(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            begin = time.process_time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] += time.process_time_ns() - begin

        return call

    per_fit: dict[str, list[float]] = {name: [] for name in parts}
    try:
        for name, (owner, attr) in parts.items():
            setattr(owner, attr, timed(name, originals[name]))
        for _ in range(fits):
            spent.update(dict.fromkeys(parts, 0))
            fit()
            for name in parts:
                per_fit[name].append(spent[name] / 1e6)
    finally:
        for name, (owner, attr) in parts.items():
            setattr(owner, attr, originals[name])
    return {name: statistics.median(values) for name, values in per_fit.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    # a busy machine moves each fit: many rounds of one fit of each variant, interleaved, order alternating
    result = run(3, 1) if args.quick else run(ROUNDS, REPS)
    low, high = result["quartiles"]
    print(f"SurgeryCallback / by hand: {result['ratio']:.3f} ({low:.3f}–{high:.3f}) {result['verdict']}")
    write_json(args.json, {"machine": machine(), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
