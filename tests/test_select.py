"""Selection by glob: one table of patterns, checked against a reference matcher too."""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any, cast

import pytest
import torch
from torch import nn

from surgery.core.globs import ROOT, _cachedglob_regex, compile_globs, original_class, type_matcher
from surgery.core.select import (
    ModuleIndex,
    Target,
    as_list,
    canonical_name,
    closest_names,
    module_targets,
    select_modules,
    select_params,
)
from surgery.errors import ConfigError


@pytest.fixture(autouse=True)
def fresh_glob_cache() -> None:
    """Compile every glob afresh in each test: with the cache warm, mutation testing never saw a test reach it."""
    _cachedglob_regex.cache_clear()


NAMES = [
    "<root>",
    "block1",
    "block1.conv",
    "block1.norm",
    "block1.act",
    "block2",
    "block2.conv",
    "block2.norm",
    "block2.act",
    "blocks",
    "blocks.0",
    "blocks.0.attn",
    "blocks.0.mlp",
    "blocks.0.mlp.fc1",
    "blocks.0.mlp.fc2",
    "blocks.1",
    "blocks.1.attn",
    "blocks.10",
    "blocks.10.attn",
    "fc",
    "head",
    "head.fc",
    "classifier",
    "classifier.0",
    "classifier.1",
    "blocks.attn",  # these three make '**' in the middle show whether it takes zero, one or two segments
    "blocks.0.1",
    "blocks.0.1.attn",
]
ALL = set(NAMES)
ATTN = {"blocks.0.attn", "blocks.1.attn", "blocks.10.attn"}
DEEP_ATTN = {"blocks.attn", "blocks.0.1.attn"}

