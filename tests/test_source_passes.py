"""Which frozen call a ``from: {capture}`` op reads over several forwards and source passes (SPEC §9): every
forward of the model counts a module's calls from 0, and a source pass freezes only the calls made inside it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ConfigError
from tests.test_sources_mutants import Thrice, adding, outputs

ACTIONS = {"c": {"kind": "capture", "select": "block"},
           "p": {"kind": "modify_output", "select": "block", "op": "add", "from": {"capture": "c"}}}  # fmt: skip


class Repeat(nn.Module):
    """One block called ``n`` times per forward (``n`` set between forwards)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.block = Thrice().block
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = self.block(x)
        return x


def test_every_forward_reads_calls_0_1_2_of_the_source_pass() -> None:
    m, a, b, c = Thrice(), torch.randn(2, 5, 6), torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    with surgery.apply(m, ACTIONS) as s:
        with s.source_pass():
            m(a)
        first, second, third = m(b), m(c), m(b)
    src = outputs(m, [m.block], a)
    assert torch.equal(first, adding(m, [m.block], b, src))
    assert torch.equal(second, adding(m, [m.block], c, src))  # batch 2 of a CLI run: calls 0, 1, 2 again
    assert torch.equal(third, first)


def test_a_second_source_pass_freezes_only_its_own_calls() -> None:
    m, a, b, c = Thrice(), torch.randn(2, 5, 6), torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    with surgery.apply(m, ACTIONS) as s:
        with s.source_pass():
            m(a)
        m(b)
        with s.source_pass():
            m(c)
        record = s.captures["c"]["block"]
        assert len(record.sources) == 3  # not the main pass's 3 calls as well
        main = [call.output for call in record.calls]
        got = m(b)
    src = outputs(m, [m.block], c)
    for frozen, want in zip(record.sources, src[0]):
        assert torch.equal(frozen.output, want)
    mains: list[list[torch.Tensor]] = [[]]
    adding(m, [m.block], b, outputs(m, [m.block], a), mains)
    assert len(main) == 3 and all(torch.equal(x, y) for x, y in zip(main, mains[0]))  # kept, not frozen
    assert torch.equal(got, adding(m, [m.block], b, src))


def test_a_source_pass_that_raises_leaves_every_record_as_before() -> None:
    m, a, b = Thrice(), torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    with surgery.apply(m, ACTIONS) as s:
        with s.source_pass():
            m(a)
        m(b)
        record = s.captures["c"]["block"]
        sources, calls = list(record.sources), list(record.calls)
        with pytest.raises(RuntimeError, match="stop"):
            with s.source_pass():
                m(b)
                raise RuntimeError("stop")
        assert record.sources == sources and record.calls == calls


def test_calls_past_the_last_frozen_call_read_the_last_within_a_forward() -> None:
    m, a, b = Repeat(1), torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    with surgery.apply(m, ACTIONS) as s:
        with s.source_pass():
            m(a)
        m.n = 3
        got = m(b)
    m.n = 1
    last = outputs(m, [m.block], a)[0][0]
    m.n = 3
    assert torch.equal(got, adding(m, [m.block], b, [[last] * 3]))


def test_the_count_of_each_forward_is_one_hook_on_the_model_counted_under_the_action() -> None:
    m = Thrice()
    with surgery.apply(m, ACTIONS) as s:
        assert s.hook_count == {"c": 1, "p": 3}  # the op's hook, a counting pre-hook on block, one on the model
        assert len(m._forward_pre_hooks) == 1 and len(m.block._forward_pre_hooks) == 1
    assert not m._forward_pre_hooks and not m.block._forward_pre_hooks


def test_calls_picks_which_calls_change_and_each_still_reads_the_frozen_call_with_its_number() -> None:
    m, a, b = Thrice(), torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    actions = {**ACTIONS, "p": {**ACTIONS["p"], "calls": "1:"}}
    with surgery.apply(m, actions) as s:
        with s.source_pass():
            m(a)
        first = m(b)
        s.reset_calls()  # calls: counts until reset_calls (the CLI resets before each batch)
        got = [first, m(b)]
    src = outputs(m, [m.block], a)[0]
    zero = torch.zeros_like(src[0])
    want = adding(m, [m.block], b, [[zero, src[1], src[2]]])  # call 0 untouched, calls 1 and 2 read 1 and 2
    assert torch.equal(got[0], want) and torch.equal(got[1], want)


def test_a_modify_input_reading_a_capture_counts_its_hooks_under_its_own_name() -> None:
    actions = {"c": {"kind": "capture", "select": "block", "what": ["input"]},
               "p": {"kind": "modify_input", "select": "block", "op": "add",
                     "from": {"capture": "c", "what": "input"}}}  # fmt: skip
    with surgery.apply(Thrice(), actions) as s:
        assert s.hook_count == {"c": 1, "p": 3}  # p: its pre-hook, the count on block and the reset on the model


def test_a_modify_input_reading_a_capture_cannot_be_prepended() -> None:
    actions = {"c": {"kind": "capture", "select": "block", "what": ["input"]},
               "p": {"kind": "modify_input", "select": "block", "op": "add", "prepend": True,
                     "from": {"capture": "c", "what": "input"}}}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        surgery.plan(Thrice(), actions)
    assert str(info.value) == (
        "actions.p.prepend: a modify_input reading from: {capture} runs after the pre-hook that numbers each call,"
        " so it cannot go first; drop prepend"
    )
    del actions["p"]["prepend"]
    surgery.plan(Thrice(), actions)  # the suggestion, taken
