"""An SAE spliced into a GPT-2-shaped model with its features captured, against the same SAE in a hand-written hook.

    python -m scripts.bench.splice [--quick] [--json out.json]

A 6-layer GPT-2 (width 256, 4 heads, eager attention, random weights, torch on one thread), 2 prompts of 64
tokens; a standard SAE (d_sae 4096, ReLU, b_dec subtracted from the input) spliced into block 3's output.
Variants, timed interleaved in one process (CPU time, one call = one forward):

* ``bare``: the model alone (for scale).
* ``hand``: a forward hook computing ``relu((y - b_dec) @ W_enc + b_enc) @ W_dec + b_dec`` and appending the
  features to a list, as a researcher writes it.
* ``splice``: ``kind: splice`` with ``capture: true``; bit-identical to ``hand``.
* ``hand, error term`` / ``splice, error term``: the same plus ``y - reconstruction``.

Targets: splice / hand ≤ 1.05, with and without the error term. Memory (each in a fresh child process, RSS
added over 40 batches): features kept in memory, ``features_top: 32`` (values and indices per position), and
``to: disk`` with each batch's features written as one shard (what the CLI does), which stays flat.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from scripts.bench.common import ROOT, Variant, interleave, machine, nothing, run_child, verdict, write_json

TARGET = 1.05
LAYERS, WIDTH, HEADS, PROMPTS, TOKENS, D_SAE, SITE = 6, 256, 4, 2, 64, 4096, "transformer.h.3"
BATCHES, TOP = 40, 32
BARE, HAND, SPLICE = "bare", "hand", "splice"
HAND_ERR, SPLICE_ERR = "hand, error term", "splice, error term"
MEMORY_VARIANTS = ("features in memory", f"features_top: {TOP}", "to: disk")


def setup(directory: Path) -> tuple[Any, Any, dict[str, Any], str]:
    """The model, its token ids, the SAE's tensors and the path of its SAELens directory."""
    import torch
    import transformers

    from tests.splice_helpers import sae_tensors, write_saelens

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_positions=TOKENS,
                                     vocab_size=1024, bos_token_id=0, eos_token_id=0)  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 1024, (PROMPTS, TOKENS), generator=torch.Generator().manual_seed(0))
    tensors = sae_tensors(WIDTH, D_SAE)
    path = write_saelens(directory / "sae", tensors)
    return model, ids, tensors, str(path)


def hand_hook(t: dict[str, Any], store: list, error_term: bool) -> Any:
    """The SAE as a hand-written forward hook that keeps the features."""
    import torch

    w_enc, b_enc, w_dec, b_dec = t["W_enc"], t["b_enc"], t["W_dec"], t["b_dec"]

    def hook(m: Any, a: tuple, y: Any) -> Any:
        f = torch.relu((y - b_dec) @ w_enc + b_enc)
        store.append(f.detach())
        r = f @ w_dec + b_dec
        return r + (y - r) if error_term else r

    return hook


def action(path: str, error_term: bool, **extra: Any) -> dict[str, Any]:
    return {"sae": {"kind": "splice", "select": SITE, "module": {"path": path}, "capture": True,
                    "error_term": error_term, **extra}}  # fmt: skip


