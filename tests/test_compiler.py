"""What compiling a plan shows a user, pinned exactly: the plan table, ``to_dict``, warnings, no-match errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn import init

import surgery
from surgery.actions.base import KINDS
from surgery.core.compiler import compile_plan
from surgery.core.paths import config_dir
from surgery.errors import ConfigError, NoMatchError
from tests.conftest import TinyNet


class Blocks(nn.Module):
    """``blocks.0`` … ``blocks.{n-1}``: a repeated structure of Linear layers."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Swap(nn.Module):
    """A replacement with children of its own, so the plan must list them under the replaced name."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.inner(x))


class Doubler(nn.Module):
    """A module outside the safe-mode allowlist: replacing with it works unless safe=true."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        self.head = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


class Masked(nn.Module):
    """A forward that needs a keyword input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * mask


def zoo() -> nn.Module:
    """A root with 21 children of 21 distinct classes (Kind00 … Kind20): longer than any type list shown."""
    root = nn.Module()
    for i in range(21):
        root.add_module(f"m{i:02d}", type(f"Kind{i:02d}", (nn.Identity,), {})())
    return root


def generator(seed: int, action: str) -> torch.Generator:
    """The documented rule: a generator seeded from sha256 of "seed/action"."""
    digest = hashlib.sha256(f"{seed}/{action}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def message(model: nn.Module, action: dict, **options: object) -> str:
    with pytest.raises((ConfigError, NoMatchError)) as info:
        compile_plan(model, {"a": action}, **options)  # type: ignore[arg-type]
    return str(info.value)


# --- the plan table (mode=plan prints it) and to_dict (report.json) ---------------------------------


def test_plan_table_is_exact() -> None:
    model = Blocks(7)
    plan = surgery.plan(model, {
        "all": {"kind": "capture", "select": "blocks.*"},
        "six": {"kind": "capture", "select": "blocks.[0-5]"},
        "off": {"kind": "modify_output", "select": "blocks.0", "op": "add", "value": 1.0, "enabled": False},
        "none": {"kind": "capture", "select": "nothing*", "allow_empty": True},
        "root": {"kind": "capture", "select": "<root>"},
        "w": {"kind": "init", "select": "blocks.*", "param": "weight", "method": "ones"},
    })  # fmt: skip
    six = ", ".join(f"blocks.{i}" for i in range(6))
    weights = ", ".join(f"blocks.{i}.weight" for i in range(6))
    assert str(plan).split("\n") == [
        "action  kind           mechanism     n  matched",
        "-" * 100,  # the widest line (w's) is longer: the rule stops at 100
        f"all     capture        forward hook  7  {six}, … (+1 more)",
        f"six     capture        forward hook  6  {six}",
        "off     modify_output  (disabled)    1  blocks.0",
        "none    capture        forward hook  0  -",
        "root    capture        forward hook  1  <root>",
        f"w       init           apply pass    7  {weights}, … (+1 more)",
        "warning: actions.six: matches 6 of the 7 modules like 'blocks.*'; not blocks.6. Intended?",
    ]


def test_plan_table_rule_spans_a_narrow_table_and_names_the_real_module() -> None:
    outer = nn.Module()
    outer.add_module("_orig_mod", TinyNet())  # as torch.compile wraps a model: the plan uses the bare names
    plan = surgery.plan(outer, {"c": {"kind": "capture", "select": ["<root>", "fc"]}})
    row = "c       capture  forward hook  2  <root> [_orig_mod], fc [_orig_mod.fc]"
    assert str(plan) == "\n".join(["action  kind     mechanism     n  matched", "-" * len(row), row])
    assert plan.to_dict() == [{
        "action": "c", "kind": "capture", "mechanism": "forward hook", "enabled": True,
        "matched": ["<root>", "fc"], "matched_real": ["_orig_mod", "_orig_mod.fc"], "tensors": [],
    }]  # fmt: skip


def test_to_dict_lists_every_action_disabled_ones_included() -> None:
    model = TinyNet()
    plan = surgery.plan(model, {
        "skipped": None,  # an empty entry (e.g. a recipe key set to null) is left out, not the end of the list
        "off": {"kind": "capture", "select": "fc", "enabled": False},
        "w": {"kind": "init", "select": "fc", "param": "weight", "method": "zeros"},
    })  # fmt: skip
    assert plan.to_dict() == [
        {"action": "off", "kind": "capture", "mechanism": "forward hook", "enabled": False,
         "matched": ["fc"], "matched_real": ["fc"], "tensors": []},
        {"action": "w", "kind": "init", "mechanism": "apply pass", "enabled": True,
         "matched": ["fc"], "matched_real": ["fc"], "tensors": ["fc.weight"]},
    ]  # fmt: skip


def test_plan_keeps_its_settings() -> None:
    plan = surgery.plan(TinyNet(), {}, seed=7, strict=False, safe=True)
    assert (plan.seed, plan.strict, plan.safe, plan.steps) == (7, False, True, [])


def test_a_later_source_sees_a_disabled_capture_before_it() -> None:
    recipe = {
        "clean": {"kind": "capture", "select": "fc", "enabled": False},
        "patch": {"kind": "modify_output", "select": "fc", "op": "patch", "from": {"capture": "clean"}},
    }
    with pytest.raises(ConfigError) as info:
        surgery.plan(TinyNet(), recipe)
    assert str(info.value) == (
        "actions.patch.from.capture: capture 'clean' is disabled (enabled: false), so it records nothing"
    )


# --- compile_plan's defaults and options, seen through apply -------------------------------------


def test_apply_without_a_seed_draws_from_seed_0_and_a_given_seed_reaches_the_action() -> None:
    action = {"a": {"kind": "init", "select": "fc", "param": "weight", "method": "normal"}}
    for seed, options in ((0, {}), (5, {"seed": 5})):
        model = TinyNet()
        with surgery.apply(model, action, **options):
            got = model.fc.weight.detach().clone()
        expected = torch.full((3, 16), 7.0)
        init.normal_(expected, 0.0, 1.0, generator=generator(seed, "a"))
        assert torch.equal(got, expected), seed


def test_apply_without_safe_builds_a_module_from_outside_the_allowlist() -> None:
    model = TinyNet()
    x = torch.randn(2, 1, 4, 4)
    with torch.no_grad():
        expected = model.fc(model.pool(model.norm(model.conv(x)) * 2).flatten(1))
        with surgery.apply(model, {"a": {"kind": "replace_module", "select": "act",
                                         "with": {"_target_": "tests.test_compiler.Doubler"}}}):  # fmt: skip
            assert torch.equal(model(x), expected)


def test_capture_size_is_checked_over_one_batch_unless_told_more() -> None:
    model, x = TinyNet(), torch.randn(4, 1, 4, 4)  # conv output: 4 x 4 x 4 x 4 float32 = 1024 bytes a batch
    capture = {"kind": "capture", "select": "conv", "max_bytes": 1024}
    surgery.apply(model, {"a": capture}, example_inputs=(x,)).remove()  # one batch fits exactly
    assert message(model, {**capture, "max_bytes": 3071}, example_inputs=(x,), batches=3) == (
        "actions.a.max_bytes: the capture would hold about 3.0 KiB over 3 batch(es) (1.0 KiB a batch),"
        " more than max_bytes=3071; use to: disk, reduce: mean|stats, or select fewer modules"
    )


def test_example_kwargs_reach_the_probe_forward() -> None:
    x, mask = torch.randn(8, 4), torch.ones(8, 4)  # 128 bytes each
    capture = {"kind": "capture", "select": "<root>", "what": ["input"], "max_bytes": 256}
    surgery.plan(Masked(), {"a": capture}, example_inputs=(x,), example_kwargs={"mask": mask})
    text = message(Masked(), {**capture, "max_bytes": 255}, example_inputs=(x,), example_kwargs={"mask": mask})
    assert text.startswith("actions.a.max_bytes: the capture would hold about 0.2 KiB over 1 batch(es)"), text


def test_replaced_modules_are_what_later_actions_and_plan_targets_see() -> None:
    model = TwoStage()
    plan = surgery.plan(model, {
        "swap": {"kind": "replace_module", "select": "block", "with": {"_target_": "tests.test_compiler.Swap"}},
        "c": {"kind": "capture", "select": "block.*"},
    })  # fmt: skip
    assert [(t.name, t.real_name, type(t.module).__name__) for t in plan.targets] == [
        ("<root>", "", "TwoStage"),
        ("block", "block", "Swap"),
        ("block.inner", "block.inner", "Linear"),
        ("block.act", "block.act", "Tanh"),
        ("head", "head", "Linear"),
    ]
    assert plan.to_dict()[1]["matched"] == ["block.inner", "block.act"]
    assert type(model.block).__name__ == "Sequential"  # planning changed nothing


def test_plan_errors_name_the_problem_exactly(tmp_path: Path) -> None:
    assert message(3, {}) == "model: expected a torch.nn.Module, got int; pass the torch module it wraps"  # type: ignore[arg-type]
    assert message(TinyNet(), {"select": "fc"}) == (
        f"actions.a.kind: every action needs a kind; kinds: {', '.join(KINDS.names())}"
    )
    assert ", log, replace_forward, " in message(TinyNet(), {"select": "fc"})
    for missing in (tmp_path / "missing.yaml", tmp_path / "missing.yml"):  # a YAML path is a path, not a name
        with pytest.raises(ConfigError) as info:
            surgery.plan(TinyNet(), missing)
        assert str(info.value) == f"actions: file {str(missing)!r} does not exist"
    text_file = tmp_path / "recipe.txt"  # an existing file is read as YAML whatever its suffix
    text_file.write_text("a: {kind: capture, select: fc}\n")
    assert [s.name for s in surgery.plan(TinyNet(), text_file).steps] == ["a"]


# --- no-match errors -------------------------------------------------------------------------------

NO_MATCH = [
    (TinyNet, {"select": "fcc", "exclude": "conv"},
     "actions.a.select: 'fcc' matched no module. Closest module names: fc. Set allow_empty: true if that is expected."),
    (TinyNet, {"select": ["fcc", "convv"]},
     "actions.a.select: 'fcc', 'convv' matched no module. Closest module names: fc."
     " Set allow_empty: true if that is expected."),
    (TinyNet, {"select": "conv", "type": "Linear", "exclude": "fc"},
     "actions.a.type: 'Linear' matched none of the 1 module(s) selected by 'conv'; their types are: Conv2d."),
    (TinyNet, {"select": "*", "type": "Embedding", "exclude": "fc"},
     "actions.a.type: 'Embedding' matched none of the 4 module(s) selected by '*';"
     " their types are: AdaptiveAvgPool2d, BatchNorm2d, Conv2d, ReLU."),
    (TinyNet, {"select": "fc", "exclude": "fc"},
     "actions.a.exclude: 'fc' removed every module the selector matched (fc)"),
    (TinyNet, {"select": "*", "type": "Linear", "exclude": "fc"},
     "actions.a.exclude: 'fc' removed every module the selector matched (fc)"),
    (lambda: Blocks(6), {"select": "blocks.*", "exclude": "blocks.*"},
     "actions.a.exclude: 'blocks.*' removed every module the selector matched"
     " (blocks.0, blocks.1, blocks.2, blocks.3, blocks.4, blocks.5)"),
    (lambda: Blocks(7), {"select": "blocks.*", "exclude": "blocks.*"},
     "actions.a.exclude: 'blocks.*' removed every module the selector matched"
     " (blocks.0, blocks.1, blocks.2, blocks.3, blocks.4, blocks.5 …)"),
    (zoo, {"select": "*", "type": "Embedding"},
     "actions.a.type: 'Embedding' matched none of the 21 module(s) selected by '*'; their types are: "
     + ", ".join(f"Kind{i:02d}" for i in range(12)) + "."),
    (zoo, {"type": "Kind2"},
     "actions.a.type: 'Kind2' matched no module. Did you mean 'Kind20' or 'Kind12' or 'Kind02'? Types in this model: "
     + ", ".join(f"Kind{i:02d}" for i in range(20)) + ". Set allow_empty: true if that is expected."),
]  # fmt: skip


@pytest.mark.parametrize(("make", "selector", "expected"), NO_MATCH)
def test_no_match_message(make, selector: dict, expected: str) -> None:
    assert message(make(), {"kind": "capture", **selector}) == expected


# --- warnings: hooks sharing a module, partly matched repeated structures ----------------------------


def add(select: str, **more: object) -> dict:
    return {"kind": "modify_output", "select": select, "op": "add", "value": 1.0, **more}


@pytest.mark.parametrize(("n", "expected_more"), [(5, []), (6, ["… and 1 more modules with several actions"]),
                                                  (7, ["… and 2 more modules with several actions"])])  # fmt: skip
def test_overlap_warning_lists_five_modules_then_counts(n: int, expected_more: list[str]) -> None:
    plan = surgery.plan(Blocks(n), {"a": add("blocks.*"), "b": add("blocks.*")})
    assert plan.warnings == [f"blocks.{i}: a → b (hooks run in this order)" for i in range(5)] + expected_more


def test_overlap_warning_only_where_call_hooks_could_disagree() -> None:
    model = TinyNet()
    quiet = {
        "one changing hook": {"a": add("fc")},
        "observers only": {"a": {"kind": "capture", "select": "fc"}, "b": {"kind": "log", "select": "fc"}},
        "a disabled one": {"a": add("fc", enabled=False), "b": add("fc")},
        "an apply pass": {"a": {"kind": "init", "select": "fc", "param": "weight", "method": "ones"}, "b": add("fc")},
        "a state-dict hook": {"a": {"kind": "on_load", "rename": {"old.*": "fc.*"}}, "b": add("<root>")},
    }
    for case, recipe in quiet.items():
        assert surgery.plan(model, recipe).warnings == [], case
    loud = surgery.plan(model, {"a": {"kind": "capture", "select": "fc"}, "b": add("fc"), "c": add("fc")})
    assert loud.warnings == ["fc: a → b → c (hooks run in this order)"]


@pytest.mark.parametrize(("n", "select", "expected"), [
    (3, "blocks.[01]", ["actions.a: matches 2 of the 3 modules like 'blocks.*'; not blocks.2. Intended?"]),
    (6, "blocks.[01]", []),  # a third is not most
    (8, "blocks.[0-3]",
     ["actions.a: matches 4 of the 8 modules like 'blocks.*'; not blocks.4, blocks.5, blocks.6, blocks.7. Intended?"]),
    (10, "blocks.[0-4]",
     ["actions.a: matches 5 of the 10 modules like 'blocks.*';"
      " not blocks.5, blocks.6, blocks.7, blocks.8 …. Intended?"]),
    (2, "blocks.0", []),  # two alike are not yet a repeated structure
])  # fmt: skip
def test_partial_structure_warning(n: int, select: str, expected: list[str]) -> None:
    assert surgery.plan(Blocks(n), {"a": {"kind": "capture", "select": select}}).warnings == expected


@pytest.mark.parametrize("odd", ["odd\nname", "a\nb\nc", "odd name"])
def test_partial_structure_warning_with_odd_module_names(odd: str) -> None:
    """Names may hold a newline or a space (PyTorch allows it); the structure is still found."""
    model = nn.Module()
    model.add_module(odd, nn.Identity())  # first, so a misaligned shape would shift every block's
    model.add_module("blocks", nn.ModuleList(nn.Linear(2, 2) for _ in range(4)))
    plan = surgery.plan(model, {"a": {"kind": "capture", "select": "blocks.[0-2]"}})
    assert plan.warnings == ["actions.a: matches 3 of the 4 modules like 'blocks.*'; not blocks.3. Intended?"]


def test_actions_by_name_interpolated_or_of_the_wrong_type() -> None:
    names = sorted(p.stem for p in (config_dir() / "actions").glob("*.yaml"))
    assert "linearize" in names
    with pytest.raises(ConfigError) as info:
        surgery.plan(TinyNet(), "linearise")
    assert str(info.value).startswith("actions: no actions file named 'linearise'. Did you mean 'linearize'")
    assert str(info.value).endswith(f" Available: {', '.join(names)}; or give a path to a YAML file.")
    assert info.value.options == tuple(names)  # the CLI offers these
    recipe = OmegaConf.create({"a": {"kind": "capture", "select": "fc"}, "b": {"kind": "log", "select": "${a.select}"}})
    assert surgery.plan(TinyNet(), recipe).to_dict()[1]["matched"] == ["fc"]
    with pytest.raises(ConfigError) as info:
        surgery.plan(TinyNet(), ["a"])
    assert str(info.value) == "actions: expected a mapping of named actions, got list"


def test_a_config_differing_only_in_its_select_text_is_the_same_config_with_that_text() -> None:
    """``Shared`` reuses a validated config for another select text (a study's layers): equal to validating anew."""
    from surgery.core.compiler import Shared, load_actions
    from surgery.core.schema import validate

    checked = 0
    for path in sorted((config_dir() / "actions").glob("*.yaml")):
        for name, node in load_actions(path).items():
            kind = KINDS.get(str(node["kind"]), "kind")()
            shared, where = Shared(), f"actions.{name}"
            try:
                first = shared.validated(kind, {**node, "select": "blocks.0"}, where)
            except ConfigError:  # keys a selector rewrite turns into an action first (logit_lens's lens)
                continue
            for select in ("blocks.1", "other.*"):
                again = shared.validated(kind, {**node, "select": select}, where)
                assert again == validate(kind.schema, {**node, "select": select}, where), (path.name, name)
                assert again.select == select and first.select == "blocks.0"
                checked += 1
            for odd in ("???", "${x}"):  # texts OmegaConf reads its own way: validated anew, never copied
                assert _outcome(shared.validated, kind, {**node, "select": odd}, where) == _outcome(
                    lambda k, n, w: validate(k.schema, n, w), kind, {**node, "select": odd}, where
                )
    assert checked >= 30


def _outcome(validated, kind, node, where):
    """A config, or the message it was refused with."""
    try:
        return validated(kind, node, where)
    except ConfigError as e:
        return str(e)
