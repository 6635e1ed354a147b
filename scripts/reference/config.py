"""docs/config.md: run settings, the keys every action has, each action kind, and the config groups."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from surgery.actions import KINDS
from surgery.core import schema
from surgery.core.paths import config_dir, group_options

GROUPS = ("model", "actions", "input", "experiment")
RUN_CHOICES = {"mode": schema.MODES, "loss": schema.LOSSES, "dtype": schema.DTYPES}
# A field line of a dataclass body, `    name: type = default  # comment`; methods are indented deeper.
FIELD_COMMENT = re.compile(r"^    (\w+):[^#\n]*#\s*(.*)$", re.MULTILINE)


def line_comments(cls: type) -> dict[str, str]:
    """The trailing comment of each field line of ``cls`` and its dataclass bases; the nearest class wins."""
    comments: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            comments.update(FIELD_COMMENT.findall(inspect.getsource(base)))
    return comments


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value, calling its factory; MISSING when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING


def yaml_text(value: Any) -> str:
    """A value as it would be written in a YAML config."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    return str(value)


def field_rows(cls: type, skip: frozenset[str] = frozenset(), prefix: str = "", values: Any = None) -> list[list[str]]:
    """(key, type, default, comment) per field of a dataclass; a nested dataclass becomes ``key.field`` rows."""
    comments = line_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        value = default_of(f) if values is None else getattr(values, f.name)
        if dataclasses.is_dataclass(value):
            rows += field_rows(type(value), prefix=f"{prefix}{f.name}.", values=value)
            continue
        default = "required" if value == MISSING else f"`{yaml_text(value)}`"
        rows.append([f"`{prefix}{f.name}`", f"`{f.type}`", default, comments.get(f.name, "")])
    return rows


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; pipes inside cells are escaped."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", r"\|") for cell in row) + " |" for row in rows]
    return lines


def choices(key: str, values: tuple[str, ...]) -> str:
    """One line naming the values ``key`` accepts."""
    return f"- `{key}`: one of " + ", ".join(f"`{v}`" for v in values)


def description(path: Path) -> str:
    """The leading comment block of a YAML file, as one line (``# @package`` directives skipped)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def first_paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring on one line, with reST ``code`` as Markdown `code`."""
    text = inspect.cleandoc(doc or "").split("\n\n")[0]
    return " ".join(text.split()).replace("``", "`")


def run_settings() -> list[str]:
    """The run settings section."""
    return [
        "## Run settings",
        "",
        "Top-level keys of `conf/config.yaml`; override any of them on the command line, e.g. `mode=plan`.",
        "",
        *table(["key", "type", "default", "meaning"], field_rows(schema.RunSettings)),
        "",
        "Allowed values:",
        "",
        *(choices(key, values) for key, values in RUN_CHOICES.items()),
        "",
    ]


def common_keys() -> list[str]:
    """The keys every action has."""
    return [
        "## Keys every action has",
        "",
        "An actions file (`conf/actions/NAME.yaml`) maps action names to actions, applied in order.",
        "",
        *table(["key", "type", "default", "meaning"], field_rows(schema.Action)),
        "",
    ]


def study_keys() -> list[str]:
    """The keys of a ``study:`` block: a grid study's, and a circuit study's (``method: edges | eap | eap_ig``)."""
    from surgery.circuit.config import CircuitConfig
    from surgery.study.config import StudyConfig

    return [
        "## Study keys",
        "",
        "A `study:` block (or `+study=NAME`, `conf/study/`) scores a grid of interventions per example",
        "([studies.md](studies.md)):",
        "",
        *table(["key", "type", "default", "meaning"], field_rows(StudyConfig)),
        "",
        "### Circuit studies",
        "",
        "With `method: edges`, `eap` or `eap_ig` the block scores every edge between components instead",
        "([circuits.md](circuits.md)); it takes no `grid` and no actions:",
        "",
        *table(["key", "type", "default", "meaning"], field_rows(CircuitConfig)),
        "",
    ]


