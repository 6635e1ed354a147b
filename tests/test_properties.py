"""Property tests (hypothesis): selection agrees with a reference matcher, expressions agree with
plain torch, and any sequence of surgeries comes off without a trace.

(a) random module trees and random globs from the grammar of docs/selection.md, against a
    reference matcher written here (segment-wise ``fnmatch``, ``**`` by recursion);
(b) random expressions from the grammar of docs/expressions.md (numbers, ``x``, arithmetic,
    small powers, unary minus, allowlisted calls, comparisons): ``compile_expr`` either refuses
    with a ``SurgeryError`` or computes exactly what the same text computes with plain torch;
(c) random plans from a pool of valid actions on TinyNet, applied and removed, nested
    (apply A, apply B, remove B, remove A), and removed out of order (remove A, then B).

Out-of-order removal: when A and B change different things, removing A first restores the
model exactly; when they change the same tensor, flag or module slot, removing A first is
refused with an ActionError (each undo puts back what *it* saw, so it could not restore
exactly), and removing B then A does.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import surgery
from surgery.core.globs import ROOT, compile_globs
from surgery.core.select import module_targets, select_modules
from surgery.errors import ActionError, SurgeryError
from surgery.expr.check import compile_expr
from tests.conftest import Snapshot, TinyNet, run_both


def examples(n: int) -> settings:
    """Modest example counts (the whole file runs in well under 30 s), no deadline, no example database.

    Derandomized: every run tries the same examples, so a failure (or a pass) repeats.
    """
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )


# ---------------------------------------------------------------- (a) selection against a reference matcher

SEGMENT_CHARS = "abc019_"  # a small alphabet, so that random globs often match random names
NAME = st.text(SEGMENT_CHARS, min_size=1, max_size=3).filter(lambda n: not hasattr(nn.ModuleDict(), n))


def reference_match(pattern: str, name: str) -> bool:
    """docs/selection.md, written plainly: whole-name match, segment by segment, ``**`` any run of segments."""
    if pattern == ROOT:
        return name == ROOT
    segments = pattern.split(".")
    parts = [] if name == ROOT else name.split(".")

    def match(i: int, j: int) -> bool:
        if i == len(segments):
            return j == len(parts)
        if segments[i] == "**":
            return any(match(i + 1, k) for k in range(j, len(parts) + 1))
        return j < len(parts) and fnmatch.fnmatchcase(parts[j], segments[i]) and match(i + 1, j + 1)

    return match(0, 0)


@st.composite
def module_trees(draw: st.DrawFn, depth: int = 0) -> nn.Module:
    """A random tree of Sequential / ModuleDict containers with Identity leaves."""
    if depth >= 3 or draw(st.integers(0, 3)) == 0:
        return nn.Identity()
    children = draw(st.lists(module_trees(depth + 1), min_size=1, max_size=3))
    if draw(st.booleans()):
        return nn.Sequential(*children)  # children named 0, 1, 2
    names = draw(st.lists(NAME, min_size=len(children), max_size=len(children), unique=True))
    return nn.ModuleDict(dict(zip(names, children)))


CHAR_CLASSES = st.sampled_from(["[abc]", "[!abc]", "[a-c]", "[0-9]", "[!0-9]", "[_a]", "[!_]"])


@st.composite
def segments(draw: st.DrawFn, names: list[str]) -> str:
    """One glob segment: a name part, a wildcard mix, or a whole-segment ``**``."""
    parts = [p for n in names for p in n.split(".")] or ["a"]
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return "**"
    if kind == 1:
        return draw(st.sampled_from(parts))  # a literal that exists
    pieces = draw(
        st.lists(
            st.one_of(
                st.sampled_from(["*", "?"]),
                CHAR_CLASSES,
                st.text(SEGMENT_CHARS, min_size=1, max_size=2),
                st.sampled_from(parts),
            ),
            min_size=1,
            max_size=3,
        )
    )
    text = "".join(pieces)
    while "**" in text:  # '**' inside a longer segment is a config error (docs/selection.md): not generated
        text = text.replace("**", "*")
    return text


@st.composite
def derived_globs(draw: st.DrawFn, names: list[str]) -> str:
    """A glob made from a name that exists, some segments loosened: these mostly match something."""
    parts = draw(st.sampled_from(names)).split(".") if names else ["a"]
    out = []
    for part in parts:
        how = draw(st.integers(0, 5))
        out.append([part, "*", "**", part[0] + "*", "?" * len(part), f"[{part[0]}]" + part[1:]][how])
    return ".".join(out)


@st.composite
def trees_and_globs(draw: st.DrawFn) -> tuple[nn.Module, list[str]]:
    model = draw(module_trees())
    names = [t.name for t in module_targets(model) if t.name != ROOT]
    glob = st.one_of(
        st.just(ROOT),
        st.lists(segments(names), min_size=1, max_size=4).map(".".join),
        derived_globs(names),
    )
    return model, draw(st.lists(glob, min_size=1, max_size=3))


@examples(80)
@given(trees_and_globs())
def test_globs_match_like_the_reference_matcher(tree_and_globs: tuple[nn.Module, list[str]]) -> None:
    model, globs = tree_and_globs
    targets = module_targets(model)
    names = [t.name for t in targets]
    assert names == [n or ROOT for n, _ in model.named_modules()]  # no wrappers here: names are as torch gives
    for glob in globs:
        matches = compile_globs([glob], "actions.p.select")
        for name in names:
            assert matches(name) == reference_match(glob, name), (glob, name)
    # several globs: any may match; exclude removes; the order of named_modules() is kept
    select, exclude = globs[:2], globs[2:] or None
    chosen = select_modules(targets, select, None, exclude, "actions.p")
    expected = [
        t
        for t in targets
        if any(reference_match(g, t.name) for g in select)
        and not any(reference_match(g, t.name) for g in exclude or [])
    ]
    assert [t.name for t in chosen] == [t.name for t in expected]


@examples(50)
@given(st.lists(NAME, min_size=1, max_size=4))
def test_a_literal_name_matches_only_itself(parts: list[str]) -> None:
    name = ".".join(parts)
    matches = compile_globs([name], "w")
    assert matches(name)
    assert not matches(name + ".x") and not matches("x." + name) and not matches(ROOT)


# ---------------------------------------------------------------- (b) expressions against plain torch

FUNCTIONS = {"relu": torch.relu, "abs": torch.abs, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "exp": torch.exp}
NUMBERS = st.one_of(
    st.integers(-5, 5).map(str),
    st.sampled_from(["0.5", "1.5", "2.0", "0.0", "1e3", "3"]),
)


def expressions(depth: int = 3) -> st.SearchStrategy[str]:
    """Texts from the expression grammar (a subset with known torch meaning)."""
    leaf = st.one_of(st.just("x"), NUMBERS)
    if depth == 0:
        return leaf
    sub = expressions(depth - 1)
    return st.one_of(
        leaf,
        st.tuples(sub, st.sampled_from(["+", "-", "*", "/"]), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(sub, st.integers(-3, 3)).map(lambda t: f"({t[0]}) ** {t[1]}"),
        sub.map(lambda s: f"-({s})"),
        st.tuples(st.sampled_from(sorted(FUNCTIONS)), sub).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(sub, NUMBERS, NUMBERS).map(lambda t: f"clamp({t[0]}, {t[1]}, {t[2]})"),
        st.tuples(sub, NUMBERS).map(lambda t: f"clamp({t[0]}, min={t[1]})"),
        st.tuples(sub, st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), sub).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        ),
    )


FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
X = st.lists(FLOATS, min_size=1, max_size=6).map(lambda v: torch.tensor(v, dtype=torch.float32))


def same(got: Any, want: Any) -> bool:
    """Bit-identical results (NaN equal to NaN), tensors and Python numbers alike."""
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and bool(((got == want) | (got.isnan() & want.isnan())).all())
        )
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    return type(got) is type(want) and got == want


@examples(100)
@given(expressions(), X)
def test_expressions_compute_what_plain_torch_computes_or_refuse_cleanly(text: str, x: torch.Tensor) -> None:
    namespace = {"x": x, **FUNCTIONS, "clamp": torch.clamp}
    try:
        want: Any = eval(text, {"__builtins__": builtins}, namespace)  # the reference: plain Python and torch
    except Exception as error:  # noqa: BLE001
        want = error
    must_refuse = isinstance(want, Exception) or a_number_part_fails(text, namespace)
    try:
        got: Any = compile_expr(text, "actions.e.expr")(x=x)
    except SurgeryError as error:
        # one line is checked by the corpus (expr_runtime_error_multiline): torch's own text can span lines
        assert str(error).startswith("actions.e.expr")
        assert must_refuse, f"{text!r} on {x}: refused ({error}), but plain torch gives {want!r}"
        return
    assert not must_refuse, f"{text!r}: surgery gave {got!r}, plain torch raised {want!r} (or a number overflowed)"
    assert same(got, want), f"{text!r} on {x}: surgery {got!r} != torch {want!r}"


def a_number_part_fails(text: str, namespace: dict[str, Any]) -> bool:
    """True when a part of ``text`` without ``x`` (folded at check time) raises or is not a finite float.

    These are the only refusals allowed for this grammar (division by zero, overflow, ``relu(3)``...):
    everything else must be accepted.
    """
    for node in ast.walk(ast.parse(text, mode="eval").body):
        if not isinstance(node, ast.expr) or any(isinstance(n, ast.Name) and n.id == "x" for n in ast.walk(node)):
            continue
        try:
            value = eval(compile(ast.Expression(node), "<part>", "eval"), {"__builtins__": builtins}, namespace)
            if isinstance(value, (int, float)) and not math.isfinite(float(value)):
                return True
        except Exception:  # noqa: BLE001
            return True
    return False


@examples(60)
@given(
    st.sampled_from(
        [
            "__import__('os')",
            "x.__class__",
            "open('f')",
            "lambda: x",
            "[a for a in x]",
            "x.add_(1)",
            "getattr(x, 'data')",
            "x if x else x",
            "x and x",
            "exec('1')",
            "globals()",
            "x.data",
            "x._version",
            "relu(x, out=x)",
            "'text'",
            "b'bytes'",
            "{1: x}",
            "f'{x}'",
            "(y := x)",
            "x.grad_fn",
            "x.register_hook(relu)",
            "x.cuda()",
            "x.to('meta')",
            "x.numpy()",
            "x.T.__dict__",
            "*x",
            "relu",
        ]
    ),
    st.sampled_from(["", " + x", " * 2", "relu({})"]),
)
def test_escaping_expressions_are_refused_before_running(bad: str, wrap: str) -> None:
    text = wrap.format(bad) if "{}" in wrap else bad + wrap
    with pytest.raises(SurgeryError) as info:
        compile_expr(text, "actions.e.expr")(x=torch.ones(2))
    assert str(info.value).startswith("actions.e.expr")


# ---------------------------------------------------------------- (c) random surgeries come off without a trace

POOL: dict[str, dict[str, Any]] = {
    "init_conv": {"kind": "init", "type": "Conv2d", "param": "weight", "method": "kaiming_normal"},
    "init_fc_const": {"kind": "init", "select": "fc", "param": "*", "method": "constant", "value": 0.25},
    "add_gate": {"kind": "add_parameter", "select": "fc", "name": "gate", "shape": [3], "init": {"method": "ones"}},
    "add_mask": {"kind": "add_buffer", "select": "conv", "name": "mask", "like": "bias", "persistent": False},
    "freeze_norm": {"kind": "freeze", "select": "norm"},
    "unfreeze_fc_bias": {"kind": "unfreeze", "select": "fc", "param": "bias"},
    "swish": {"kind": "replace_forward", "type": "ReLU", "expr": "x * sigmoid(x)"},
    "pool_twice": {"kind": "replace_forward", "select": "pool", "expr": "output * 2"},
    "halve_conv": {"kind": "modify_output", "select": "conv", "op": "mul", "value": 0.5, "index": "[:, :2]"},
    "noise_fc_in": {"kind": "modify_input", "select": "fc", "op": "noise", "std": 0.1},
    "capture_all": {"kind": "capture", "select": "**", "what": ["input", "output"]},
    "grads_fc": {"kind": "capture_grad", "select": "fc"},
    "grads_conv_w": {"kind": "capture_grad", "select": "conv", "param": "weight"},
    "clip_pool": {"kind": "modify_grad", "select": "pool", "op": "clip_value", "value": 0.01},
    "clip_fc_w": {"kind": "modify_grad", "select": "fc", "param": "weight", "op": "clip_norm", "max_norm": 0.1},
    "log_fc": {"kind": "log", "select": "fc", "stats": False},
    "gelu": {"kind": "replace_module", "type": "ReLU", "with": {"_target_": "torch.nn.GELU"}},
    "rename": {"kind": "on_load", "rename": {"old.*": "fc.*"}},
}  # fmt: skip

PLANS = st.lists(st.sampled_from(sorted(POOL)), min_size=1, max_size=5, unique=True)


class Baseline:
    """Snapshot (tensors, flags, hooks) plus every module's identity and own tensor names (non-persistent too)."""

    def __init__(self, model: nn.Module) -> None:
        self.snapshot = Snapshot.of(model)
        self.structure = structure(model)

    def assert_same(self, model: nn.Module) -> None:
        self.snapshot.assert_same(model)
        assert structure(model) == self.structure


