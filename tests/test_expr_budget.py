"""Each evaluation of an expression is bounded in work, not just in the size of each value: attacks from a few
bytes of config are refused within seconds, and ordinary expressions still give plain torch's exact result."""

from __future__ import annotations

import resource
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError
from surgery.expr.check import compile_expr
from tests.test_expr_check_table import EINSUM_ACCEPTED, _operands

WHERE = "actions.a.expr"
E = "x[0].expand(4096, 4096)"  # a 2**24-element view of a 64-element input: no memory until an op makes one
V = "x[0].expand(2**24)"
OPERATIONS = "operations, more than the 1,073,741,824 an expression may take here"
ELEMENTS = "elements together, more than the 67,108,864 an expression may make here"
PIECES = "tensors in this evaluation, more than 65,536"


def several(text: str, count: int) -> str:
    return "(" + ", ".join([text] * count) + ")"


# (expression over a 64-element x, what the refusal says): each runs for minutes or takes gigabytes unbounded
ATTACKS = [
    (f"{E} @ {E}", OPERATIONS),  # 126 s of matmuls from 64 elements, before the bound
    (f"({E} @ {E}) @ {E}", OPERATIONS),
    (f"matmul({E}, {E})", OPERATIONS),
    (f"{E}.matmul({E})", OPERATIONS),
    (f"{E}.mT @ {E}", OPERATIONS),
    (f"linear({E}, {E})", OPERATIONS),
    (f"einsum('ij,jk->ik', {E}, {E})", OPERATIONS),
    (f"einsum('ab,cd,ad->', {E}, {E}, {E})", OPERATIONS),  # a scalar result over a 2**48-element intermediate
    # an intermediate of 2**27 elements, for a number
    (
        "einsum('a,b,ac,bc->', x[0].expand(2**14), x[0].expand(2**13), x[0].expand(2**14, 1), x[0].expand(2**13, 1))",
        ELEMENTS,
    ),
    (several(f"{V}.sort()", 3), OPERATIONS),  # tuples of many sorts
    (f"{V}.topk(10)", OPERATIONS),
    (f"{V}.kthvalue(10)", OPERATIONS),
    (several(f"{V}.sort(descending=True).values", 3), OPERATIONS),
    (several(f"{V}.sum()", 65), OPERATIONS),  # reductions read every element of a view
    (f"{V}.split(1)", PIECES),  # 16.7M tensor objects
    ("x[0].expand(2**20).split(8)", PIECES),
    (several("x[0].expand(2**24).split(2**10)", 5), PIECES),
    (f"{V}.chunk(x.numel() * 2**11)", PIECES),
    (several(f"{V}.cumsum(0)", 5), ELEMENTS),  # cumsum chains
    (several(f"-{V}", 5), ELEMENTS),
    (several(f"{V}.exp()", 5), ELEMENTS),
    (several(f"{V} > 0", 5), ELEMENTS),
    (several(f"{V} * {V}", 5), ELEMENTS),
    (several(f"softmax({V}, dim=0)", 5), ELEMENTS),
    (several("cat([x[0].expand(2**23), x[0].expand(2**23)])", 5), ELEMENTS),
    (several(f"where({V} > 0, {V}, 1.0)", 3), ELEMENTS),
    (several(f"{V}[{V} > 0]", 5), ELEMENTS),
    (several(f"{V}.clone()", 5), ELEMENTS),
    (several(f"{V}.reshape(4096, 4096).contiguous()", 5), ELEMENTS),
]


@pytest.mark.parametrize(("text", "fragment"), ATTACKS, ids=[text[:60] for text, _ in ATTACKS])
def test_an_attack_is_refused_within_seconds_and_memory(text: str, fragment: str) -> None:
    expr = compile_expr(text, WHERE)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    with pytest.raises(ActionError) as caught:
        expr(x=torch.randn(64))
    assert time.perf_counter() - start < 5.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 2**20  # less than 1 GiB more at the peak
    message = str(caught.value)
    assert message.startswith(f"{WHERE}: '{text[:80]}") and " failed: " in message
    assert fragment in message


