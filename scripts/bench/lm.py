"""Generation under a surgery: 32 greedy tokens on a 4-layer GPT-2, a capture on every block, by hand and by surgery.

    python -m scripts.bench.lm [--quick] [--json out.json]

Both sides run ``model.generate`` (greedy, key/value cache on) on the same prompt; the hand-written side
registers a forward hook on each block appending its output to a list, surgery applies
``{kind: capture, select: "transformer.h.*"}`` once (persistent) — the records are built inside the timer.
A third row applies and removes the surgery around every generate call (scoped). Target: ≤ 1.05.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from scripts.bench.common import Variant, interleave, machine, verdict, write_json

TARGET = 1.05
NEW_TOKENS = 32


def run(rounds: int) -> dict[str, Any]:
    import torch
    import transformers

    import surgery

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=128, vocab_size=512,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config).eval()
    prompt = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    options = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    actions = {"c": {"kind": "capture", "select": "transformer.h.*"}}

    def generate() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(prompt, **options)

    store: dict[str, list[torch.Tensor]] = {}

    def by_hand() -> Any:
        store.clear()
        handles = [
            block.register_forward_hook(lambda m, a, out, i=i: store.setdefault(str(i), []).append(out.detach()))
            for i, block in enumerate(model.transformer.h)
        ]
        try:
            return generate()
        finally:
            for handle in handles:
                handle.remove()

    applied: list[Any] = []

    def attach() -> Any:
        applied.append(surgery.apply(model, actions))
        return lambda: applied.pop().remove()

    def persistent() -> Any:
        out = generate()
        for record in applied[-1].captures["c"].values():
            record.calls.clear()  # builds the records inside the timer, then forgets them like by_hand
        return out

    def scoped() -> Any:
        with surgery.apply(model, actions) as s:
            out = generate()
            for record in s.captures["c"].values():
                record.calls  # noqa: B018 - builds the records inside the timer
        return out

    plain = generate()
    assert torch.equal(by_hand(), plain) and torch.equal(scoped(), plain)  # hooks that only record change nothing
    timing = interleave(
        [
            Variant("hand-written hooks", lambda: lambda: None, by_hand),
            Variant("surgery (persistent)", attach, persistent),
            Variant("surgery (scoped)", lambda: lambda: None, scoped),
        ],
        rounds=rounds,
        reps=3,
        settled=lambda t: (lambda q: q[1] - q[0] < 0.05)(t.spread("surgery (persistent)", "hand-written hooks")),
        max_s=90.0,
    )
    rows = []
    for name in ("surgery (persistent)", "surgery (scoped)"):
        low, high = timing.spread(name, "hand-written hooks")
        rows.append({"variant": name, "ratio": timing.ratio(name, "hand-written hooks"), "quartiles": [low, high],
                     "verdict": verdict(low, high, TARGET)})  # fmt: skip
    return {
        "hand_s": timing.median("hand-written hooks"),
        "rows": rows,
        "rounds": len(timing.rounds["surgery (scoped)"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    result = run(3 if args.quick else 9)
    for row in result["rows"]:
        low, high = row["quartiles"]
        print(f"{row['variant']}: {row['ratio']:.3f} ({low:.3f}–{high:.3f}) {row['verdict']}")
    write_json(args.json, {"machine": machine(), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