def structure(model: nn.Module) -> list[tuple[str, int, list[str], list[str]]]:
    return [(n, id(m), list(m._parameters), list(m._buffers)) for n, m in model.named_modules()]


def fresh() -> TinyNet:
    torch.manual_seed(0)
    model = TinyNet().eval()
    model.fc.bias.requires_grad_(False)  # so that unfreeze changes a flag
    return model


def must_refuse(earlier: list[str], names: list[str]) -> bool:
    """The only pool plans that cannot apply: an attribute added twice, or a ReLU selected after gelu replaced it."""
    seen = list(earlier)
    for name in names:
        if (name in ("add_gate", "add_mask") and name in seen) or (name in ("gelu", "swish") and "gelu" in seen):
            return True
        seen.append(name)
    return False


def apply_or_refuse(model: nn.Module, names: list[str], earlier: list[str] | None = None) -> surgery.Surgery | None:
    """Apply the named pool actions (after ``earlier`` ones); refused exactly when ``must_refuse``, model untouched."""
    before = Baseline(model)
    refuse = must_refuse(earlier or [], names)
    try:
        applied = surgery.apply(model, {f"{n}_{i}": POOL[n] for i, n in enumerate(names)})
    except SurgeryError as error:
        assert refuse, f"{names} (after {earlier}) was refused: {error}"
        before.assert_same(model)
        return None
    assert not refuse, f"{names} (after {earlier}) applied, but it cannot work"
    return applied


