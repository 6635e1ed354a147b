"""Expressions name intermediates: ``NAME = expression; ...; result`` (``;`` or new lines), with every guarantee of
the safe language kept: each binding is checked like an expression, the work budget spans them all, a result that
may be the module's own tensor is still copied, and anything but a binding is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError
from surgery.expr.check import compile_expr
from tests.test_expr_budget import ELEMENTS, V

WHERE = "actions.a.expr"


class SAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)  # the SAE's tensors live on the module the expression runs on
        self.lin.W_enc, self.lin.b_enc = nn.Parameter(torch.randn(6, 10)), nn.Parameter(torch.randn(10))
        self.lin.W_dec, self.lin.b_dec = nn.Parameter(torch.randn(10, 6)), nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


ERROR_TERM = """
f = relu((output - module.b_dec) @ module.W_enc + module.b_enc)
r = f @ module.W_dec + module.b_dec
r + (output - r)
"""


def test_an_sae_with_its_error_term_names_each_step_once() -> None:
    model = SAE()
    x = torch.randn(3, 6)
    m = model.lin
    with torch.no_grad():
        y = model.lin(x)
        f = torch.relu((y - m.b_dec) @ m.W_enc + m.b_enc)
        r = f @ m.W_dec + m.b_dec
        want = r + (y - r)
        with surgery.apply(model, {"a": {"kind": "modify_output", "op": "expr", "expr": ERROR_TERM,
                                         "select": "lin"}}):  # fmt: skip
            assert torch.equal(model(x), want)
        one_line = "f = relu((x - module.b_dec) @ module.W_enc + module.b_enc); r = f @ module.W_dec + module.b_dec; r"
        with surgery.apply(model, {"a": {"kind": "replace_forward", "select": "lin", "expr": one_line}}):
            f = torch.relu((x - m.b_dec) @ m.W_enc + m.b_enc)
            assert torch.equal(model(x), f @ m.W_dec + m.b_dec)


def test_a_bound_module_tensor_returned_is_still_a_copy() -> None:
    model = SAE()
    got = compile_expr("w = module.W_enc\nt = w\nt", WHERE, names=("x", "module"))(x=torch.zeros(1), module=model.lin)
    assert torch.equal(got, model.lin.W_enc) and got.data_ptr() != model.lin.W_enc.data_ptr()


def test_the_work_budget_spans_every_binding() -> None:
    text = f"a = -{V}; b = -{V}; c = -{V}; d = -{V}; e = -{V}; (a, b, c, d, e)"
    with pytest.raises(ActionError, match=ELEMENTS):
        compile_expr(text, WHERE)(x=torch.randn(64))


REFUSED = [
    ("x = 1; x", "'x = ...' in 'x = 1; x': the name 'x' is a variable of the language; pick another"),
    ("relu = x; relu", "'relu = ...' in 'relu = x; relu': the name 'relu' is a function of the language; pick another"),
    ("a = x; a = a * 2; a", "'a = ...' in 'a = x; a = a * 2; a': the name 'a' is bound twice; pick another"),
    ("_e = x; _e", "'_e = ...' in '_e = x; _e': the name '_e' starts with '_'; pick another"),
    ("a = x; b = x; a", "'b = ...' in 'a = x; b = x; a': 'b' is bound but never used"),
    ("a = b; b = x; a", "'b' in 'a = b; b = x; a': unknown name 'b'. Did you mean 'abs'? Variables: x, module"),
    ("a = a; a", "'a' in 'a = a; a': unknown name 'a'. Did you mean 'var' or 'cat' or 'abs'? Variables: x, module"),
    ("import os; x", "'import os' in 'import os; x': before the result only bindings NAME = expression are allowed"
                     " (separated by ';' or new lines)"),
    ("x.y = 1; x", "'x.y = 1' in 'x.y = 1; x': before the result only bindings NAME = expression are allowed"
                   " (separated by ';' or new lines)"),
    ("a, b = x, x; a", "'a, b = x, x' in 'a, b = x, x; a': before the result only bindings NAME = expression are"
                       " allowed (separated by ';' or new lines)"),
    ("a += x; a", "'a += x' in 'a += x; a': before the result only bindings NAME = expression are allowed"
                  " (separated by ';' or new lines)"),
    ("a = x", "'a = x' must end with the expression whose value is the result"),
    ("a = x.__class__; a", "'x.__class__' in 'a = x.__class__; a': names starting with '_' are not allowed"
                           " ('.__class__')"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), REFUSED, ids=[t for t, _ in REFUSED])
def test_anything_but_a_binding_is_refused_naming_the_part(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        compile_expr(text, WHERE, names=("x", "module"))
    assert str(info.value) == f"{WHERE}: {message}"
