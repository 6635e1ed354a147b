"""Globs match in time linear in the name: hostile patterns finish fast in select, exclude, param and rename,
and the matcher without backtracking agrees with the old regex translation on random small globs."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import surgery
from surgery.core.globs import ROOT, _cachedglob_regex, compile_globs, glob_regex, glob_rename
from surgery.core.select import Target, select_modules, select_params
from surgery.errors import ConfigError


@pytest.fixture(autouse=True)
def fresh_glob_cache() -> None:
    _cachedglob_regex.cache_clear()


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail when the block runs longer than ``seconds`` (SIGALRM: Python's regex engine checks for signals)."""

    def too_slow(*_: object) -> None:
        raise TimeoutError(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - start < seconds


A300 = "a" * 300
DOTTED = ".".join(["a"] * 150)  # 150 segments
# (pattern, name, matches): each backtracks catastrophically as one Python regex
HOSTILE = [
    ("*?*?*?*?*?*?b", A300, False),
    ("*?*?*?*?*?*?a", A300, True),
    ("*a*a*a*a*a*a*a*a*c", A300, False),
    ("[ab]*[ab]*[ab]*[ab]*[ab]*[ab]*c", A300, False),
    ("*" + "?*" * 40 + "b", A300, False),
    ("**.a.**.a.**.a.**.a.**.b", DOTTED, False),
    ("**.a.**.a.**.a.**.a.**.a", DOTTED, True),
    ("**.*a*a*a*.**.*a*a*a*.**.c", DOTTED, False),
    ("**.a*a*a*a*a*a*b", DOTTED + "." + A300, False),
    ("**." + ".".join(["*"] * 40) + ".b", DOTTED, False),  # one '**': one regex, and still fast
    ("**.*a", DOTTED + ".b", False),
]


@pytest.mark.parametrize(("pattern", "name", "matches"), HOSTILE, ids=[p[:30] for p, _, _ in HOSTILE])
def test_hostile_globs_match_fast(pattern: str, name: str, matches: bool) -> None:
    with within(1.0):
        assert compile_globs([pattern], "actions.a.select")(name) is matches


@pytest.mark.parametrize("pattern", ["*attn*", "**.*attn*", "blocks.*.*_proj*", "*?*?*?*?*?*?b", "**.a.**.b.**"])
def test_a_glob_is_one_regex_so_selection_stays_in_c(pattern: str) -> None:
    """select maps the regex over every name without a Python frame; only names with an empty segment, which no
    module has, take the slower table (for globs with several '**')."""
    assert isinstance(glob_regex([pattern], "w"), re.Pattern) or pattern.count("**") > 1
    names = [f"model.layers.{i}.self_attn.q_proj" for i in range(20000)]
    with within(1.0):
        list(map(glob_regex([pattern], "w").fullmatch, names))


def test_a_name_with_empty_segments_is_matched_exactly_under_several_double_stars() -> None:
    """Placing '*' where it first fits would leave the empty segment to a '**', which spans only non-empty ones."""
    matches = compile_globs(["**.*.**.b"], "w")
    assert matches("x..b") and matches(".x.b") and not matches("x..c")
    with within(1.0):
        assert not compile_globs(["**.a.**.a.**.a.**.b"], "w")(".." + DOTTED)


class Long(nn.Module):
    """A module with a 300-character child name and a 300-character parameter name."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module(A300, nn.Linear(2, 2))
        self.add_module("b", nn.Linear(2, 2))
        self.get_submodule(A300).register_parameter("w" * 300, nn.Parameter(torch.ones(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.get_submodule(A300)(x))


def test_select_and_exclude_with_hostile_globs_are_fast() -> None:
    model = Long()
    targets = [Target(name or ROOT, name or ROOT, module) for name, module in model.named_modules()]
    with within(1.0):
        assert select_modules(targets, ["*?*?*?*?*?*?b"], None, None, "actions.a") == []
        chosen = select_modules(targets, ["*?*?*?*?*?*?a", "b"], None, ["*?*?*?*?*?*?*?z", "b"], "actions.a")
        assert [t.name for t in chosen] == [A300]


def test_param_with_a_hostile_glob_is_fast() -> None:
    model = Long()
    target = Target(A300, A300, model.get_submodule(A300))
    with within(1.0):
        assert select_params(target, "*?*?*?*?*?*?*?z", "actions.a.param") == []
        assert [n for n, _ in select_params(target, "*?*?*?*?*?*?*?w", "actions.a.param")] == ["w" * 300]


def test_a_plan_with_hostile_globs_is_fast() -> None:
    actions = {
        "a": {"kind": "freeze", "select": "*?*?*?*?*?*?a", "exclude": "*a*a*a*a*a*a*a*c", "param": "*?*?*?*?*?*w"},
        "b": {"kind": "freeze", "select": "*?*?*?*?*?*?b", "param": "*", "allow_empty": True},
    }
    with within(2.0):
        plan = surgery.plan(Long(), actions)
    assert [t.name for t in plan.steps[0].targets] == [A300]


@pytest.mark.parametrize(
    ("old", "new", "name", "renamed"),
    [
        ("*?*?*?*?*?*?b.*", "*?*?*?*?*?*?c.*", A300 + ".w", None),
        ("*?*?*?*?*?*?a.*", "*?*?*?*?*?*?c.*", A300 + ".w", "a" * 299 + "c.w"),
        ("**.a.**.b", "**.c.**.d", DOTTED, None),
        ("**.a.**.a", "**.x.**.y", DOTTED, ".".join(["a"] * 148) + ".x.y"),
        ("p*q*.**", "r*s*.**", "pqqq.x.y", "rqqs.x.y"),  # the first '*' as long as it can be, as a regex
    ],
)
def test_rename_with_hostile_globs_is_fast_and_greedy(old: str, new: str, name: str, renamed: str | None) -> None:
    with within(1.0):
        assert glob_rename(old, new, "actions.r.rename")(name) == renamed


def test_on_load_rename_with_a_hostile_glob_loads_fast() -> None:
    model = nn.Module()
    model.add_module("a" * 299 + "c", nn.Linear(2, 2))
    checkpoint = {A300 + ".weight": torch.ones(2, 2), A300 + ".bias": torch.zeros(2)}
    rule = {"*?*?*?*?*?*?z.*": "*?*?*?*?*?*?y.*", "*?*?*?*?*?*?a.*": "*?*?*?*?*?*?c.*"}
    with surgery.apply(model, {"r": {"kind": "on_load", "rename": rule}}), within(2.0):
        model.load_state_dict(checkpoint)
    assert torch.equal(model.get_submodule("a" * 299 + "c").weight, torch.ones(2, 2))


@pytest.mark.parametrize("key", ["select", "exclude", "param"])
def test_a_glob_longer_than_the_limit_names_its_key(key: str) -> None:
    action = {"kind": "freeze", "select": "**", "param": "*", key: "a" * 1001}
    with pytest.raises(ConfigError, match=rf"^actions\.a\.{key}: glob is 1,001 characters long, more than 1,000"):
        surgery.plan(Long(), {"a": action})


def test_a_rename_glob_longer_than_the_limit_names_its_key() -> None:
    with pytest.raises(ConfigError, match=r"^actions\.r\.rename\.x: glob is 1,001 characters long"):
        glob_rename("a" * 1001, "b", "actions.r.rename.x")
    with pytest.raises(ConfigError, match=r"^actions\.r\.rename\.x: glob is 1,001 characters long"):
        glob_rename("a", "b" * 1001, "actions.r.rename.x")


# ------------------------------------------------------------------ the old translation, as a reference
_OLD_DOUBLE_STAR = {(True, False): r"(?:[^.]+\.)*", (False, True): r"(?:\.[^.]+)*", (False, False): r"\.(?:[^.]+\.)*"}


def old_segment(segment: str) -> str:
    out, i, n = [], 0, len(segment)
    while i < n:
        c = segment[i]
        i += 1
        if c in "*?":
            out.append("([^.]*)" if c == "*" else "([^.])")
        elif c == "[":
            j = i + 1 if i < n and segment[i] == "!" else i
            j = j + 1 if j < n and segment[j] == "]" else j
            end = segment.find("]", j)
            negate = segment[i] == "!"
            body = "".join(ch if ch == "-" else re.escape(ch) for ch in segment[i + negate : end])
            out.append(f"([^.{body}])" if negate else f"([{body}])")
            i = end + 1
        else:
            out.append(re.escape(c))
    return "".join(out)


def old_regex(pattern: str) -> re.Pattern[str]:
    """The glob translation before the linear matcher (every wildcard a group), for the cross-check."""
    segments: list[str] = []
    for seg in pattern.split("."):
        if not (seg == "**" and segments and segments[-1] == "**"):
            segments.append(seg)
    if segments == ["**"]:
        return re.compile("(.+)")
    out = []
    for i, seg in enumerate(segments):
        if seg == "**":
            out.append(f"({_OLD_DOUBLE_STAR[i == 0, i == len(segments) - 1]})")
        else:
            out.append((r"\." if i > 0 and segments[i - 1] != "**" else "") + old_segment(seg))
    return re.compile("".join(out))


segment_globs = st.lists(st.sampled_from(["a", "b", "*", "?", "[ab]", "[!a]", "[a-b]"]), min_size=1, max_size=5)
globs = st.lists(
    st.one_of(st.just("**"), segment_globs.map("".join)).filter(lambda s: "**" not in s or s == "**"),
    min_size=1,
    max_size=5,
).map(".".join)
names = st.lists(st.text("ab", min_size=0, max_size=4), min_size=1, max_size=6).map(".".join)


def _double_star_flags(segment_atoms: list | None) -> list[bool]:
    """For each wildcard group of one segment: whether it is a '**' (whose group holds dots the rename drops)."""
    return [True] if segment_atoms is None else [False for a in segment_atoms if a is None or a[1]]


@settings(max_examples=400, deadline=None)
@given(globs, names)
def test_the_linear_matcher_captures_what_the_old_regex_captured(pattern: str, name: str) -> None:
    """Forced on every glob (not only those the regex would backtrack on): same verdict, same captures."""
    from surgery.core.glob_table import LinearGlob
    from surgery.core.globs import _parse

    segments, atoms, _ = _parse(pattern, "w")
    match = old_regex(pattern).fullmatch(name)
    got = LinearGlob(segments, atoms).captures(name)
    wild = [flag for i in range(len(segments)) for flag in _double_star_flags(atoms[i])]
    expected = None if match is None else [g.strip(".") if d else g for g, d in zip(match.groups(), wild, strict=True)]
    if got is not None:  # rename drops the dots around what a '**' took
        got = [g.strip(".") if d else g for g, d in zip(got, wild, strict=True)]
    assert got == expected, (pattern, name)
    assert compile_globs([pattern], "w")(name) == (match is not None and name != ROOT)
