"""``glob_rename`` (on_load's ``rename``): each wildcard of the old name fills the same wildcard of the new one."""

from __future__ import annotations

import pytest

from surgery.core.globs import _cachedglob_regex, _qualified_names, glob_rename
from surgery.errors import ConfigError


@pytest.fixture(autouse=True)
def fresh_glob_cache() -> None:
    """Compile every glob afresh in each test: with the cache warm, mutation testing never saw a test reach it."""
    _cachedglob_regex.cache_clear()


RENAMES = [
    # (old, new, name, renamed or None when old does not match)
    ("blocks.*.attn.*", "layers.*.attention.*", "blocks.3.attn.weight", "layers.3.attention.weight"),
    ("blocks.*.attn.*", "layers.*.attention.*", "blocks.3.mlp.weight", None),
    ("blocks.*.attn", "layers.*.attention", "blocks.3.attn.weight", None),  # whole keys only
    ("module.**", "**", "module.enc.lin.weight", "enc.lin.weight"),
    ("module.**", "**", "module", ""),  # '**' at the end may take zero segments: the dot goes too
    ("**", "model.**", "a.b", "model.a.b"),
    ("**.w", "**.weight", "w", "weight"),  # '**' at the start, zero segments: its dot goes
    ("**.w", "**.weight", "a.b.w", "a.b.weight"),
    ("a.**.w", "b.**.v", "a.w", "b.v"),  # in the middle, zero segments: one dot stays
    ("a.**.w", "b.**.v", "a.x.w", "b.x.v"),
    ("a.**.w", "b.**.v", "a.x.y.w", "b.x.y.v"),
    ("x.**", "y.**", "x.p.q", "y.p.q"),
    ("x.**", "y.**", "x", "y"),  # '**' at the end, zero segments: the dot before it goes
    ("l?.*", "layer?.*", "l1.bias", "layer1.bias"),
    ("l[0-9].*", "m[0-9].*", "l7.bias", "m7.bias"),
    ("l[0-9].*", "m[0-9].*", "lx.bias", None),
    ("p*q.*", "r*s.*", "pabq.w", "rabs.w"),
    ("*.*.w", "*.*.v", "a.b.w", "a.b.v"),  # in order
    ("fixed.w", "other.v", "fixed.w", "other.v"),  # no wildcards
    ("fixed.w", "other.v", "fixed.wx", None),
    ("xx.**", "yy.**", "xx", "yy"),  # only the one dot goes, not more of the literal
    ("module.**", "**", "module.X.Y", "X.Y"),  # a '**' capture loses its dots only
]


@pytest.mark.parametrize(("old", "new", "name", "renamed"), RENAMES)
def test_glob_rename(old: str, new: str, name: str, renamed: str | None) -> None:
    assert glob_rename(old, new, "actions.r.rename")(name) == renamed


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("a.*", "b", "'a.*' -> 'b': the new name needs the same wildcards in the same order (* vs none)"),
        ("a", "b.*", "'a' -> 'b.*': the new name needs the same wildcards in the same order (none vs *)"),
        ("**.a.*", "*.b.**", "(** * vs * **)"),  # order counts
        ("a.?", "b.**", "(* vs **)"),  # '?' and '[..]' are one-segment wildcards, like '*'
    ],
)  # fmt: skip
def test_glob_rename_refuses_different_wildcards(old: str, new: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        glob_rename(old, new, "actions.r.rename")
    assert str(info.value).endswith(message)
    assert str(info.value).startswith("actions.r.rename: ")


def test_qualified_names_are_every_package_prefix() -> None:
    class Local:
        pass

    Local.__module__ = "pkg.sub.mod"
    qual = Local.__qualname__
    assert _qualified_names(Local) == [f"pkg.{qual}", f"pkg.sub.{qual}", f"pkg.sub.mod.{qual}"]


@pytest.mark.parametrize(
    "pattern",
    ["[]a]", "[!]a]", "[]]", "[!]]", "[^a]", "[a-c]", "[!a-c]", "[-a]", "[a-]", "[!!]", "[$]", "[\\]", "[a]-[]c]"],
)
def test_bracket_specials_match_like_fnmatch(pattern: str) -> None:
    """Inside [ ], ']' first, '^', '-' at either end and regex specials are literal characters, as in fnmatch."""
    from fnmatch import fnmatchcase

    from surgery.core.globs import compile_globs

    matches = compile_globs([pattern], "w")
    for name in ["]", "a", "b", "c", "d", "^", "-", "!", "$", "\\", "x", "a-c", "a-]", "a]c", "a-c]"]:
        assert matches(name) == fnmatchcase(name, pattern), (pattern, name)


def test_glob_rename_names_the_key_for_a_bad_old_glob() -> None:
    with pytest.raises(ConfigError, match=r"^actions\.r\.rename: unclosed '\[' in glob 'a\.\[b'"):
        glob_rename("a.[b", "c.[b", "actions.r.rename")


def test_type_matcher_takes_one_pattern_as_a_string() -> None:
    from torch import nn

    from surgery.core.globs import type_matcher

    matches = type_matcher("ReLU", "w")
    assert matches(nn.ReLU) and not matches(nn.GELU)
