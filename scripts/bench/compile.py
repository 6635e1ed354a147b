"""torch.compile and surgery: graph breaks, outputs against eager, compiled speed, surgery after compiling.

1. For each built-in op and each expression kind, ``torch._dynamo.explain`` on the surgered model
   counts graphs and graph breaks, and the ``aot_eager`` compiled output is compared with eager.
2. ``capture`` records every call: compiled, the recording hook makes Dynamo recompile on every
   call until its cache limit (8), then fall back to eager; counted over 12 calls.
3. Inductor: the compiled surgered model against the same hooks written by hand, compiled the
   same way, timed interleaved (CPU time, one thread).
4. A surgery applied after compiling: torch keeps running the graph it compiled before, so the
   surgery is silently ignored; we report whether ``surgery`` noticed (a warning or an error).

    python -m scripts.bench.compile [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters

import surgery
from scripts.bench.common import Variant, interleave, machine, write_json
from surgery.errors import CompiledModelWarning
from surgery.models.mlp import MLP

CASES: dict[str, dict[str, Any]] = {
    "modify_output add": {"a": {"kind": "modify_output", "type": "Linear", "op": "add", "value": 1.0}},
    "modify_output mul": {"a": {"kind": "modify_output", "type": "Linear", "op": "mul", "value": 0.5}},
    "modify_output clamp": {"a": {"kind": "modify_output", "type": "Linear", "op": "clamp", "min": -1.0, "max": 1.0}},
    "modify_output zero + index": {"a": {"kind": "modify_output", "type": "Linear", "op": "zero", "index": "[:, :2]"}},
    "modify_output noise": {"a": {"kind": "modify_output", "type": "Linear", "op": "noise", "std": 0.1}},
    "modify_input mul": {"a": {"kind": "modify_input", "type": "Linear", "op": "mul", "value": 0.5}},
    "replace_forward identity": {"a": {"kind": "replace_forward", "type": "ReLU", "fn": "identity"}},
    "replace_forward linear": {"a": {"kind": "replace_forward", "type": "Linear", "fn": "linear"}},
    "capture (one call)": {"a": {"kind": "capture", "type": "Linear"}},
    "expr: modify_output": {"a": {"kind": "modify_output", "type": "Linear", "op": "expr", "expr": "output * 2 + 1"}},
    "expr: replace_forward x": {"a": {"kind": "replace_forward", "type": "ReLU", "expr": "x * sigmoid(x)"}},
    "expr: replace_forward module": {
        "a": {"kind": "replace_forward", "type": "Linear", "expr": "linear(x, module.weight, module.bias) * 2"}
    },
}
TIMED = {  # built-in op and an expression together, the inductor timing case
    "add": {"kind": "modify_output", "type": "Linear", "op": "add", "value": 1.0},
    "act": {"kind": "replace_forward", "type": "ReLU", "expr": "x * sigmoid(x)"},
}


def hand_timed(model: nn.Module) -> list[Any]:
    """The TIMED surgery written by hand."""
    handles = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(lambda mod, args, out: out + 1.0))
        elif isinstance(m, nn.ReLU):
            handles.append(m.register_forward_hook(lambda mod, args, out: args[0] * torch.sigmoid(args[0])))
    return handles


def make_model(width: int, depth: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MLP(in_features=width, hidden=width, depth=depth, out_features=width).eval(), torch.randn(8, width)


def explain_case(actions: dict[str, Any], model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Graphs, graph breaks (and why) and whether aot_eager gives the eager output."""
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():  # a fresh apply for each run: seeded ops (noise) start from their seed again
        with surgery.apply(model, actions):
            want = model(x)
        with surgery.apply(model, actions), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            explained = torch._dynamo.explain(model)(x)
        reasons = sorted({_explanation(text) for text in counters["graph_break"]})
        torch._dynamo.reset()
        with surgery.apply(model, actions), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.compile(model, backend="aot_eager")(x)
    return {
        "graphs": explained.graph_count,
        "graph_breaks": explained.graph_break_count,
        "reasons": reasons,
        "equal_to_eager": bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6)),
    }