GLOB_TABLE = [
    ("block1", {"block1"}),
    ("block", set()),  # whole name only: no prefix match
    ("blocks.0", {"blocks.0"}),  # the dot is literal, not "any character"
    ("blocks?0", set()),  # '?' never matches a dot
    ("block*", {"block1", "block2", "blocks"}),
    ("*1", {"block1"}),
    ("*fc*", {"fc"}),  # '*' stays inside one segment
    ("block1.*", {"block1.conv", "block1.norm", "block1.act"}),
    ("*.conv", {"block1.conv", "block2.conv"}),
    ("*", {"block1", "block2", "blocks", "fc", "head", "classifier"}),
    ("*.*", {n for n in NAMES if n.count(".") == 1}),
    ("?", set()),  # the root has no segments, so one-segment globs miss it
    ("**", ALL),
    ("**.**", ALL),
    ("**.*", ALL - {ROOT}),
    ("**.fc", {"fc", "head.fc"}),  # '**' at the start, zero segments included
    ("**.attn", ATTN | DEEP_ATTN),
    ("blocks.**", {n for n in NAMES if n.split(".")[0] == "blocks"}),  # at the end
    ("blocks.**.attn", ATTN | DEEP_ATTN),  # in the middle: zero, one and two segments
    ("blocks.**.**.attn", ATTN | DEEP_ATTN),  # '**.**' is '**', zero segments included
    ("blocks.**.1.attn", {"blocks.1.attn", "blocks.0.1.attn"}),
    ("blocks.**.0.**.attn", {"blocks.0.attn", "blocks.0.1.attn"}),
    ("blocks.*.**.attn", ATTN | {"blocks.0.1.attn"}),  # '*' before it takes exactly one segment
    ("blocks.**.*.attn", ATTN | {"blocks.0.1.attn"}),
    ("**.blocks.**.attn", ATTN | DEEP_ATTN),
    ("blocks.**.attn.**", ATTN | DEEP_ATTN),
    ("blocks.**.0", {"blocks.0"}),
    ("blocks.**.1", {"blocks.1", "blocks.0.1"}),
    ("blocks.**.fc?", {"blocks.0.mlp.fc1", "blocks.0.mlp.fc2"}),
    ("**.mlp.**", {"blocks.0.mlp", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2"}),
    ("blocks.*.*.fc1", {"blocks.0.mlp.fc1"}),
    ("b*.*.attn", ATTN),
    ("blocks.?", {"blocks.0", "blocks.1"}),
    ("blocks.??", {"blocks.10"}),
    ("blocks.?.attn", {"blocks.0.attn", "blocks.1.attn"}),
    ("blocks.1*.attn", {"blocks.1.attn", "blocks.10.attn"}),
    ("blocks.[01].attn", {"blocks.0.attn", "blocks.1.attn"}),
    ("blocks.[!0].attn", {"blocks.1.attn"}),
    ("blocks.[0-9]*", {"blocks.0", "blocks.1", "blocks.10"}),
    ("block[12].norm", {"block1.norm", "block2.norm"}),
    (
        "block[!1].*",
        {"block2.conv", "block2.norm", "block2.act", "blocks.0"} | {"blocks.1", "blocks.10", "blocks.attn"},
    ),
    ("classifier.[1]", {"classifier.1"}),
    ("<root>", {ROOT}),
    ("head.fc", {"head.fc"}),
    ("nothing.**", set()),
]


def reference_match(pattern: str, name: str) -> bool:
    """Segment-by-segment matcher using fnmatch: the rule written the slow, obvious way."""
    if pattern == ROOT:
        return name == ROOT
    segments = [] if name == ROOT else name.split(".")

    def match(pats: list[str], segs: list[str]) -> bool:
        if not pats:
            return not segs
        if pats[0] == "**":
            return any(match(pats[1:], segs[k:]) for k in range(len(segs) + 1))
        return bool(segs) and fnmatchcase(segs[0], pats[0]) and match(pats[1:], segs[1:])

    return match(pattern.split("."), segments)


@pytest.mark.parametrize(("pattern", "expected"), GLOB_TABLE)
def test_glob_table(pattern: str, expected: set[str]) -> None:
    matches = compile_globs([pattern], "actions.t.select")
    assert {n for n in NAMES if matches(n)} == expected


@pytest.mark.parametrize("pattern", [p for p, _ in GLOB_TABLE])
def test_reference_matcher_agrees(pattern: str) -> None:
    matches = compile_globs([pattern], "w")
    assert {n for n in NAMES if matches(n)} == {n for n in NAMES if reference_match(pattern, n)}


def test_patterns_are_alternatives() -> None:
    matches = compile_globs(["block1", "**.fc", "<root>"], "w")
    assert {n for n in NAMES if matches(n)} == {"block1", "fc", "head.fc", ROOT}
    assert {n for n in NAMES if compile_globs("block1", "w")(n)} == {"block1"}
    assert not any(compile_globs([], "w")(n) for n in NAMES)


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("a**b", "`**` must be a whole segment"),
        ("blocks.**x", "`**` must be a whole segment"),
        ("blocks.[01", "unclosed '['"),
        ("[!", "unclosed '['"),
        ("a..b", "empty segment"),
        (".a", "empty segment"),
        ("", "non-empty glob"),
        ("<root>.block1", "must be the whole pattern"),
        ("[z-a]", "bad glob"),
        (3, "non-empty glob"),
    ],
)
def test_bad_patterns(pattern: str, message: str) -> None:
    with pytest.raises(ConfigError, match="actions.bad.select") as info:
        compile_globs(["ok", pattern], "actions.bad.select")
    assert message in str(info.value)


# --- types ------------------------------------------------------------------


class Function_a(nn.Module):  # noqa: N801 - named like the seeds' exercise
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Function_b(Function_a):  # noqa: N801
    pass


class MyConv(nn.Conv2d):
    pass


TYPE_CLASSES = [
    nn.Conv2d,
    MyConv,
    nn.BatchNorm2d,
    nn.ReLU,
    nn.Linear,
    Function_a,
    Function_b,
]


