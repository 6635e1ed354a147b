"""Fault injection: whatever fails, and wherever, the model comes back exactly as it was.

* apply: every change the engine makes records its undo through ``Ledger._own`` (the one
  place every ledger call passes). For every kind, and for a plan holding every kind, the k-th of those
  changes is made to fail, for every k, in two ways: before it takes effect, and just after
  it was recorded. ``apply`` must raise an ``ActionError`` naming the action that owns change
  k, and the model must be bit-identical to before (tensors, flags, modules, hooks).
* hooks: an expression that fails inside a forward, pre-forward or backward hook names its
  action and module, and the surgery is still removable.
* outputs: Ctrl-C while an output file is being written leaves neither that file nor a
  temp file (and an older file of the same name intact).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery.actions import KINDS
from surgery.core.ledger import Ledger
from surgery.errors import ActionError
from tests.conftest import Snapshot, TinyNet, run_both
from tests.test_contract import CASES

ORIGINAL = {"_own": Ledger._own}


class InjectedError(RuntimeError):
    """The fault we inject: an ordinary exception, as a failing torch call would raise."""


def structure(model: nn.Module) -> list[tuple[str, int, list[str], list[str]]]:
    """Every module (by identity) with its own parameter and buffer names, persistent or not."""
    return [(n, id(m), list(m._parameters), list(m._buffers)) for n, m in model.named_modules()]


def prepared() -> TinyNet:
    """The contract tests' model: seeded, eval, norm.weight frozen so that unfreeze changes something."""
    torch.manual_seed(0)
    model = TinyNet().eval()
    model.norm.weight.requires_grad_(False)
    return model


@contextmanager
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Record which action owns each change a clean apply makes, in order."""
    owners: list[str] = []
    for name, method in ORIGINAL.items():

        def spy(self: Ledger, arg: Any, method: Callable = method) -> None:
            owners.append(self.action)
            method(self, arg)

        monkeypatch.setattr(Ledger, name, spy)
    yield owners
    monkeypatch.undo()


def fail_at(monkeypatch: pytest.MonkeyPatch, k: int, when: str) -> None:
    """Make the k-th change fail: ``before`` it takes effect, or ``after`` it was recorded."""
    count = [0]
    for name, method in ORIGINAL.items():

        def faulty(self: Ledger, arg: Any, name: str = name, method: Callable = method) -> None:
            count[0] += 1
            if count[0] != k:
                return method(self, arg)
            if when == "before":  # the change did not happen: take back what the ledger call already did
                arg()
            else:
                method(self, arg)
            raise InjectedError(f"change {k} failed")

        monkeypatch.setattr(Ledger, name, faulty)


def check_every_fault(actions: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> int:
    """Fail each change of applying ``actions`` in turn, both ways; return how many changes there are."""
    model = prepared()
    plan = surgery.plan(model, actions)
    with recording(monkeypatch) as owners:
        surgery.apply(model, plan).remove()
    assert owners, "a clean apply recorded no change"
    before, modules = Snapshot.of(model), structure(model)
    for k, owner in enumerate(owners, start=1):
        for when in ("before", "after"):
            fail_at(monkeypatch, k, when)
            with pytest.raises(ActionError) as info:
                surgery.apply(model, plan)
            monkeypatch.undo()
            message = str(info.value)
            assert message.startswith(f"actions.{owner}: failed on "), message
            assert f"change {k} failed" in message and "Nothing was changed" in message
            assert isinstance(info.value.__cause__, InjectedError)
            before.assert_same(model)
            assert structure(model) == modules, f"change {k} ({when}): modules or tensors differ"
    # and the plan still applies cleanly afterwards
    with surgery.apply(model, plan):
        pass
    before.assert_same(model)
    return len(owners)


def test_every_kind_has_a_case() -> None:
    assert {key.split("/")[0] for key in CASES} == set(KINDS.names())


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failing_change_of_one_kind_leaves_the_model_as_it_was(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_every_fault({"act": CASES[case]}, monkeypatch)


def every_kind_in_one_plan() -> dict[str, Any]:
    """One plan with every contract case; freeze last, so the tensor hooks before it find grads."""
    names = sorted(CASES, key=lambda c: c == "freeze")
    return {name.replace("/", "_"): CASES[name] for name in names}


def test_a_failing_change_anywhere_in_a_plan_of_every_kind_undoes_all_earlier_actions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    changes = check_every_fault(every_kind_in_one_plan(), monkeypatch)
    assert changes >= len(CASES)


def test_an_interrupt_while_applying_is_not_wrapped_and_still_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C half way through apply: the KeyboardInterrupt itself comes out, after the rollback."""
    model = prepared()
    plan = surgery.plan(model, every_kind_in_one_plan())
    before, modules = Snapshot.of(model), structure(model)
    calls = [0]

    def interrupted(self: Ledger, undo: Any) -> None:
        calls[0] += 1
        ORIGINAL["_own"](self, undo)
        if calls[0] == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Ledger, "_own", interrupted)
    with pytest.raises(KeyboardInterrupt):
        surgery.apply(model, plan)
    monkeypatch.undo()
    before.assert_same(model)
    assert structure(model) == modules


