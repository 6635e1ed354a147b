"""capture's keys (SPEC §9): detach, clone, item/index, keep, stop, always; each against hand-written hooks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery.core.records import RecordChangedWarning
from surgery.errors import ActionError, ConfigError
from tests.conftest import Snapshot


class Net(nn.Module):
    """conv → ReLU(inplace=True) → linear, returning (logits, features) like many vision models."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(3 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.act(self.conv(x)).flatten(1)
        return self.head(features), features


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def stored(module: nn.Module, run, pre: bool = False) -> list:  # noqa: ANN001
    """What a hand-written hook storing every call's output (or input) sees, copied at the time."""
    seen: list = []
    if pre:
        handle = module.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    else:
        handle = module.register_forward_hook(lambda m, a, o: seen.append(o))
    try:
        run()
    finally:
        handle.remove()
    return seen


def test_clone_keeps_what_was_there_and_a_plain_capture_warns_when_read() -> None:
    m, x = net(), torch.randn(2, 1, 6, 6)
    truth = F.conv2d(x, m.conv.weight, m.conv.bias)  # what conv gave, before ReLU(inplace=True) rewrote it
    assert truth.min() < 0
    with surgery.apply(m, {"c": {"kind": "capture", "select": "conv", "clone": True}}) as s:
        m(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(s.captures["c"]["conv"].output, truth)
    with surgery.apply(m, {"c": {"kind": "capture", "select": "conv"}}) as s:
        m(x)
        with pytest.warns(RecordChangedWarning, match=r"c/conv: call 0 was changed in place .*clone: true"):
            output = s.captures["c"]["conv"].output
        assert torch.equal(output, truth.relu())  # what the in-place ReLU left
    assert torch.equal(stored(m.conv, lambda: m(x))[0], truth.relu())  # as a hand-written hook sees it too


def test_detach_false_keeps_the_graph_for_a_distillation_loss() -> None:
    m, x = net(), torch.randn(2, 1, 6, 6)
    teacher = torch.randn(2, 48)
    with surgery.apply(m, {"c": {"kind": "capture", "select": "head", "what": ["input"], "detach": False}}) as s:
        m(x)
        loss = F.mse_loss(s.captures["c"]["head"].input[0], teacher)
        loss.backward()
    got = m.conv.weight.grad.clone()
    m.zero_grad()
    inputs: list = []
    handle = m.head.register_forward_pre_hook(lambda mod, a: inputs.append(a[0]))
    m(x)
    handle.remove()
    F.mse_loss(inputs[0], teacher).backward()
    assert torch.equal(got, m.conv.weight.grad)
    with surgery.apply(m, {"c": {"kind": "capture", "select": "head"}}) as s:
        m(x)
        assert s.captures["c"]["head"].output.grad_fn is None  # detach: true, the default


def test_item_and_index_store_only_that_part() -> None:
    m, x = net(), torch.randn(2, 1, 6, 6)
    actions = {"c": {"kind": "capture", "select": "<root>", "item": 1, "index": "[:, :4]"},
               "i": {"kind": "capture", "select": "head", "what": ["input"], "index": "[0]"}}  # fmt: skip
    with surgery.apply(m, actions) as s:
        logits, features = m(x)
        part = s.captures["c"]["<root>"].output
        first = s.captures["i"]["head"].input
    assert torch.equal(part, features[:, :4]) and part.untyped_storage().nbytes() == 2 * 4 * 4  # a copy of the part
    assert torch.equal(first, features[0])


@pytest.mark.filterwarnings("ignore::surgery.core.records.RecordChangedWarning")  # the ReLU rewrites both stores
def test_keep_last_keeps_one_call_like_a_dict_store() -> None:
    m = net()
    xs = [torch.randn(2, 1, 6, 6) for _ in range(3)]
    with surgery.apply(m, {"c": {"kind": "capture", "type": ["Conv2d", "Linear"], "keep": "last"}}) as s:
        for x in xs:
            m(x)
        records = s.captures["c"]
        assert [len(r.calls) for r in records.values()] == [1, 1]
        got = {name: r.output for name, r in records.items()}
    store: dict = {}
    handles = [mod.register_forward_hook(lambda mm, a, o, n=n: store.__setitem__(n, o.detach()))
               for n, mod in (("conv", m.conv), ("head", m.head))]  # fmt: skip
    for x in xs:
        m(x)
    for h in handles:
        h.remove()
    assert torch.equal(got["head"], store["head"])
    assert torch.equal(got["conv"], store["conv"])


def test_stop_ends_the_forward_and_the_block_goes_on() -> None:
    m, x = net(), torch.randn(2, 1, 6, 6)
    before = Snapshot.of(m)
    called: list = []
    handle = m.head.register_forward_hook(lambda *a: called.append(1))
    with surgery.apply(m, {"c": {"kind": "capture", "select": "act", "stop": True}}, verify=True) as s:
        assert m(x) is None
        assert not called  # head never ran
        went_on = True
        assert torch.equal(s.captures["c"]["act"].output, F.conv2d(x, m.conv.weight, m.conv.bias).relu())
    handle.remove()
    assert went_on and "forward" not in vars(m)
    assert before.differences(m) == []
    logits, _ = m(x)
    assert logits.shape == (2, 5)


def test_always_records_the_inputs_of_a_forward_that_raises() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(3, 3), Fails())
    x = torch.randn(2, 3)
    with surgery.apply(model, {"c": {"kind": "capture", "select": "1", "what": ["input", "output"],
                                     "always": True}}) as s:  # fmt: skip
        with pytest.raises(RuntimeError, match="boom"):
            model(x)
        (call,) = s.captures["c"]["1"].calls
    assert torch.equal(call.input[0], model[0](x)) and call.output is None


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ({"keep": "first"}, r"^actions\.a\.keep: 'first' is not one of all, last"),
        ({"always": True}, r"^actions\.a\.always: .*add input to what"),
        ({"detach": False, "reduce": "mean"}, r"^actions\.a\.detach: reduce: mean keeps running statistics"),
        ({"item": True}, r"^actions\.a\.item: must be an int position or a str key"),
        ({"select": "<root>", "stop": True}, r"^actions\.a\.stop: .*select a module inside it"),
        ({"index": "[:, 9]"}, r"^actions\.a\.index: \[:, 9\] does not fit the output of 'head'"),
    ],
)
def test_bad_capture_keys_are_refused_at_plan_time(action: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        surgery.plan(net(), {"a": {"kind": "capture", "select": "head", **action}},
                     example_inputs=(torch.randn(2, 1, 6, 6),))  # fmt: skip


def test_capture_fn_records_what_fn_returns_and_refuses_what_it_cannot_combine_with() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    x = torch.randn(2, 3)

    def doubled(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output * 2

    with surgery.apply(model, {"c": {"kind": "capture", "select": "0", "fn": doubled}}) as s:
        model(x)
        assert torch.equal(s.captures["c"]["0"].output, model[0](x).detach() * 2)
    with pytest.raises(ConfigError, match=r"^actions.c.fn: records fn\(module, inputs, output\).*drop what"):
        surgery.plan(model, {"c": {"kind": "capture", "select": "0", "fn": doubled, "what": ["input"]}})
    with pytest.raises(ConfigError, match=r"^actions.c.fn: .*safe"):
        surgery.plan(model, {"c": {"kind": "capture", "select": "0", "fn": doubled}}, safe=True)


class Masked(nn.Module):
    """forward(x, mask=None, *, scale=1.0): x * scale, masked."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float = 1.0) -> torch.Tensor:
        return x * scale if mask is None else x * scale * mask


class CallsMasked(nn.Module):
    def __init__(self, by_keyword: bool) -> None:
        super().__init__()
        self.inner, self.by_keyword = Masked(), by_keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x > 0).float()
        return self.inner(x, mask=mask) if self.by_keyword else self.inner(x, mask)


@pytest.mark.parametrize("by_keyword", [False, True])
def test_item_names_an_input_by_keyword_or_by_its_place_in_forward(by_keyword: bool) -> None:
    m, x = CallsMasked(by_keyword), torch.randn(3, 4)
    actions = {"c": {"kind": "capture", "select": "inner", "what": ["input"], "item": "mask", "index": "[0]"}}
    with surgery.apply(m, actions) as s:
        m(x)
        got = s.captures["c"]["inner"].input
    assert torch.equal(got, (x > 0).float()[0])  # the mask, not x, however it was passed


def test_an_item_naming_no_input_is_refused_and_one_not_passed_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(CallsMasked(False), {"c": {"kind": "capture", "select": "inner", "what": ["input"], "item": "x2"}})
    assert str(info.value) == "actions.c.item: Masked.forward of 'inner' has no input 'x2'; its inputs: x, mask, scale"
    m = CallsMasked(False)
    with surgery.apply(m, {"c": {"kind": "capture", "select": "inner", "what": ["input"], "item": "scale"}}):
        with pytest.raises(ActionError) as raised:
            m(torch.randn(3, 4))
    assert str(raised.value) == (
        "actions.c.item on module 'inner': input 'scale' was not passed; the module got 2 positional input(s) and"
        " keywords []"
    )