@pytest.mark.parametrize(
    ("patterns", "expected"),
    [
        (["Conv2d"], {nn.Conv2d}),  # exact class: the subclass MyConv is not a Conv2d
        (["Function_*"], {Function_a, Function_b}),
        (["Function_?"], {Function_a, Function_b}),
        (["[BL]*"], {nn.BatchNorm2d, nn.Linear}),
        (["ReLU", "Linear"], {nn.ReLU, nn.Linear}),
        (["torch.nn.Conv2d"], {nn.Conv2d}),
        (["torch.nn.modules.conv.Conv2d"], {nn.Conv2d}),
        (["torch.Conv2d"], {nn.Conv2d}),
        (["torch.nn.modules.*.Conv2d"], {nn.Conv2d}),
        (["torch.**.Conv2d"], {nn.Conv2d}),
        (["torch.nn.*"], {nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Linear}),
        (["nn.Conv2d"], set()),  # prefixes start at the top-level package
        (["**.Function_a"], {Function_a}),
        (["Conv"], set()),
        ([], set()),
    ],
)
def test_type_table(patterns: list[str], expected: set[type]) -> None:
    matches = type_matcher(patterns, "actions.t.type")
    assert {cls for cls in TYPE_CLASSES if matches(cls)} == expected
    assert {cls for cls in TYPE_CLASSES if matches(cls)} == expected  # cached answer


def test_bad_type_pattern_names_where() -> None:
    with pytest.raises(ConfigError, match=r"actions\.t\.type: `\*\*` must be"):
        type_matcher(["Conv**"], "actions.t.type")


# --- modules ----------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def tiny_net() -> nn.Module:
    net = nn.Module()
    net.block1 = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU())
    net.blocks = nn.ModuleList([Block(), Block()])
    net.act = Function_a()
    net.classifier = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    return net


def names(targets: list[Target]) -> list[str]:
    return [t.name for t in targets]


def test_module_targets_bare_model() -> None:
    net = tiny_net()
    targets = module_targets(net)
    assert names(targets)[:3] == [ROOT, "block1", "block1.0"]
    assert [(t.real_name, t.module) for t in targets[1:]] == list(net.named_modules())[1:]
    assert targets[0].real_name == "" and targets[0].module is net


@pytest.mark.parametrize(
    ("select", "types", "exclude", "expected"),
    [
        (None, None, None, None),  # None: every module
        (
            None,
            ["Linear"],
            None,
            [
                "blocks.0.attn",
                "blocks.0.mlp.0",
                "blocks.0.mlp.2",
                "blocks.1.attn",
                "blocks.1.mlp.0",
                "blocks.1.mlp.2",
                "classifier.1",
            ],
        ),
        (
            ["blocks.**"],
            ["Linear"],
            ["**.mlp.2"],
            ["blocks.0.attn", "blocks.0.mlp.0", "blocks.1.attn", "blocks.1.mlp.0"],
        ),
        (["blocks.*"], ["Block"], ["blocks.1"], ["blocks.0"]),
        (["block1.*"], ["torch.nn.Conv2d", "ReLU"], None, ["block1.0", "block1.2"]),
        (["block1"], ["Linear"], None, []),  # select AND type
        (["act", "<root>"], ["Function_*", "Module"], None, [ROOT, "act"]),
        (["**"], None, ["**"], []),
        ([], None, None, []),
    ],
)
def test_select_modules(
    select: list[str] | None,
    types: list[str] | None,
    exclude: list[str] | None,
    expected: list[str] | None,
) -> None:
    targets = module_targets(tiny_net())
    picked = select_modules(targets, select, types, exclude, "actions.t")
    assert names(picked) == (names(targets) if expected is None else expected)


@pytest.mark.parametrize("key", ["select", "type", "exclude"])
def test_select_modules_error_names_the_key(key: str) -> None:
    kwargs: dict[str, list[str] | None] = {
        "select": None,
        "types": None,
        "exclude": None,
    }
    kwargs["types" if key == "type" else key] = ["a**"]
    with pytest.raises(ConfigError, match=rf"actions\.t\.{key}: `\*\*` must be"):
        select_modules(module_targets(tiny_net()), where="actions.t", **kwargs)  # type: ignore[arg-type]