def _explanation(text: str) -> str:
    """The 'Explanation:' line of a Dynamo graph-break message (its first line otherwise)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    found = next((line for line in lines if line.startswith("Explanation:")), lines[0] if lines else "")
    return found.removeprefix("Explanation:").strip()[:140]


def capture_recompiles(model: nn.Module, x: torch.Tensor, calls: int = 12) -> dict[str, Any]:
    """Graphs Dynamo builds over ``calls`` compiled calls with a capture, and whether every call was recorded."""
    torch._dynamo.reset()
    counters.clear()
    with surgery.apply(model, CASES["capture (one call)"]) as s, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(model, backend="aot_eager")
        with contextlib.redirect_stderr(io.StringIO()):
            for _ in range(calls):
                compiled(x)
        recorded = {len(r.calls) for r in s.captures["a"].values()}
    return {
        "calls": calls,
        "graphs": int(counters["stats"]["unique_graphs"]),
        "cache_size_limit": torch._dynamo.config.cache_size_limit,
        "every_call_recorded": recorded == {calls},
    }


def surgery_after_compile(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Apply an add after a compiled call, to the inner model and to the compiled wrapper: is it honoured?
    Did ``surgery.apply`` warn (a CompiledModelWarning, or anything it printed)?"""
    actions = CASES["modify_output add"]
    result: dict[str, Any] = {}
    for target in ("inner model", "compiled wrapper"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = compiled(x)
            with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()) as out:
                ahead = len(caught)
                s = surgery.apply(model if target == "inner model" else compiled, actions)
                at_apply = caught[ahead:]
                printed = err.getvalue().strip() or out.getvalue().strip()
                try:
                    after = compiled(x)
                    eager_changed = not torch.equal(model(x), before)
                finally:
                    s.remove()
        mine = [w for w in caught if "surgery" in w.filename or "surgery" in str(w.message).lower()]
        result[target] = {
            "eager_model_changed": eager_changed,
            "compiled_output_changed": not torch.equal(after, before),
            "surgery_warned": any(issubclass(w.category, CompiledModelWarning) for w in at_apply) or bool(printed),
            "messages": sorted({f"{w.category.__name__}: {str(w.message)[:240]}" for w in mine}),
        }
    torch._dynamo.reset()
    return result


def own_forward(model: nn.Module) -> nn.Module:
    """Give ``model`` its own copy of its class's forward code: Dynamo caches graphs (and gives up on a
    frame after a graph break in a loop) per code object, so two instances of one class would share."""
    function = type(model).forward
    code = function.__code__.replace()
    copied = types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    model.forward = types.MethodType(copied, model)
    return model


def inductor_ratio(model: nn.Module, x: torch.Tensor, rounds: int, reps: int) -> dict[str, Any]:
    """Compiled (inductor) surgered vs compiled hand-written hooks, same model, interleaved."""
    import copy

    torch._dynamo.reset()
    engine_model, hand_model = own_forward(copy.deepcopy(model)), own_forward(copy.deepcopy(model))
    s = surgery.apply(engine_model, TIMED)
    handles = hand_timed(hand_model)
    compiled_engine = torch.compile(engine_model)
    compiled_hand = torch.compile(hand_model)

    def stepper(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            with torch.no_grad():
                return fn(x)

        return step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        equal = bool(torch.allclose(stepper(compiled_engine)(), stepper(compiled_hand)(), rtol=1e-4, atol=1e-5))
        variants = [
            Variant("eager hand", lambda: lambda: None, stepper(hand_model)),
            Variant("compiled hand", lambda: lambda: None, stepper(compiled_hand)),
            Variant("compiled surgery", lambda: lambda: None, stepper(compiled_engine)),
        ]
        timing = interleave(variants, rounds, reps)
    s.remove()
    for h in handles:
        h.remove()
    torch._dynamo.reset()
    return {
        "equal": equal,
        "times": {name: timing.median(name) for name in timing.rounds},
        "compiled_surgery/compiled_hand": timing.ratio("compiled surgery", "compiled hand"),
        "spread": timing.spread("compiled surgery", "compiled hand"),
        "compiled_hand/eager_hand": timing.ratio("compiled hand", "eager hand"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="explain and after-compile checks only (aot_eager)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, x = make_model(16, 3)
    explained = {}
    for name, actions in CASES.items():
        explained[name] = explain_case(actions, model, x)
        row = explained[name]
        print(
            f"{name:32} graphs {row['graphs']:2}  breaks {row['graph_breaks']:2}  equal {row['equal_to_eager']}"
            f"  {'; '.join(row['reasons'])[:100]}",
            flush=True,
        )
    recompiles = capture_recompiles(model, x)
    print(f"capture over {recompiles['calls']} compiled calls: {recompiles['graphs']} graphs", flush=True)
    after = surgery_after_compile(model, x)
    for target, row in after.items():
        print(
            f"surgery applied after compiling ({target}): compiled output changed {row['compiled_output_changed']},"
            f" surgery warned {row['surgery_warned']}",
            flush=True,
        )
    timed = None
    if not args.quick:
        big, bx = make_model(256, 12)
        timed = inductor_ratio(big, bx, rounds=9, reps=100)
        print(
            f"inductor: compiled surgery / compiled hand {timed['compiled_surgery/compiled_hand']:.3f}"
            f"  (compiled hand / eager hand {timed['compiled_hand/eager_hand']:.3f}, equal {timed['equal']})",
            flush=True,
        )
    write_json(
        args.json,
        {
            "machine": machine(),
            "explain": explained,
            "capture_recompiles": recompiles,
            "after_compile": after,
            "inductor": timed,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