def exercise(model: nn.Module) -> None:
    """Forward and backward (so every kind of hook fires), then forget the gradients."""
    run_both(model, torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)))
    model.zero_grad(set_to_none=True)


@examples(40)
@given(PLANS)
def test_any_plan_applied_run_and_removed_leaves_the_model_bit_identical(names: list[str]) -> None:
    model = fresh()
    before = Baseline(model)
    s = apply_or_refuse(model, names)
    if s is None:
        return
    exercise(model)
    s.remove()
    before.assert_same(model)


@examples(40)
@given(PLANS, PLANS)
def test_nested_surgeries_removed_in_reverse_order_restore_each_level(first: list[str], second: list[str]) -> None:
    model = fresh()
    level0 = Baseline(model)
    a = apply_or_refuse(model, first)
    assume(a is not None)
    level1 = Baseline(model)
    b = apply_or_refuse(model, second, first)  # compiled on the model as A left it
    exercise(model)
    if b is not None:
        b.remove()
    level1.assert_same(model)
    a.remove()  # type: ignore[union-attr]
    level0.assert_same(model)


def remove_out_of_order(a: surgery.Surgery, b: surgery.Surgery) -> None:
    """Remove A before B; a refusal (ActionError) is also acceptable, after which B then A is the way."""
    try:
        a.remove()
    except ActionError:
        b.remove()
        a.remove()
        return
    b.remove()