# --- wrappers ---------------------------------------------------------------


class DistributedDataParallel(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


class DataParallel(DistributedDataParallel):
    pass


class NotAWrapper(DistributedDataParallel):  # a child called 'module' is a real name
    pass


class FullyShardedDataParallel(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._fsdp_wrapped_module = inner


class CheckpointWrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = inner


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports
@pytest.mark.parametrize(
    "wrap",
    [
        torch.compile,
        DistributedDataParallel,
        DataParallel,
        lambda m: torch.compile(DistributedDataParallel(m)),
        lambda m: DistributedDataParallel(cast(nn.Module, torch.compile(m))),
        FullyShardedDataParallel,
        lambda m: DistributedDataParallel(FullyShardedDataParallel(m)),
    ],
    ids=["compile", "ddp", "dp", "compile-ddp", "ddp-compile", "fsdp", "ddp-fsdp"],
)
def test_wrapped_model_has_the_bare_names_and_modules(wrap: Callable[[nn.Module], Any]) -> None:
    net = tiny_net()
    bare = module_targets(net)
    wrapped = module_targets(wrap(net))
    assert names(wrapped) == names(bare)
    assert all(w.module is b.module for w, b in zip(wrapped, bare, strict=True))
    assert wrapped[0].module is net and wrapped[0].real_name != ""


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compiled_real_names_keep_the_wrapper() -> None:
    targets = {t.name: t for t in module_targets(cast(nn.Module, torch.compile(tiny_net())))}
    assert targets["block1.0"].real_name == "_orig_mod.block1.0"
    assert targets[ROOT].real_name == "_orig_mod"


def test_child_named_module_is_kept_without_a_ddp_root() -> None:
    assert names(module_targets(NotAWrapper(nn.Linear(2, 2)))) == [ROOT, "module"]


def test_fsdp_and_checkpoint_segments_inside_the_model() -> None:
    net = nn.Module()
    net.layers = nn.ModuleList([FullyShardedDataParallel(Block()), CheckpointWrapper(Block())])
    targets = {t.name: t for t in module_targets(net)}
    assert targets["layers.0.attn"].real_name == "layers.0._fsdp_wrapped_module.attn"
    assert targets["layers.1.attn"].real_name == "layers.1._checkpoint_wrapped_module.attn"
    # the type filter sees the wrapped Block, not the wrapper
    picked = select_modules(list(targets.values()), ["layers.*"], ["Block"], None, "w")
    assert names(picked) == ["layers.0", "layers.1"]


@pytest.mark.parametrize(
    ("real", "root_is_ddp", "expected"),
    [
        ("", False, ROOT),
        ("_orig_mod", False, ROOT),
        ("_orig_mod.a.b", False, "a.b"),
        ("a._checkpoint_wrapped_module.b", False, "a.b"),
        ("a._fsdp_wrapped_module._orig_mod.b", False, "a.b"),
        ("a._orig_mod_x", False, "a._orig_mod_x"),  # whole segments only
        ("module", True, ROOT),
        ("module.a", True, "a"),
        ("_orig_mod.module.a", True, "a"),
        ("module.a", False, "module.a"),
        ("a.module.b", True, "a.module.b"),  # only a leading 'module'
        ("modules.a", True, "modules.a"),
    ],
)
def test_canonical_name(real: str, root_is_ddp: bool, expected: str) -> None:
    assert canonical_name(real, root_is_ddp) == expected


# --- parameters -------------------------------------------------------------


def test_select_params_own_tensors_in_registration_order() -> None:
    module = Function_a()
    module.W2 = nn.Parameter(torch.zeros(1))
    module.b = nn.Parameter(torch.zeros(1))
    module.W = nn.Parameter(torch.ones(1))
    module.child = nn.BatchNorm1d(2)  # its own weight, bias and running_* must never show up
    module.register_buffer("running_mean", torch.zeros(1))
    module.register_buffer("running_var", torch.ones(1))
    module.register_buffer("count", torch.zeros(1))
    target = Target("f", "f", module)

    def pick(pattern: str, tensors: str = "parameters") -> list[str]:
        return [name for name, _ in select_params(target, pattern, "w", tensors)]

    assert pick("W*") == ["W2", "W"]
    assert pick("*") == ["W2", "b", "W"]  # recurse=False: not child.weight
    assert pick("[bW]") == ["b", "W"]
    assert pick("weight") == []
    assert pick("running_*", "buffers") == ["running_mean", "running_var"]
    assert pick("**") == ["W2", "b", "W"]  # ** matches dotted names, yet the child's tensors stay out
    assert pick("**", "buffers") == ["running_mean", "running_var", "count"]
    assert select_params(target, "W", "w")[0][1] is module.W


@pytest.mark.parametrize(
    ("pattern", "tensors", "message"),
    [
        ("child.weight", "parameters", "pick the submodule with `select`"),
        ("W", "grads", "tensors must be 'parameters' or 'buffers'"),
        ("W[", "parameters", "unclosed '['"),
    ],
)
def test_select_params_errors(pattern: str, tensors: str, message: str) -> None:
    target = Target("f", "f", nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"actions\.p\.param") as info:
        select_params(target, pattern, "actions.p.param", tensors)
    assert message in str(info.value)


# --- suggestions and helpers ------------------------------------------------


@pytest.mark.parametrize(
    ("wanted", "included"),
    [
        ("classifer", "classifier"),
        ("blocks.*.atn", "blocks.0.attn"),
        ("blocks.1?.attn", "blocks.10.attn"),
        ("blocks.**.mlp.fc3", "blocks.0.mlp.fc2"),
        ("head.fcc", "head.fc"),
    ],
)
def test_closest_names(wanted: str, included: str) -> None:
    suggestions = closest_names(wanted, NAMES)
    assert included in suggestions
    assert 0 < len(suggestions) <= 5


SUGGEST_FROM = [
    "<root>", "encoder", "encoder.layer.0", "encoder.layer.0.attn", "encoder.layer.1", "encoder.layer.1.attn",
    "decoder", "decoder.proj", "head",
]  # fmt: skip


@pytest.mark.parametrize(
    ("wanted", "n", "expected"),
    [
        # most similar first (difflib), then the names sharing the longest literal prefix, no repeats
        (
            "encoder.layer.0.atn",
            5,
            ["encoder.layer.0.attn", "encoder.layer.1.attn", "encoder.layer.0", "encoder.layer.1", "encoder"],
        ),
        # wildcards are dropped from the literal ('encoder.layer.atn'); equal scores come in difflib's order
        (
            "encoder.layer.*.atn",
            5,
            ["encoder.layer.1.attn", "encoder.layer.0.attn", "encoder.layer.1", "encoder.layer.0", "encoder"],
        ),
        ("encoder.layer.*.atn", 2, ["encoder.layer.1.attn", "encoder.layer.0.attn"]),
        (
            "encoder..layer",
            5,
            ["encoder.layer.1", "encoder.layer.0", "encoder.layer.1.attn", "encoder.layer.0.attn", "encoder"],
        ),
        ("decodr.proj", 5, ["decoder.proj", "decoder", "encoder", "encoder.layer.1", "encoder.layer.0"]),
        # nothing similar enough (ratio < 0.5) but a shared prefix: only those names
        ("head.fc", 5, ["head"]),
        (".head.", 5, ["head"]),
        # the prefix stops at the first wildcard; names sharing it, in model order, up to n
        ("enc*", 3, ["encoder", "encoder.layer.0", "encoder.layer.0.attn"]),
        ("decoder.*.x", 5, ["decoder", "decoder.proj", "encoder", "encoder.layer.1", "encoder.layer.0"]),
        # nothing similar and no prefix: names whose last segments are alike (issue 28), else the first n names
        ("**.attn", 5, ["encoder.layer.0.attn", "encoder.layer.1.attn", "head", "<root>", "encoder"]),
        ("zzz", 3, ["<root>", "encoder", "encoder.layer.0"]),
        # dots left at either end or doubled by a dropped wildcard would push the ratio below 0.5
        ("proj.", 5, ["decoder.proj"]),
        (".*.proj", 5, ["decoder.proj"]),
        (".head.*.decoder", 5, ["decoder", "encoder", "decoder.proj", "head"]),
        # only dots are stripped from the literal's ends ('proj.X' is not similar enough to anything)
        ("proj.X", 5, ["<root>", "encoder", "encoder.layer.0", "encoder.layer.0.attn", "encoder.layer.1"]),
    ],
)
def test_closest_names_ranking(wanted: str, n: int, expected: list[str]) -> None:
    assert closest_names(wanted, SUGGEST_FROM, n) == expected


def test_closest_names_never_empty() -> None:
    assert closest_names("zzz", NAMES, n=3) == NAMES[:3]
    assert closest_names("*", NAMES, n=2) == NAMES[:2]
    assert closest_names("x", []) == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("a.*", ["a.*"]), (["a", "b"], ["a", "b"]), (("a",), ["a"])],
)
def test_as_list(value: object, expected: list[str] | None) -> None:
    assert as_list(value) == expected  # type: ignore[arg-type]