def test_four_values_need_no_count_and_a_fifth_is_counted() -> None:
    """Each value is within the one-value bound, so four together are within the bound on all (4 × 2**24 here)."""
    four = compile_expr(several(f"-{V}", 4), WHERE)
    assert len(four(x=torch.randn(64))) == 4
    assert "_unary" not in four.bind("x").__code__.co_names  # the hot path: -x is computed directly
    with pytest.raises(ActionError, match=ELEMENTS):
        compile_expr(several(f"-{V}", 4)[:-1] + ", -x)", WHERE)(x=torch.randn(64))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("x.chunk(10**6)", "1,000,000 pieces are more than 65,536, the most tensors an expression may split off"),
        ("x.chunk(65537, dim=0)", "65,537 pieces are more than 65,536"),
        ("x.chunk(chunks=2**20)", "1,048,576 pieces are more than 65,536"),
        ("x.flatten()[0].expand(2**37)", "137,438,953,472 elements are more than 68,719,476,736"),
    ],
)
def test_literal_sizes_past_a_ceiling_are_refused_when_the_plan_is_compiled(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        compile_expr(text, WHERE)
    assert str(caught.value).startswith(f"{WHERE}: '{text}'") and fragment in str(caught.value)


def test_an_attack_in_a_hook_fails_the_forward_naming_the_action_and_leaves_the_model_as_it_was() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    action = {
        "a": {
            "kind": "replace_forward",
            "type": "ReLU",
            "expr": "x[0, 0].expand(4096, 4096) @ x[0, 0].expand(4096, 4096)",
        }
    }
    start = time.perf_counter()
    with pytest.raises(
        ActionError, match=rf"^{WHERE} on module '1': 'x\[0, 0\].expand\(4096, 4096\) @ .*' failed: it would take"
    ):
        with surgery.apply(model, action):
            model(torch.randn(2, 8))
    assert time.perf_counter() - start < 5.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not model[1]._forward_hooks and not model[1]._forward_pre_hooks


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)


def _env() -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 16)
    return {"x": x, "output": torch.randn(2, 3, 5, 16), "module": Attention()}


# (expression, the same in plain torch over the env): ordinary expressions pass, with torch's exact result
ORDINARY = [
    ("linear(x, module.proj.weight, module.proj.bias)", lambda e: F.linear(e.x, e.m.proj.weight, e.m.proj.bias)),
    ("x @ module.proj.weight.T + module.proj.bias", lambda e: e.x @ e.m.proj.weight.T + e.m.proj.bias),
    (
        "softmax(einsum('bhqd,bhkd->bhqk', x, output) / 4.0, dim=-1)",
        lambda e: torch.softmax(torch.einsum("bhqd,bhkd->bhqk", e.x, e.output) / 4.0, dim=-1),
    ),
    (
        "einsum('bhqk,bhkd->bhqd', softmax(einsum('bhqd,bhkd->bhqk', x, output), dim=-1), output)",
        lambda e: torch.einsum(
            "bhqk,bhkd->bhqd", torch.softmax(torch.einsum("bhqd,bhkd->bhqk", e.x, e.output), dim=-1), e.output
        ),
    ),
    ("layer_norm(x, module.norm.normalized_shape, module.norm.weight, module.norm.bias)", lambda e: e.m.norm(e.x)),
    (
        "(x - x.mean(dim=-1, keepdim=True)) / x.std(dim=-1, keepdim=True)",
        lambda e: (e.x - e.x.mean(dim=-1, keepdim=True)) / e.x.std(dim=-1, keepdim=True),
    ),
    (
        "x.sort(dim=-1).values + x.topk(2, dim=-1).values.sum(dim=-1, keepdim=True)",
        lambda e: e.x.sort(dim=-1).values + e.x.topk(2, dim=-1).values.sum(dim=-1, keepdim=True),
    ),
    ("x.cumsum(-1) - output.cumsum(-2)", lambda e: e.x.cumsum(-1) - e.output.cumsum(-2)),
    ("cat(x.split(1, dim=-1)[::-1], dim=-1)", lambda e: torch.cat(e.x.split(1, dim=-1)[::-1], dim=-1)),
    ("stack(x.chunk(4, dim=-1)).sum(dim=0)", lambda e: torch.stack(e.x.chunk(4, dim=-1)).sum(dim=0)),
    ("where(x > 0, x, -x) * sigmoid(output)", lambda e: torch.where(e.x > 0, e.x, -e.x) * torch.sigmoid(e.output)),
    ("x[..., [0, 2]].flatten(2) ** 2 + 1", lambda e: e.x[..., [0, 2]].flatten(2) ** 2 + 1),
    (
        "quantile(x.flatten(), 0.5) + x.kthvalue(2, dim=-1).values.mean()",
        lambda e: torch.quantile(e.x.flatten(), 0.5) + e.x.kthvalue(2, dim=-1).values.mean(),
    ),
    (
        "~(x > 0) * 1.0 + x.expand(2, 2, 3, 5, 16).sum(dim=0)",
        lambda e: ~(e.x > 0) * 1.0 + e.x.expand(2, 2, 3, 5, 16).sum(dim=0),
    ),
    (
        "norm(x, dim=-1) + amax(output, dim=-1)",
        lambda e: torch.linalg.vector_norm(e.x, dim=-1) + torch.amax(e.output, dim=-1),
    ),
]


