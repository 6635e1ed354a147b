"""CompiledModelWarning: surgery changed on a model whose compiled graph would not see the change.

torch 2.13 does not guard on hooks added to modules that had none, so a graph compiled before a
surgery keeps running without it. Dynamo caches graphs on code objects shared by every instance of
a class, so the models here are of classes no other test file compiles, and a fixture resets Dynamo
around each test.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import CompiledModelWarning

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports

ADD = {"add": {"kind": "modify_output", "select": "block.fc", "op": "add", "value": 1.0}}
X = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def net() -> nn.Module:
    """A two-level model of classes defined for this call's test only (their own forward code objects)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).relu()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(x))

    torch.manual_seed(0)
    return Net().eval()


def apply_without_warning(model: nn.Module) -> surgery.Surgery:
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompiledModelWarning)
        return surgery.apply(model, ADD)


def test_inner_model_after_a_compiled_call_warns_and_the_compiled_model_ignores_it() -> None:
    model = net()
    compiled = torch.compile(model, backend="aot_eager")
    before = compiled(X)
    with pytest.warns(CompiledModelWarning, match="already run compiled"):
        s = surgery.apply(model, ADD)
    assert torch.equal(compiled(X), before)  # what the warning is about
    assert not torch.equal(model(X), before)
    torch._dynamo.reset()  # the advice in the warning
    assert torch.equal(compiled(X), model(X))
    s.remove()


@pytest.mark.parametrize(
    "compile_and_run",
    [
        lambda m: m.compile(backend="aot_eager") or m(X),
        lambda m: torch.compile(m.block, backend="aot_eager")(X),
        lambda m: m.block.compile(backend="aot_eager") or m(X),
        lambda m: torch.compile(lambda x: m(x) * 2, backend="aot_eager")(X),
    ],
    ids=["module.compile", "compile-submodule", "submodule.compile", "compiled-function"],
)
def test_other_ways_of_running_compiled_warn(compile_and_run) -> None:
    model = net()
    compile_and_run(model)
    with pytest.warns(CompiledModelWarning, match="already run compiled"):
        surgery.apply(model, ADD).remove()


def test_applying_before_the_first_compiled_call_does_not_warn_and_is_compiled_in() -> None:
    model = net()
    eager = model(X)
    compiled = torch.compile(model, backend="aot_eager")  # wrapped, not yet run
    s = apply_without_warning(model)
    assert torch.equal(compiled(X), model(X)) and not torch.equal(compiled(X), eager)
    s.remove()


def test_removing_from_a_model_that_ran_compiled_is_seen_and_does_not_warn() -> None:
    """Dynamo guards the hooks a graph was compiled with: removing them recompiles (torch 2.13)."""
    model = net()
    eager = model(X)
    compiled = torch.compile(model, backend="aot_eager")
    s = apply_without_warning(model)
    assert not torch.equal(compiled(X), eager)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompiledModelWarning)
        s.remove()
    assert torch.equal(compiled(X), eager)


def test_a_never_compiled_model_does_not_warn_while_another_class_is_compiled() -> None:
    other = net()
    torch.compile(other, backend="aot_eager")(X)
    apply_without_warning(net()).remove()


def test_an_eager_instance_of_a_compiled_class_does_not_warn() -> None:
    """Per instance, not per class: a sibling that only ever ran eagerly is not flagged."""
    model = net()
    sibling = type(model)()
    torch.compile(model, backend="aot_eager")(X)
    sibling(X)
    apply_without_warning(sibling).remove()


def test_no_warning_after_a_dynamo_reset() -> None:
    model = net()
    compiled = torch.compile(model, backend="aot_eager")
    compiled(X)
    torch._dynamo.reset()
    s = apply_without_warning(model)
    assert torch.equal(compiled(X), model(X))  # recompiled with the surgery
    s.remove()


def test_a_compiled_optimizer_step_does_not_count_as_running_the_model_compiled() -> None:
    model = net()
    model(X).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.compile(optimizer.step, backend="aot_eager")()
    apply_without_warning(model).remove()


def test_the_compiled_wrapper_still_warns_even_before_its_first_call() -> None:
    compiled = torch.compile(net(), backend="aot_eager")
    with pytest.warns(CompiledModelWarning, match="ignores this change"):
        s = surgery.apply(compiled, ADD)
    with pytest.warns(CompiledModelWarning, match="ignores this change"):
        s.remove()


def test_the_check_does_not_import_dynamo() -> None:
    code = (
        "import sys, torch, surgery\n"
        "m = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
        "surgery.apply(m, {'a': {'kind': 'modify_output', 'select': '0', 'op': 'add', 'value': 1.0}}).remove()\n"
        "assert 'torch._dynamo' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