def test_module_index_walks_like_named_modules() -> None:
    """Same order, each shared module once (first place it appears), None children skipped."""
    shared = nn.Linear(2, 2)
    net = nn.Sequential(nn.Sequential(shared, nn.ReLU()), shared, nn.ModuleDict({"b": nn.Tanh(), "a": shared}))
    net.register_module("empty", None)
    index = ModuleIndex.of(net)
    assert index.real_names == [name for name, _ in net.named_modules()] == ["", "0", "0.0", "0.1", "2", "2.b"]
    assert all(a is b for a, b in zip(index.modules, net.modules(), strict=True))
    assert index.names[0] == ROOT and index.classes[2] is nn.Linear


def test_index_selection_equals_one_glob_test_per_target() -> None:
    targets = module_targets(tiny_net())
    index = ModuleIndex.from_targets(targets)
    cases = [(["block*"], None, None), (None, ["Conv2d"], None), (["**"], ["Conv2d", "Linear"], ["block1.*"])]
    for select, types, exclude in cases:
        plain = [
            t
            for t in targets
            if (select is None or compile_globs(select, "w")(t.name))
            and (types is None or type_matcher(types, "w")(type(t.module)))
            and not (exclude and compile_globs(exclude, "w")(t.name))
        ]
        assert plain and index.select(select, types, exclude, "w") == plain


FSDPModule = type("FSDPModule", (), {})  # stands in for torch.distributed.fsdp.FSDPModule (matched by name)


@pytest.mark.parametrize(
    ("cls", "original"),
    [
        (type("FSDPLinear", (FSDPModule, nn.Linear), {}), nn.Linear),  # what fully_shard makes of a Linear
        (type("FSDPLinear", (nn.Linear, FSDPModule), {}), None),  # FSDPModule not first: not fully_shard's
        (type("FSDPConv", (FSDPModule, nn.Linear), {}), None),  # the name does not follow the base
        (type("Mixed", (nn.ReLU, nn.Linear), {}), None),  # two bases, nothing to do with FSDP
        (type("FSDPLinear", (FSDPModule, nn.Linear, nn.ReLU), {}), None),  # three bases
        (nn.Linear, None),
    ],
)
def test_original_class_sees_through_fully_shards_renamed_class_only(cls: type, original: type | None) -> None:
    assert original_class(cls) is (original or cls)