# pool actions by what they change: two plans from different groups change different things
GROUPS = [
    ["init_conv", "add_mask", "halve_conv", "grads_conv_w"],
    ["init_fc_const", "add_gate", "unfreeze_fc_bias", "noise_fc_in", "grads_fc", "clip_fc_w", "log_fc"],
    ["freeze_norm", "swish", "pool_twice", "clip_pool", "capture_all"],
]


@examples(30)
@given(st.permutations(range(len(GROUPS))), st.data())
def test_out_of_order_removal_of_surgeries_that_change_different_things_restores_exactly(
    order: list[int], data: st.DataObject
) -> None:
    first = data.draw(st.lists(st.sampled_from(GROUPS[order[0]]), min_size=1, max_size=3, unique=True))
    second = data.draw(st.lists(st.sampled_from(GROUPS[order[1]]), min_size=1, max_size=3, unique=True))
    model = fresh()
    before = Baseline(model)
    a = apply_or_refuse(model, first)
    b = apply_or_refuse(model, second, first)
    assert a is not None and b is not None
    exercise(model)
    remove_out_of_order(a, b)
    before.assert_same(model)


OVERLAPPING = {
    "init": ({"kind": "init", "select": "fc", "param": "weight", "method": "ones"},
             {"kind": "init", "select": "fc", "param": "weight", "method": "zeros"}),
    "freeze_unfreeze": ({"kind": "freeze", "select": "fc"}, {"kind": "unfreeze", "select": "fc"}),
    "replace_module": ({"kind": "replace_module", "select": "act", "with": {"_target_": "torch.nn.GELU"}},
                       {"kind": "replace_module", "select": "act", "with": {"_target_": "torch.nn.Tanh"}}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(OVERLAPPING))
def test_out_of_order_removal_of_overlapping_surgeries_restores_or_refuses(case: str) -> None:
    model = fresh()
    before = Baseline(model)
    first, second = OVERLAPPING[case]
    a = surgery.apply(model, {"a": first})
    b = surgery.apply(model, {"b": second})
    remove_out_of_order(a, b)
    before.assert_same(model)
