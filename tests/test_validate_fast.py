"""validate builds a config directly when every value already has its field's type; the result is the same.

Every action of every shipped recipe, and a table of nodes that need OmegaConf (conversions, missing
values, interpolation text), give the same dataclass or the same message either way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from surgery.core import schema
from surgery.core.steps import KINDS
from surgery.errors import ConfigError

ACTIONS = Path(__file__).resolve().parent.parent / "conf" / "actions"
SHIPPED = [(f.stem, name, node) for f in sorted(ACTIONS.glob("*.yaml"))
           for name, node in (yaml.safe_load(f.read_text()) or {}).items()]  # fmt: skip
ODD = [
    {"kind": "modify_output", "op": "add", "value": 1},  # an int for a float: OmegaConf converts it
    {"kind": "modify_output", "op": "add", "value": "1.5"},  # a string for a float
    {"kind": "modify_output", "op": "add", "value": True},  # a bool for a float
    {"kind": "modify_output", "op": "???"},  # a required value left missing
    {"kind": "capture", "select": "${other}"},  # interpolation text
    {"kind": "capture", "what": ["output"], "calls": [0, 2]},
    {"kind": "capture", "what": ["output", 1]},  # an int in a list of strings: OmegaConf converts it
    {"kind": "capture", "what": ["input", "nope"]},
    {"kind": "on_load", "rename": {"a.*": "b.*"}},
    {"kind": "init", "param": "weight", "method": "constant", "value": 2.0},
    {"kind": "add_parameter", "name": "b", "shape": [3], "init": {"method": "zeros"}},
    {"kind": "modify_output", "op": "clamp", "min": 0.0, "passes": "main", "enabled": False},
    {"kind": "modify_output", "op": "nope"},
]


def both(node: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    kind = KINDS.get(str(node["kind"]))
    results = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(schema, "_plain_fit", lambda schema_, node_: False)
        try:
            results.append(
                schema.validate(
                    kind.schema, {k: v for k, v in node.items() if k != "kind"} | {"kind": node["kind"]}, "actions.a"
                )
            )
        except ConfigError as e:
            results.append(("refused", str(e)))
    monkeypatch.undo()
    return results[0], results[1]


@pytest.mark.parametrize(("recipe", "name", "node"), SHIPPED)
def test_every_shipped_action_validates_the_same_fast_or_through_omegaconf(recipe, name, node, monkeypatch) -> None:
    if any(isinstance(v, str) and "${" in v for v in node.values()):
        pytest.skip("interpolates another action: resolved by Hydra before validation")
    fast, slow = both(node, monkeypatch)
    assert fast == slow


@pytest.mark.parametrize("node", ODD)
def test_nodes_that_need_omegaconf_give_the_same_result_or_message(node, monkeypatch) -> None:
    fast, slow = both(node, monkeypatch)
    assert fast == slow
