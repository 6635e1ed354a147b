"""Every YAML example in README.md and docs/*.md runs: action mappings plan and run a forward on a built-in model.

A block is planned on the first built-in model that has every ``type`` it names (``<!-- model: NAME -->`` on
the line before the block picks one). docs/errors.md shows mistakes: each of its blocks must be refused with the
message quoted after it. Blocks that are not action mappings are listed in NOT_ACTIONS with why.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

import surgery
from surgery.app.report import first_tensor
from surgery.errors import SurgeryError
from tests.exact_runs import job_of

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = r"(?:^[ \t]*<!--\s*model:\s*(?P<model>\w+)\s*-->\n)?"  # <!-- model: NAME --> right before the block
BLOCK = re.compile(MARKER + r"^(?P<indent>[ \t]*)```ya?ml\n(?P<body>.*?)^[ \t]*```", re.S | re.M)
MODELS = ["cnn", "mlp", "functions", "gpt2_tiny", "bert_tiny"]
NOT_ACTIONS = {  # (file, first line of the block) -> why it is not run here (or <!-- docs-test: skip WHY -->)
    ("sweeps.md", "# DIR/hydra/launcher/my_slurm.yaml"): "a Hydra launcher config for a Slurm cluster, none here",
    ("data.md", "input:"): "an input config (kind: dataset), not actions: tests/test_data*.py run it",
    ("training.md", "# configs/callbacks/surgery.yaml"): "a Lightning callback config: the integration tests run it",
    ("training.md", "# configs/callbacks/default.yaml"): "a Lightning callbacks defaults list",
    ("training.md", "surgery:"): "a Lightning callback config: the integration tests run it",
}
SKIP = re.compile(r"\s*<!--\s*docs-test:\s*skip\s+(.*?)\s*-->\s*")  # alone on the line before the block
GRAD_KINDS = {"modify_grad", "capture_grad"}


@dataclass
class Example:
    file: str
    line: int
    text: str
    model: str | None
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def examples() -> list[Example]:
    found = []
    for path in DOCS:
        source = path.read_text()
        for m in BLOCK.finditer(source):
            line = source.count("\n", 0, m.start("indent")) + 1
            above = source[: m.start("indent")].rstrip("\n").rpartition("\n")[2]  # the line before the block
            skip = SKIP.fullmatch(above)
            why = skip.group(1) if skip else None
            found.append(Example(path.name, line, textwrap.dedent(m.group("body")), m.group("model"), why))
    return found


EXAMPLES = examples()
ACTIONS = [e for e in EXAMPLES if e.file != "errors.md"]
MISTAKES = [e for e in EXAMPLES if e.file == "errors.md"]


# Examples that need something the block does not show. docs/expressions.md is generated (scripts/reference), so
# it carries no <!-- model: --> markers: its needs are written here, keyed by action name.
COMPANIONS = {  # the action the example's text says it builds on (README.md's seeds' exercise)
    "linear": {"add_b": {"kind": "add_parameter", "type": "Function_*", "name": "b", "shape": [1],
                         "init": {"method": "constant", "value": 1.0}}},
}  # fmt: skip
MODEL_OF = {"residual": "square", "leaky": "square"}  # square Linears ("of the same size"), and an nn.GELU


def square() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Not a built-in: Linear 8 -> 8, GELU, LayerNorm, Linear 8 -> 8 (no built-in has nn.GELU or square Linears)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 8)).eval()
    return model, (torch.randn(2, 8, generator=torch.Generator().manual_seed(1)),)


@cache
def built(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A model and its inputs, as the CLI builds them (built once; surgeries are removed after use)."""
    return square() if name == "square" else job_of(f"+model={name}")


def named_types(action: dict[str, Any]) -> set[str]:
    types = action.get("type") or []
    return {types} if isinstance(types, str) else set(types)


def model_for(example: Example, name: str, action: dict[str, Any]) -> str:
    """The marker's model, else MODEL_OF, else the first built-in with every type the action names."""
    if example.model or name in MODEL_OF:
        return example.model or MODEL_OF[name]
    wanted = named_types(action)
    for model in MODELS:
        types = {type(m).__name__ for m in built(model)[0].modules()}
        if all(any(re.fullmatch(w.replace("*", ".*"), t) for t in types) for w in wanted):
            return model
    raise AssertionError(f"{example.id}: no built-in model has {sorted(wanted)}; mark it <!-- model: NAME -->")


