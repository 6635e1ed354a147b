"""A study's grid: ranges, cells in order, placeholders filled with their type, and every misuse refused."""

from __future__ import annotations

import pytest

from surgery.errors import ConfigError
from surgery.study.grid import cells, check_uses, fill, filler, parse_grid


def test_ranges_lists_and_all_become_value_lists() -> None:
    grid = parse_grid({"layer": "0:3", "pos": "all", "coef": [0.5, 2], "step": "10:0:-4"}, positions=2)
    assert grid == {"layer": [0, 1, 2], "pos": [0, 1], "coef": [0.5, 2], "step": [10, 6, 2]}


def test_cells_vary_the_last_variable_fastest() -> None:
    assert cells({"a": [0, 1], "b": ["x", "y"]}) == [
        {"a": 0, "b": "x"}, {"a": 0, "b": "y"}, {"a": 1, "b": "x"}, {"a": 1, "b": "y"}
    ]  # fmt: skip


def test_fill_writes_values_into_text_and_keeps_the_type_of_a_whole_placeholder() -> None:
    actions = {"p": {"select": "h.{layer}", "index": "[:, {pos}]", "value": "{coef}", "expr": "x{{0}}", "n": 3}}
    filled = fill(actions, {"layer": 2, "pos": 5, "coef": 0.25})
    assert filled == {"p": {"select": "h.2", "index": "[:, 5]", "value": 0.25, "expr": "x{0}", "n": 3}}
    assert isinstance(filled["p"]["value"], float)


@pytest.mark.parametrize(
    ("grid", "actions", "message"),
    [
        ({"layer": [0]}, {"p": {"select": "h.{layr}"}}, "actions.p.select: {layr} names no variable of study.grid"),
        ({"layer": [0], "pos": [1]}, {"p": {"select": "h.{layer}"}}, "study.grid.pos: no action uses it"),
        (
            {"layer": [0]},
            {"p": {"select": "h.{layer}", "index": "[{ 0 }]"}},
            "actions.p.index: { 0 } is not a variable",
        ),
    ],
)
def test_a_placeholder_without_a_variable_or_a_variable_without_use_is_refused(grid, actions, message) -> None:
    with pytest.raises(ConfigError) as e:
        check_uses(grid, actions)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"pos": "all"}, "study.grid.pos: 'all' means every position of a text input"),
        ({"pos": "3:3"}, "study.grid.pos: the range '3:3' is empty"),
        ({"pos": "0:4:0"}, "study.grid.pos: a range's step cannot be 0"),
        ({"pos": "a:b"}, "study.grid.pos: a list of values"),
        ({"pos": []}, "study.grid.pos: no values"),
        ({"1x": [1]}, "study.grid.1x: a variable name"),
        ({"a": "0:1001", "b": "0:1001"}, "study.grid: 1,002,001 cells are more than 1,000,000"),
        ({}, "study.grid: a mapping of named variables"),
    ],
)
def test_bad_grids_are_refused_naming_the_variable(grid, message) -> None:
    with pytest.raises(ConfigError) as e:
        parse_grid(grid)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("text", ["[:, {pos}]", "{coef}", "transformer.h.{layer}.{{x}}", "no placeholder", "{a}{b}"])
def test_a_filler_fills_one_text_as_fill_does(text: str) -> None:
    cell = {"pos": 3, "coef": 0.5, "layer": 1, "a": "x", "b": 2}
    assert filler(text)(cell) == fill(text, cell)
    assert type(filler(text)(cell)) is type(fill(text, cell))