@pytest.mark.parametrize(("text", "plain"), ORDINARY, ids=[text[:60] for text, _ in ORDINARY])
def test_ordinary_expressions_pass_with_torchs_exact_result(text: str, plain: Any) -> None:
    env = _env()
    got = compile_expr(text, WHERE)(**env)
    fresh = _env()
    assert torch.equal(got, plain(SimpleNamespace(x=fresh["x"], output=fresh["output"], m=fresh["module"])))


def _meta_linear(inputs: int, outputs: int) -> nn.Linear:
    return nn.Linear(inputs, outputs, device="meta")


# Real-model sizes, run on meta tensors (shapes only, no arithmetic): each is inside the budget.
REAL_SIZES = [
    ("linear(x, module.weight, module.bias)", (1, 4096, 4096), lambda: _meta_linear(4096, 4096)),  # 2**37 of 2**42
    ("linear(x, module.weight)", (8, 2048, 4096), lambda: _meta_linear(4096, 11008)),  # an LLM's MLP up-projection
    ("softmax(einsum('bhqd,bhkd->bhqk', x, x) / 8.0, dim=-1)", (1, 12, 1024, 64), lambda: _meta_linear(768, 2304)),
    ("softmax(einsum('bhqd,bhkd->bhqk', x, x), dim=-1)", (1, 32, 2048, 128), lambda: _meta_linear(4096, 4096)),
    ("x.sort(dim=-1).values.cumsum(-1)", (8, 1024, 4096), lambda: _meta_linear(4096, 4096)),
    (
        "(x - x.mean(dim=-1, keepdim=True)) * module.weight[0] + x.split(1, dim=-1)[0]",
        (8, 1024, 4096),
        lambda: _meta_linear(4096, 4096),
    ),
]


@pytest.mark.parametrize(("text", "shape", "module"), REAL_SIZES, ids=[text[:50] for text, _, _ in REAL_SIZES])
def test_expressions_at_real_model_sizes_stay_within_the_budget(text: str, shape: tuple[int, ...], module: Any) -> None:
    got = compile_expr(text, WHERE)(x=torch.empty(shape, device="meta"), module=module())
    assert got.is_meta


@pytest.mark.parametrize(("equation", "ranks"), EINSUM_ACCEPTED, ids=[case[0] for case in EINSUM_ACCEPTED])
def test_the_einsum_estimate_knows_the_size_of_the_result(equation: str, ranks: tuple[int, ...]) -> None:
    from surgery.expr.work import _einsum_work

    operands = tuple(_operands(ranks).values())
    assert _einsum_work(equation, operands)[2] == torch.einsum(equation, *operands).numel()


def test_the_budget_grows_with_the_largest_input() -> None:
    """The same expression that is refused on a 64-element input passes on a 2**20-element one (meta: no compute)."""
    text = "x.flatten()[0].expand(4096, 4096) @ x.flatten()[0].expand(4096, 4096)"
    with pytest.raises(ActionError, match=OPERATIONS):
        compile_expr(text, WHERE)(x=torch.ones(64, device="meta"))
    assert compile_expr(text, WHERE)(x=torch.ones(2**24, device="meta")).shape == (4096, 4096)


def test_accounting_is_traced_by_torch_compile_without_a_graph_break() -> None:
    text = "cat(x.split(4, dim=-1), dim=-1) + einsum('bi,bi->b', x, x)[:, None] + x.sort(dim=-1).values - (-x) @ x.T"
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    torch._dynamo.reset()
    with surgery.apply(model, {"a": {"kind": "replace_forward", "type": "ReLU", "expr": text}}), torch.no_grad():
        explained = torch._dynamo.explain(model)(torch.randn(8, 8))
    torch._dynamo.reset()
    assert explained.graph_break_count == 0