def kinds() -> list[str]:
    """A summary of the action kinds, then one section per kind with its own keys."""
    common = frozenset(f.name for f in dataclasses.fields(schema.Action))
    summary = [[f"[`{name}`](#{name})", KINDS.get(name).mechanism] for name in KINDS.names()]
    lines = ["## Action kinds", "", *table(["kind", "PyTorch mechanism"], summary), ""]
    for name in KINDS.names():
        kind = KINDS.get(name)
        if not kind.__doc__:
            raise ValueError(f"action kind {name!r} ({kind.__qualname__}) has no docstring")
        rows = field_rows(kind.schema, skip=common)
        lines += [f"### `{name}`", "", first_paragraph(kind.__doc__), ""]
        home = "surgery.core.schema" if hasattr(schema, kind.schema.__name__) else kind.schema.__module__
        lines += [f"Mechanism: {kind.mechanism}. Schema: `{home}.{kind.schema.__name__}`.", ""]
        lines += [*table(["key", "type", "default", "meaning"], rows), ""] if rows else ["No keys of its own.", ""]
        if kind.choices is not None:  # the kind's own trait: its key with a closed set of values
            key, values = kind.choices
            if f"`{key}`" not in [row[0] for row in rows]:
                raise ValueError(f"kind {name!r}: choices names key {key!r}, which its schema does not have")
            lines += [choices(key, values), ""]
    return lines


def model_keys() -> list[str]:
    """The keys of a model config: surgery's own, then the shipped model configs' constructor arguments."""
    from surgery.app.build import MODEL_KEYS

    lines = [
        "## Model configs",
        "",
        "A model config (`conf/model/NAME.yaml`, or your own) names what builds the model; surgery reads these keys:",
        "",
        *table(["key", "meaning"], [[f"`{k}`", v] for k, v in MODEL_KEYS.items()]),
        "",
        "Every other key is passed to `_target_` as a keyword argument (a required one is `???`,"
        " given on the command line, e.g. `model.path=DIR`). The shipped configs' arguments:",
        "",
    ]
    rows = []
    for option in group_options("model"):
        path = config_dir() / "model" / f"{option}.yaml"
        node = OmegaConf.load(path)
        keys = [f"`{k}`" for k in map(str, node) if k not in MODEL_KEYS]
        rows.append([f"`{option}`", f"`{node.get('_target_')}`", ", ".join(keys) or "-"])
    lines += [*table(["option", "_target_", "arguments"], rows), ""]
    return lines


def input_keys() -> list[str]:
    """The input kinds and the keys each takes (``surgery.app.inputs.INPUT_KINDS``)."""
    from surgery.app.inputs import INPUT_KINDS, KEY_MEANINGS
    from surgery.data.loader import DatasetInput

    dataset = line_comments(DatasetInput)
    lines = [
        "## Input keys",
        "",
        "The run's `input` (`+input=KIND`, or `input.KEY=VALUE` over the model's defaults) and a model config's"
        " `input`; `kind` picks what the other keys mean. Keys of each kind:",
        "",
    ]
    for kind, keys in INPUT_KINDS.items():
        meanings = {**KEY_MEANINGS, **dataset} if kind == "dataset" else KEY_MEANINGS
        rows = [[f"`{key}`", meanings.get(key, "") if key != "kind" else f"`{kind}`"] for key in keys]
        lines += [f"### `kind: {kind}`", "", *table(["key", "meaning"], rows), ""]
    return lines


def config_groups() -> list[str]:
    """The options of each config group with the description at the top of its file."""
    lines = ["## Config groups", "", "Choose one option of a group with `+GROUP=NAME`, e.g. `+model=cnn`.", ""]
    for group in GROUPS:
        options = group_options(group)
        rows = [[f"`{option}`", description(config_dir() / group / f"{option}.yaml")] for option in options]
        lines += [f"### `{group}`", ""]
        lines += [*table(["option", "description"], rows), ""] if rows else ["No options yet.", ""]
    return lines


def render() -> str:
    """The whole reference as Markdown."""
    header = [
        "# Config reference",
        "",
        "Generated from the code by `python scripts/gen_reference.py`: do not edit by hand.",
        "",
    ]
    sections = run_settings() + model_keys() + input_keys() + study_keys() + common_keys() + kinds() + config_groups()
    return "\n".join(header + sections).rstrip() + "\n"
