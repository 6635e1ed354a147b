"""passes: main — an action's hooks act in the main pass only; a source pass runs without them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ConfigError


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))


@pytest.mark.parametrize("passes", ["main", "both"])
def test_a_main_only_change_is_absent_from_the_source_pass_and_present_after(passes: str) -> None:
    m, x, clean = model(), torch.randn(2, 3), torch.randn(2, 3)
    actions = {
        "shift": {"kind": "modify_output", "select": "0", "op": "add", "value": 1.0, "passes": passes},
        "cap": {"kind": "capture", "select": "2", "what": ["input"]},
    }
    with torch.no_grad(), surgery.apply(m, actions) as s:
        with s.source_pass():
            m(clean)
        shifted = m(x)
        recorded = s.captures["cap"]["2"].sources[0].input[0]
    with torch.no_grad():
        assert torch.equal(shifted, m[2](m[1](m[0](x) + 1.0)))
        want = m[1](m[0](clean) + (0.0 if passes == "main" else 1.0))
    assert torch.equal(recorded, want)


def test_passes_main_on_a_kind_that_changes_the_model_for_every_pass_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^actions.i.passes: 'main' needs hooks that run in a pass; init"):
        surgery.plan(model(), {"i": {"kind": "init", "select": "0", "param": "weight", "method": "zeros",
                                     "passes": "main"}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^actions.c.passes: "):
        surgery.plan(model(), {"c": {"kind": "capture", "select": "0", "passes": "sometimes"}})
