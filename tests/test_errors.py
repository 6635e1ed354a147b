"""Errors carry where they happened and what would have worked, besides their text."""

from __future__ import annotations

import pytest
from torch import nn

import surgery
from surgery.errors import EXIT_BAD_INPUT, ConfigError, ReplayError, SurgeryError, SweepError


def test_where_is_the_key_the_message_starts_with() -> None:
    assert ConfigError("actions.a.std: must be >= 0, got -0.5").where == "actions.a.std"
    assert ConfigError("input.batches: must be >= 1").where == "input.batches"
    assert ConfigError("something odd: happened").where is None  # not a dotted key: no guess
    assert ConfigError("free text", where="model.checkpoint").where == "model.checkpoint"


def test_unknown_key_lists_the_keys_that_exist() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ConfigError) as info:
        surgery.plan(model, {"a": {"kind": "capture", "selct": "0"}})
    assert info.value.where == "actions.a.selct"
    assert "select" in info.value.options and "what" in info.value.options


def test_unknown_kind_lists_every_kind() -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(nn.Linear(2, 2), {"a": {"kind": "captur"}})
    assert info.value.where == "actions.a.kind"
    assert {"capture", "init", "modify_output"} <= set(info.value.options)


def test_unknown_actions_file_lists_the_shipped_ones() -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(nn.Linear(2, 2), "linearise")
    assert "linearize" in info.value.options


def test_every_tool_error_is_a_surgery_error_with_one_exit_code() -> None:
    assert issubclass(SweepError, SurgeryError) and issubclass(ReplayError, SurgeryError)
    assert EXIT_BAD_INPUT == 2