def test_examples_are_found() -> None:
    assert len(ACTIONS) >= 10 and len(MISTAKES) >= 10
    assert {e.file for e in EXAMPLES} >= {"README.md", "expressions.md", "errors.md"}


@pytest.mark.parametrize("example", ACTIONS, ids=[e.id for e in ACTIONS])
def test_action_examples_plan_and_run(example: Example) -> None:
    first = example.text.strip().splitlines()[0]
    if (example.file, first) in NOT_ACTIONS:
        pytest.skip(NOT_ACTIONS[example.file, first])
    if example.skip:
        pytest.skip(example.skip)
    loaded = yaml.safe_load(example.text)
    assert isinstance(loaded, dict) and all(isinstance(a, dict) and "kind" in a for a in loaded.values()), (
        f"{example.id}: not a mapping of actions; run it here or list it in NOT_ACTIONS with why"
    )
    groups: dict[str, dict[str, Any]] = {}  # a block may show actions for different models
    for name, action in loaded.items():
        group = groups.setdefault(model_for(example, name, action), {})
        group.update({k: v for k, v in COMPANIONS.get(name, {}).items() if k not in loaded})
        group[name] = action
    for model_name, actions in groups.items():
        run_on(model_name, actions)


def run_on(model_name: str, actions: dict[str, Any]) -> None:
    """Plan on the model, run a forward (and a backward for gradient kinds), remove."""
    model, inputs = built(model_name)
    backward = any(a["kind"] in GRAD_KINDS for a in actions.values())
    with surgery.apply(model, actions) as s:
        assert [step.name for step in s.plan.steps] == list(actions)
        ins = tuple(x.detach().requires_grad_(backward and x.is_floating_point()) for x in inputs)
        out = first_tensor(model(*ins))
        assert torch.isfinite(out).all(), model_name
        if backward:
            out.float().sum().backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("example", MISTAKES, ids=[e.id for e in MISTAKES])
def test_error_examples_are_refused_with_the_message_quoted_after_them(example: Example) -> None:
    source = (REPO / "docs" / example.file).read_text()
    after = source.split(example.text, 1)[1]
    quoted = re.search(r"```text\nerror: (.*?)\n", after)
    assert quoted, f"{example.id}: no quoted error follows"
    model, inputs = built(example.model or "cnn")
    with pytest.raises(SurgeryError) as info, surgery.apply(model, yaml.safe_load(example.text)):
        model(*inputs)  # most are refused when planned; a few (an expression too big) only when run
    assert str(info.value) == quoted.group(1)


# on_load rename rules quoted inline in docs/behaviour.md: (module path in the checkpoint, the same in the model)
RENAME_EXAMPLES = {
    '{"module.**": "**"}': ("module.enc.lin", "enc.lin"),
    '{"blocks.*.attn.*": "layers.*.attention.*"}': ("blocks.0.attn", "layers.0.attention"),
}


def nested(path: str, seed: int) -> nn.Module:
    """A tree of ModuleDicts with a Linear(2, 2) at ``path``."""
    torch.manual_seed(seed)
    module: nn.Module = nn.Linear(2, 2)
    for part in reversed(path.split(".")):
        module = nn.ModuleDict({part: module})
    return module


def test_the_rename_rules_quoted_in_behaviour_md_are_the_ones_tested() -> None:
    text = (REPO / "docs" / "behaviour.md").read_text()
    quoted = set(re.findall(r'`(\{"[^`]*"\})`', text))
    assert quoted == set(RENAME_EXAMPLES)


@pytest.mark.parametrize("rule", sorted(RENAME_EXAMPLES))
def test_the_rename_rules_quoted_in_behaviour_md_load_a_checkpoint(rule: str) -> None:
    old_path, new_path = RENAME_EXAMPLES[rule]
    checkpoint = nested(old_path, seed=1).state_dict()
    model = nested(new_path, seed=2)
    with surgery.apply(model, {"load": {"kind": "on_load", "rename": json.loads(rule)}}) as s:
        s.load_state_dict(checkpoint)  # strict
        got = model.state_dict()
        assert [k.replace(old_path, new_path, 1) for k in checkpoint] == list(got)
        assert all(torch.equal(got[k.replace(old_path, new_path, 1)], v) for k, v in checkpoint.items())
