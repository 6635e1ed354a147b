"""Sources without files that broadcast (SPEC §9): ``from:`` a Python tensor or a capture on add, mul, set and
patch, and a tensor ``value`` / callable ``fn`` in dict recipes; each against the same hooks written by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError


class Block(nn.Module):
    """A residual block over [B, T, D], like a transformer layer's stream."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Stream(nn.Module):
    """Three residual blocks and a readout."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(3))
        self.out = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def model() -> Stream:
    torch.manual_seed(0)
    return Stream().eval()


def by_hand(m: nn.Module, module: nn.Module, hook, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    handle = module.register_forward_hook(hook)
    try:
        return m(x)
    finally:
        handle.remove()


def test_steering_vector_broadcasts_onto_every_position() -> None:
    m, x = model(), torch.randn(2, 5, 6)
    v = torch.randn(6)
    with surgery.apply(m, {"steer": {"kind": "modify_output", "select": "blocks.1", "op": "add", "value": v}}):
        got = m(x)
    assert torch.equal(got, by_hand(m, m.blocks[1], lambda mod, a, o: o + v, x))


def test_steering_at_one_position_with_index() -> None:
    m, x = model(), torch.randn(2, 5, 6)
    v = torch.randn(6)
    actions = {"steer": {"kind": "modify_output", "select": "blocks.0", "op": "add", "from": v, "index": "[:, 3]"}}
    with surgery.apply(m, actions):
        got = m(x)

    def hook(mod: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor:
        out = o.clone()
        out[:, 3] = o[:, 3] + v
        return out

    assert torch.equal(got, by_hand(m, m.blocks[0], hook, x))


def test_set_and_mul_broadcast_a_t_d_source_onto_b_t_d() -> None:
    m, x = model(), torch.randn(3, 5, 6)
    src = torch.randn(5, 6)
    for op, fn in (("set", lambda o: src.expand_as(o).clone()), ("mul", lambda o: o * src)):
        with surgery.apply(m, {"a": {"kind": "modify_output", "select": "blocks.2", "op": op, "from": src}}):
            got = m(x)
        assert torch.equal(got, by_hand(m, m.blocks[2], lambda mod, a, o, fn=fn: fn(o), x)), op


def test_a_full_shape_source_is_cut_by_index_like_the_tensor() -> None:
    m, x = model(), torch.randn(2, 5, 6)
    full = torch.randn(2, 5, 6)
    actions = {"p": {"kind": "modify_output", "select": "blocks.1", "op": "patch", "from": full, "index": "[:, 1:3]"}}
    with surgery.apply(m, actions):
        got = m(x)

    def hook(mod: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor:
        out = o.clone()
        out[:, 1:3] = full[:, 1:3]
        return out

    assert torch.equal(got, by_hand(m, m.blocks[1], hook, x))


def test_the_source_is_a_copy_the_caller_and_the_model_cannot_change() -> None:
    m, x = model(), torch.randn(2, 5, 6)
    v = torch.randn(6)
    kept = v.clone()
    with surgery.apply(m, {"s": {"kind": "modify_output", "select": "blocks.0", "op": "set", "from": v}}):
        v.add_(100.0)  # the caller's tensor changes after planning: the plan took its own copy
        first = m(x)
        second = m(x)  # Block adds in place? no: but a patched output handed to the model is owned memory
    expected = by_hand(m, m.blocks[0], lambda mod, a, o: kept.expand_as(o).clone(), x)
    assert torch.equal(first, expected) and torch.equal(second, expected)


def test_mean_ablation_from_a_capture_in_the_same_call() -> None:
    m, x = model(), torch.randn(4, 5, 6)
    actions = {
        "c": {"kind": "capture", "select": "blocks.1"},
        "ablate": {"kind": "modify_output", "select": "blocks.1", "op": "set",
                   "from": {"capture": "c", "reduce": "mean", "dim": 0}},
    }  # fmt: skip
    with surgery.apply(m, actions):
        got = m(x)
    assert torch.equal(got, by_hand(m, m.blocks[1], lambda mod, a, o: o.mean(0, keepdim=True).expand_as(o).clone(), x))


def test_activation_patching_from_a_source_pass() -> None:
    m = model()
    clean, corrupt = torch.randn(1, 5, 6), torch.randn(1, 5, 6)
    actions = {
        "clean": {"kind": "capture", "select": "blocks.*"},
        "patch": {"kind": "modify_output", "select": "blocks.1", "op": "patch", "from": {"capture": "clean"},
                  "index": "[:, 2]"},
    }  # fmt: skip
    with surgery.apply(m, actions) as s:
        m(clean)
        s.freeze_sources()
        got = m(corrupt)
        assert len(s.captures["clean"]["blocks.1"].sources) == 1  # the source pass's calls stay readable
    stored = {}
    handle = m.blocks[1].register_forward_hook(lambda mod, a, o: stored.__setitem__("o", o.detach()))
    m(clean)
    handle.remove()

    def hook(mod: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor:
        out = o.clone()
        out[:, 2] = stored["o"][:, 2]
        return out

    assert torch.equal(got, by_hand(m, m.blocks[1], hook, corrupt))


def test_source_pass_reads_call_k_for_call_k() -> None:
    m = model()
    shared = m.blocks[0]
    twice = nn.Sequential(shared, shared)  # one module called twice per forward
    a, b = torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    actions = {
        "c": {"kind": "capture", "select": "0"},
        "p": {"kind": "modify_output", "select": "0", "op": "patch", "from": {"capture": "c"}},
    }
    with surgery.apply(twice, actions) as s:
        twice(a)
        s.freeze_sources()
        got = twice(b)
    assert torch.equal(got, shared(shared(a)))  # call 0 gets source call 0, call 1 source call 1


def test_modify_input_from_a_source_pass_of_the_input() -> None:
    m = model()
    a, b = torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    actions = {
        "c": {"kind": "capture", "select": "out", "what": ["input"]},
        "p": {"kind": "modify_input", "select": "out", "op": "add", "from": {"capture": "c", "what": "input"}},
    }
    with surgery.apply(m, actions) as s:
        with pytest.raises(ActionError, match=r"actions\.p\.from on module 'out': .*no call"):
            m(a)  # in one pass the pre-hook runs before the capture has the call
        with s.source_pass():  # the op changes nothing while the capture records the source
            assert torch.equal(m(a), model()(a))
        got = m(b)
    stream = {}
    handle = m.out.register_forward_pre_hook(lambda mod, args: stream.__setitem__("a", args[0]))
    m(a)
    handle.remove()
    handle = m.out.register_forward_pre_hook(lambda mod, args: (args[0] + stream["a"],))
    expected = m(b)
    handle.remove()
    assert torch.equal(got, expected)


def test_python_callable_fn_in_a_dict_recipe() -> None:
    m, x = model(), torch.randn(2, 5, 6)

    def halve(t: torch.Tensor) -> torch.Tensor:
        return t / 2

    with surgery.apply(m, {"f": {"kind": "modify_output", "select": "blocks.0", "op": "fn", "fn": halve}}):
        got = m(x)
    assert torch.equal(got, by_hand(m, m.blocks[0], lambda mod, a, o: o / 2, x))
    with pytest.raises(ConfigError, match=r"^actions\.f\.fn: 'test_python_callable_fn_in_a_dict_recipe.<locals>"):
        surgery.plan(m, {"f": {"kind": "modify_output", "select": "blocks.0", "op": "fn", "fn": halve}}, safe=True)
    with surgery.apply(m, {"r": {"kind": "replace_forward", "select": "blocks.2", "fn": lambda mod, a, o: a[0]}}):
        assert torch.equal(m(x), m.out(m.blocks[1](m.blocks[0](x))))


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ({"kind": "modify_output", "select": "blocks.0", "op": "add", "value": torch.ones(6)},
         r"^actions\.a\.value: a Python tensor is refused because safe=true"),
        ({"kind": "modify_output", "select": "blocks.0", "op": "set", "from": torch.ones(6)},
         r"^actions\.a\.from: a Python tensor is refused because safe=true"),
    ],
)  # fmt: skip
def test_python_objects_are_refused_under_safe(action: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        surgery.plan(model(), {"a": action}, safe=True)


@pytest.mark.parametrize(
    ("actions", "message"),
    [
        ({"a": {"kind": "modify_output", "select": "blocks.0", "op": "add", "value": torch.ones(4)}},
         r"^actions\.a\.value: the tensor given as value has shape \[4\].*'blocks\.0' is \[2, 5, 6\] on"),
        ({"a": {"kind": "modify_output", "select": "blocks.0", "op": "set", "from": torch.ones(3, 5, 6),
                "index": "[:, 0]"}}, r"^actions\.a\.from: .*\[3, 5, 6\].*\[2, 6\].*nor onto the whole output, shape"),
        ({"a": {"kind": "modify_output", "select": "blocks.0", "op": "set", "from": {"capture": "c"}},
          "c": {"kind": "capture", "select": "blocks.0"}},
         r"^actions\.a\.from\.capture: no capture action 'c' is listed before this one"),
        ({"c": {"kind": "log", "select": "blocks.0"},
          "a": {"kind": "modify_output", "select": "blocks.0", "op": "set", "from": {"capture": "c"}}},
         r"^actions\.a\.from\.capture: 'c' is a log action, not a capture"),
        ({"c": {"kind": "capture", "select": "blocks.0"},
          "a": {"kind": "modify_output", "select": "blocks.1", "op": "set", "from": {"capture": "c"}}},
         r"^actions\.a\.from\.capture: capture 'c' does not record 'blocks\.1'"),
        ({"c": {"kind": "capture", "select": "blocks.0", "reduce": "mean"},
          "a": {"kind": "modify_output", "select": "blocks.0", "op": "set", "from": {"capture": "c"}}},
         r"^actions\.a\.from\.capture: capture 'c' keeps statistics"),
        ({"a": {"kind": "capture", "select": "blocks.0", "value": torch.ones(1)}},
         r"^actions\.a\.value: unknown key"),
        ({"a": {"kind": "replace_forward", "select": "blocks.0", "expr": torch.ones(1)}},
         r"^actions\.a\.expr: a Python Tensor is not a config value; here only fn may be one"),
    ],
)  # fmt: skip
def test_bad_sources_are_refused_at_plan_time(actions: dict, message: str) -> None:
    m = model()
    with pytest.raises(ConfigError, match=message):
        surgery.plan(m, actions, example_inputs=(torch.randn(2, 5, 6),))
