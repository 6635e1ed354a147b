"""Error text is a contract: each bad config names where, what was given and what would work."""

from __future__ import annotations

import pytest

import surgery
from surgery.errors import ConfigError, NoMatchError
from tests.conftest import Snapshot, TinyNet

# (action config, error type, fragments the message must contain)
BAD = [
    ({"kind": "inti", "param": "weight", "method": "ones"}, ConfigError,
     ["actions.a.kind", "unknown action kind 'inti'", "Did you mean 'init'", "Available:"]),
    ({"select": "fc"}, ConfigError, ["actions.a.kind", "needs a kind"]),
    ({"kind": "init", "select": "fc", "parm": "weight", "method": "ones"}, ConfigError,
     ["actions.a.parm", "unknown key", "Did you mean 'param'"]),
    ({"kind": "init", "select": "fc", "method": "ones"}, ConfigError, ["actions.a.param", "required"]),
    ({"kind": "init", "select": "fc", "param": "weight", "method": "constant"}, ConfigError,
     ["actions.a.value", "needs a value"]),
    ({"kind": "init", "select": "fc", "param": "weight", "method": "xavier"}, ConfigError,
     ["actions.a.method", "'xavier' is not one of", "Did you mean"]),
    ({"kind": "init", "select": "fc", "param": "wieght", "method": "ones"}, NoMatchError,
     ["actions.a.param", "'wieght' matched no parameter", "weight"]),
    ({"kind": "init", "select": "fc", "param": "weight", "method": "eye", "std": "big"}, ConfigError,
     ["actions.a.std", "big"]),
    ({"kind": "capture", "select": "fcc"}, NoMatchError,
     ["actions.a.select", "'fcc' matched no module", "Closest module names: fc"]),
    ({"kind": "capture", "type": "Conv3d"}, NoMatchError, ["actions.a.type", "'Conv3d' matched no module", "Conv2d"]),
    ({"kind": "capture", "select": "conv", "type": "Linear"}, NoMatchError,
     ["actions.a.type", "matched none of the 1 module(s) selected", "Conv2d"]),
    ({"kind": "capture", "select": "a**b"}, ConfigError, ["actions.a", "**"]),
    ({"kind": "capture", "select": 3}, ConfigError, ["actions.a.select", "glob string"]),
    ({"kind": "capture", "select": "fc", "what": ["outputs"]}, ConfigError,
     ["actions.a.what", "'outputs' is not one of input, output", "Did you mean 'output'"]),
    ({"kind": "capture", "select": "fc", "to": "cloud"}, ConfigError,
     ["actions.a.to", "'cloud' is not one of memory, disk"]),
    ({"kind": "add_parameter", "select": "fc", "name": "bias", "shape": [3]}, ConfigError,
     ["actions.a.name", "already has an attribute 'bias'"]),
    ({"kind": "add_parameter", "select": "fc", "name": "b2"}, ConfigError, ["actions.a.shape", "exactly one of shape"]),
    ({"kind": "add_parameter", "select": "fc", "name": "b2", "like": "gamma"}, ConfigError,
     ["actions.a.like", "no parameter or buffer 'gamma'", "weight, bias"]),
    ({"kind": "add_parameter", "select": "fc", "name": "b2", "shape": [3], "init": {"method": "orthogonal"}},
     ConfigError, ["actions.a.init.method", "2 or more dims"]),
    ({"kind": "add_parameter", "select": "fc", "name": "b2", "shape": [3], "init": {"methd": "ones"}},
     ConfigError, ["actions.a.init.methd", "Did you mean 'method'"]),
    ({"kind": "add_parameter", "select": "fc", "name": "__class__", "shape": [3]}, ConfigError,
     ["actions.a.name", "not a public Python identifier"]),
    ({"kind": "replace_forward", "type": "ReLU"}, ConfigError, ["actions.a.fn", "exactly one of fn"]),
    ({"kind": "replace_forward", "type": "ReLU", "fn": "linear"}, ConfigError,
     ["actions.a.fn", "'linear' needs a weight", "ReLU"]),
    ({"kind": "replace_forward", "type": "ReLU", "fn": "identiy"}, ConfigError,
     ["actions.a.fn", "Did you mean 'identity'"]),
    ({"kind": "replace_forward", "type": "ReLU", "expr": "__import__('os')"}, ConfigError,
     ["actions.a.expr", "__import__"]),
    ({"kind": "modify_output", "select": "fc", "op": "scale", "value": 2}, ConfigError,
     ["actions.a.op", "'scale' is not one of"]),
    ({"kind": "modify_output", "select": "fc", "op": "add"}, ConfigError, ["actions.a.value", "op 'add' needs value"]),
    ({"kind": "modify_output", "select": "fc", "op": "clamp"}, ConfigError, ["actions.a.min", "needs min, max"]),
    ({"kind": "modify_output", "select": "fc", "op": "clip_norm", "max_norm": 1}, ConfigError,
     ["actions.a.op", "'clip_norm' is not one of"]),
    ({"kind": "modify_output", "select": "fc", "op": "zero", "index": "[x]"}, ConfigError, ["actions.a.index"]),
    ({"kind": "modify_input", "select": "fc", "op": "zero", "item": "hidden"}, ConfigError,
     ["actions.a.item", "Linear.forward of 'fc' has no input 'hidden'; its inputs: input"]),
    ({"kind": "modify_grad", "select": "fc", "param": "weight", "item": 0, "op": "zero"}, ConfigError,
     ["actions.a.item", "drop item"]),
    ({"kind": "freeze", "select": "act", "param": "weight"}, NoMatchError,
     ["actions.a.param", "matched no parameter", "Set allow_empty"]),
]  # fmt: skip


@pytest.mark.parametrize(("action", "error", "fragments"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_action_is_refused_at_plan_time_with_a_clear_message(action, error, fragments, tiny: TinyNet) -> None:
    before = Snapshot.of(tiny)
    with pytest.raises(error) as info:
        surgery.apply(tiny, {"a": action})
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message
    before.assert_same(tiny)


def test_allow_empty_and_strict_false_let_an_empty_match_through(tiny: TinyNet) -> None:
    action = {"kind": "capture", "select": "nothing_here"}
    assert surgery.plan(tiny, {"a": {**action, "allow_empty": True}}).steps[0].targets == []
    assert surgery.plan(tiny, {"a": action}, strict=False).steps[0].targets == []


def test_unknown_actions_name_lists_the_shipped_ones(tiny: TinyNet) -> None:
    with pytest.raises(ConfigError, match=r"no actions file named 'linearise'.*Did you mean 'linearize'"):
        surgery.plan(tiny, "linearise")


def test_plan_for_another_model_is_refused(tiny: TinyNet) -> None:
    plan = surgery.plan(tiny, "linearize")
    with pytest.raises(ConfigError, match="compiled for another model"):
        surgery.apply(TinyNet(), plan)