def speed(rounds: int, max_s: float) -> dict[str, Any]:
    import torch

    import surgery

    with tempfile.TemporaryDirectory() as tmp:
        model, ids, t, path = setup(Path(tmp))
        block = model.get_submodule(SITE)
        plans = {err: surgery.plan(model, action(path, err)) for err in (False, True)}

        def forward() -> Any:
            with torch.no_grad():
                return model(ids).logits

        def hand(err: bool) -> Any:
            def attach() -> Any:
                store: list = []
                handle = block.register_forward_hook(hand_hook(t, store, err))
                return handle.remove

            return attach

        def spliced(err: bool) -> Any:
            def attach() -> Any:
                s = surgery.apply(model, plans[err])
                return s.remove

            return attach

        for err in (False, True):  # the same numbers, bit for bit
            detach = hand(err)()
            want = forward()
            detach()
            with surgery.apply(model, plans[err]):
                assert torch.equal(forward(), want), f"splice (error_term={err}) differs from the hand-written hook"
        variants = [
            Variant(BARE, nothing, forward),
            Variant(HAND, hand(False), forward),
            Variant(SPLICE, spliced(False), forward),
            Variant(HAND_ERR, hand(True), forward),
            Variant(SPLICE_ERR, spliced(True), forward),
        ]

        def settled(timing: Any) -> bool:
            pairs = [(SPLICE, HAND), (SPLICE_ERR, HAND_ERR)]
            return all((lambda q, m: q[1] - q[0] < 0.04 * m)(timing.spread(*p), timing.ratio(*p)) for p in pairs)

        timing = interleave(variants, rounds=rounds, reps=5, settled=settled, max_s=max_s)
    ratios = []
    for name, base, target in [(SPLICE, HAND, TARGET), (SPLICE_ERR, HAND_ERR, TARGET), (HAND, BARE, None),
                               (SPLICE, BARE, None)]:  # fmt: skip
        low, high = timing.spread(name, base)
        ratios.append({"variant": name, "base": base, "ratio": timing.ratio(name, base), "quartiles": [low, high],
                       "target": target, "verdict": verdict(low, high, target) if target else None})  # fmt: skip
    return {"times": {v.name: timing.median(v.name) for v in variants}, "ratios": ratios,
            "rounds": len(timing.rounds[HAND])}  # fmt: skip


def child(variant: str) -> dict[str, Any]:
    """RSS added by ``BATCHES`` forwards keeping features as ``variant`` says, in this fresh process."""
    import torch

    import surgery
    from scripts.bench.memory import rss_mib
    from surgery.files.write import write_tensors

    with tempfile.TemporaryDirectory() as tmp:
        model, ids, _, path = setup(Path(tmp))
        extra = (
            {"features_top": TOP} if variant == MEMORY_VARIANTS[1] else {"to": "disk"} if variant == "to: disk" else {}
        )
        with torch.no_grad(), surgery.apply(model, action(path, True, **extra)) as s:
            model(ids)  # warm: the first forward's allocations are not the features'
            s.take_streamed() if extra.get("to") else s.captures["sae"][SITE].calls.clear()
            before = rss_mib()
            for batch in range(BATCHES):
                model(ids)
                if extra.get("to") == "disk":  # one shard per batch, as the CLI writes them
                    write_tensors(Path(tmp) / f"shard-{batch:05d}.safetensors", s.take_streamed())
            added = rss_mib() - before
            kept = sum(
                sum(v.nbytes for v in (c.features.values() if isinstance(c.features, dict) else [c.features]))
                for c in s.captures["sae"][SITE].calls
            )
    return {"variant": variant, "added_mib": added, "held_mib": kept / 2**20, "batches": BATCHES}


def memory() -> list[dict[str, Any]]:
    rows = []
    for variant in MEMORY_VARIANTS:
        run = run_child([sys.executable, "-m", "scripts.bench.splice", "--child", variant], cwd=ROOT)
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=MEMORY_VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    result = speed(rounds=4 if args.quick else 8, max_s=30 if args.quick else 120)
    for name, seconds in result["times"].items():
        print(f"{name:20} {seconds * 1e3:8.2f} ms per forward")
    for row in result["ratios"]:
        low, high = row["quartiles"]
        print(f"{row['variant']} / {row['base']}: {row['ratio']:.3f} ({low:.3f}–{high:.3f}) {row['verdict'] or ''}")
    mem = memory()
    for row in mem:
        print(f"{row['variant']:20} RSS added {row['added_mib']:7.1f} MiB, features held {row['held_mib']:7.2f} MiB")
    write_json(args.json, {"machine": machine(), **result, "memory": mem})
    return 0


if __name__ == "__main__":
    sys.exit(main())