def test_an_undo_that_raises_during_remove_does_not_stop_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """remove() runs every undo even when one raises, then reports it; calling remove() again is harmless."""
    model = prepared()
    plan = surgery.plan(model, every_kind_in_one_plan())
    before, modules = Snapshot.of(model), structure(model)
    with recording(monkeypatch) as owners:
        surgery.apply(model, plan).remove()
    for k in range(1, len(owners) + 1):
        count = [0]

        def loud(self: Ledger, undo: Any, k: int = k, count: list[int] = count) -> None:
            count[0] += 1
            if count[0] == k:  # this undo does its work, then raises

                def failing_undo() -> None:
                    undo()
                    raise InjectedError(f"undo {k} failed")

                return ORIGINAL["_own"](self, failing_undo)
            return ORIGINAL["_own"](self, undo)

        monkeypatch.setattr(Ledger, "_own", loud)
        s = surgery.apply(model, plan)
        monkeypatch.undo()
        with pytest.raises(ActionError, match=rf"removing the surgery hit 1 error\(s\).*undo {k} failed"):
            s.remove()
        s.remove()
        before.assert_same(model)
        assert structure(model) == modules


# ---------------------------------------------------------------- hooks that fail while the model runs

FAILING_HOOKS = {
    "modify_output": ({"kind": "modify_output", "select": "fc", "op": "expr", "expr": "output.reshape(7, 5)"}, "fc"),
    "modify_input": ({"kind": "modify_input", "select": "fc", "op": "expr", "expr": "x.reshape(7, 5)"}, "fc"),
    "replace_forward": ({"kind": "replace_forward", "select": "pool", "expr": "x.reshape(7, 5)"}, "pool"),
    "replace_forward/inplace": ({"kind": "replace_forward", "select": "act", "expr": "x.reshape(7, 5)"}, "act"),
    "modify_grad": ({"kind": "modify_grad", "select": "pool", "op": "expr", "expr": "grad.reshape(7, 5)"}, "pool"),
    "modify_grad/param": (
        {"kind": "modify_grad", "select": "fc", "param": "weight", "op": "expr", "expr": "grad.reshape(7, 5)"},
        "fc.weight",
    ),
    "modify_output/fn": (
        {"kind": "modify_output", "select": "conv", "op": "fn", "fn": "torch.linalg:cholesky"},
        "conv",
    ),
}


@pytest.mark.parametrize("case", sorted(FAILING_HOOKS))
def test_a_hook_that_raises_names_action_and_module_and_stays_removable(case: str, x_img: torch.Tensor) -> None:
    action, module = FAILING_HOOKS[case]
    model = prepared()
    before, modules = Snapshot.of(model), structure(model)
    s = surgery.apply(model, {"bad": action})
    with pytest.raises(ActionError) as info:
        run_both(model, x_img)  # forward, then backward for the gradient hooks
    message = str(info.value)
    assert message.startswith("actions.bad"), message
    assert f"'{module}'" in message, message
    assert "\n" not in message
    s.remove()
    model.zero_grad(set_to_none=True)
    before.assert_same(model)
    assert structure(model) == modules
    s.remove()  # twice is harmless


def test_a_failing_parameter_hook_says_parameter_not_module(x_img: torch.Tensor) -> None:
    action, _ = FAILING_HOOKS["modify_grad/param"]
    model = prepared()
    with surgery.apply(model, {"bad": action}), pytest.raises(ActionError, match="on parameter 'fc.weight'"):
        run_both(model, x_img)


def test_the_model_runs_normally_after_a_failed_forward(x_img: torch.Tensor) -> None:
    model = prepared()
    reference = model(x_img).detach()
    with surgery.apply(model, {"bad": FAILING_HOOKS["replace_forward/inplace"][0]}):
        with pytest.raises(ActionError):
            model(x_img)
    assert torch.equal(model(x_img), reference)


# ---------------------------------------------------------------- Ctrl-C while writing outputs


def interrupt_half_way(path: Path, data: bytes) -> None:
    """Write half of ``data`` to ``path``, then behave as if Ctrl-C was pressed."""
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
    raise KeyboardInterrupt


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_ctrl_c_while_writing_json_leaves_no_file_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from surgery.files.write import write_json

    monkeypatch.setattr(Path, "write_text", lambda self, text, *a, **k: interrupt_half_way(self, text.encode()))
    with pytest.raises(KeyboardInterrupt):
        write_json(tmp_path / "report.json", {"a": list(range(1000))})
    assert files_in(tmp_path) == []


def test_ctrl_c_while_overwriting_keeps_the_old_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from surgery.files.write import write_json

    write_json(tmp_path / "report.json", {"old": True})
    old = (tmp_path / "report.json").read_text()
    monkeypatch.setattr(Path, "write_text", lambda self, text, *a, **k: interrupt_half_way(self, text.encode()))
    with pytest.raises(KeyboardInterrupt):
        write_json(tmp_path / "report.json", {"new": list(range(1000))})
    assert files_in(tmp_path) == ["report.json"]
    assert (tmp_path / "report.json").read_text() == old


def test_ctrl_c_while_writing_tensors_leaves_no_file_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    from surgery.files.write import write_tensors

    def save_half(tensors: dict[str, torch.Tensor], filename: str, *a: Any, **k: Any) -> None:
        interrupt_half_way(Path(filename), safetensors.torch.save(tensors))

    monkeypatch.setattr(safetensors.torch, "save_file", save_half)
    with pytest.raises(KeyboardInterrupt):
        write_tensors(tmp_path / "captures.safetensors", {"a/b/output": torch.randn(64, 64)})
    assert files_in(tmp_path) == []


def test_ctrl_c_while_a_run_writes_its_captures_leaves_no_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    from surgery.app.job import run_job
    from tests.test_cli import composed

    def save_half(tensors: dict[str, torch.Tensor], filename: str, *a: Any, **k: Any) -> None:
        interrupt_half_way(Path(filename), safetensors.torch.save(tensors))

    cfg = composed("+model=cnn", "+actions=capture_block3")
    monkeypatch.setattr(safetensors.torch, "save_file", save_half)
    with pytest.raises(KeyboardInterrupt):
        run_job(cfg, tmp_path)
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == [], leftovers
