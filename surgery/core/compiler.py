"""Compile an actions config against a model into a ``Plan``: validated steps bound to modules.

Nothing is touched here: every key, selector, parameter, shape and expression is checked
first, so that applying either succeeds as a whole or fails before the model changes.
Kinds come from ``surgery.core.steps.KINDS``, which ``surgery.actions`` fills when imported.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from surgery.core import plan_cache
from surgery.core.paths import config_dir, group_options
from surgery.core.plan_cache import plain
from surgery.core.plan_warnings import ddp_warnings, overlap_warnings, partial_structure_warnings
from surgery.core.schema import validate
from surgery.core.select import ModuleIndex, Target, as_list, closest_names
from surgery.core.steps import KINDS, BindContext, Step
from surgery.core.wrapped import inner_module
from surgery.errors import ConfigError, NoMatchError, did_you_mean
from surgery.files.gate import read_text

SHOWN = 6  # matched names shown per row of the plan table
SelectorRewrite = Callable[[nn.Module, ModuleIndex, dict[str, Any]], dict[str, Any]]
SELECTOR_REWRITES: list[SelectorRewrite] = []  # selectors the engine does not know; surgery.arch adds the @ sites
NO_MATCH_HINTS: list[Callable[[ModuleIndex, list[str], str], str]] = []  # more to say: the closest names, the pattern


def load_actions(actions: Any) -> dict[str, Any]:
    """Actions as a plain dict from a name in conf/actions, a YAML path, a dict or a DictConfig."""
    if isinstance(actions, (str, Path)):
        text = str(actions)
        path = Path(text)
        if not (path.suffix in (".yaml", ".yml") or path.exists()):
            path = config_dir() / "actions" / f"{text}.yaml"
            if not path.exists():
                options = group_options("actions")
                raise ConfigError(
                    f"actions: no actions file named {text!r}.{did_you_mean(text, options)}"
                    f" Available: {', '.join(options)}; or give a path to a YAML file.",
                    options=options,
                )
        elif not path.exists():
            raise ConfigError(f"actions: file {text!r} does not exist")
        actions = _read_recipe(path)
    if isinstance(actions, DictConfig):
        actions = OmegaConf.to_container(actions, resolve=True)
    if actions is None:
        return {}
    if not isinstance(actions, Mapping):
        raise ConfigError(f"actions: expected a mapping of named actions, got {type(actions).__name__}")
    return dict(actions)


_PARSED: dict[str, Any] = {}  # a recipe file's text -> its actions
_PARSED_SIZE = 32


def _read_recipe(path: Path) -> Any:
    """A recipe file's actions as plain data (a copy each time: callers own it). The file is read every time
    (through the gate), so an edit is always seen, however soon after the last read and whatever the file's
    times say; only the YAML parse is kept, per distinct text. A text with interpolations (``${...}``) is
    parsed and resolved every time: its values may change."""
    text = read_text(path, "actions")
    if "${" in text:
        return OmegaConf.create(text)
    if text not in _PARSED:
        while len(_PARSED) >= _PARSED_SIZE:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[text] = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    return copy.deepcopy(_PARSED[text])


@dataclass
class Plan:
    """Validated steps bound to one model; ``str(plan)`` is a table, ``to_dict`` goes in reports."""

    model: nn.Module
    steps: list[Step]
    seed: int = 0
    strict: bool = True
    safe: bool = False
    index: ModuleIndex | None = field(default=None, repr=False)  # every module, after replacements
    specs: dict[str, Any] | None = field(default=None, repr=False)  # the actions as compiled (sites resolved)
    _warnings: list[str] | None = field(default=None, repr=False)

    @property
    def warnings(self) -> list[str]:
        """Overlaps and partly matched repeated structures; worked out when first read (big models)."""
        if self._warnings is None:
            index = self.index if self.index is not None else ModuleIndex.of(self.model)
            self._warnings = overlap_warnings(self.steps) + partial_structure_warnings(self.steps, index)
            self._warnings += ddp_warnings(self.model, self.steps)  # changes DDP cannot follow after wrapping
        return self._warnings

    @property
    def targets(self) -> list[Target]:
        """Every module of the model as the plan sees it (after replace_module steps)."""
        return (self.index if self.index is not None else ModuleIndex.of(self.model)).targets()

    def to_dict(self) -> list[dict[str, Any]]:
        """Per action: kind, mechanism, enabled, matched names (canonical and real), tensors."""
        return [
            {
                "action": s.name,
                "kind": s.kind,
                "mechanism": s.mechanism,
                "enabled": s.enabled,
                "matched": [t.name for t in s.targets],
                "matched_real": [t.real_name for t in s.targets],
                "tensors": s.tensors,
            }
            for s in self.steps
        ]

    def __str__(self) -> str:
        rows = [("action", "kind", "mechanism", "n", "matched")]
        for s in self.steps:
            names = s.tensors or [_shown(t) for t in s.targets]
            shown = ", ".join(names[:SHOWN]) + (f", … (+{len(names) - SHOWN} more)" if len(names) > SHOWN else "")
            mechanism = s.mechanism if s.enabled else "(disabled)"
            rows.append((s.name, s.kind, mechanism, str(len(names)), shown or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
        lines.insert(1, "-" * min(100, max(len(line) for line in lines)))
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def _shown(target: Target) -> str:
    real = target.real_name or "<root>"
    return target.name if real == target.name else f"{target.name} [{real}]"


def compile_plan(
    model: nn.Module,
    actions: Any,
    *,
    seed: int = 0,
    strict: bool = True,
    safe: bool = False,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    batches: int = 1,
    shared: Shared | None = None,
    reuse: bool = True,
) -> Plan:
    """Validate every action against its schema and the model; bind each to what it matched.

    With ``example_inputs`` the model runs once (hooks removed again) so that shapes an
    action needs, such as a patch's, and capture sizes against ``max_bytes`` (over
    ``batches`` batches) are checked before anything is applied. ``shared``: what plans of the same
    unmodified model can reuse (a study's cells): its module index, validated configs, selections.
    ``reuse``: return the plan compiled before for the same recipe on the same module tree
    (surgery/core/plan_cache.py says when); without example inputs or ``shared`` only.
    """
    model = inner_module(model)  # nnsight's NNsight(model): its inner module tree
    specs = load_actions(actions)
    key = None
    if reuse and shared is None and example_inputs is None and not example_kwargs:
        key = plan_cache.recipe_key(specs, seed, strict, safe)
    if key is None:
        return _compiled(model, specs, seed, strict, safe, example_inputs, example_kwargs, batches, shared)
    tree = plan_cache.tree_key(model)
    plan = plan_cache.found(model, key, tree)
    if plan is not None:
        return plan
    with plan_cache.watching() as outside:
        plan = _compiled(model, specs, seed, strict, safe, None, None, batches, None)
    if not outside:
        plan_cache.keep(model, key, tree, plan)
    return plan


def _compiled(
    model: nn.Module,
    specs: dict[str, Any],
    seed: int,
    strict: bool,
    safe: bool,
    example_inputs: tuple[Any, ...] | None,
    example_kwargs: dict[str, Any] | None,
    batches: int,
    shared: Shared | None,
) -> Plan:
    """``compile_plan`` itself, on the actions loaded."""
    index = shared.index_of(model) if shared is not None else ModuleIndex.of(model)
    plan = Plan(model, [], seed=seed, strict=strict, safe=safe)
    ctx_added: dict[int, Any] = {}
    flags: dict[int, bool] = {}  # shared by every action: what earlier ones add and freeze
    for rewrite in SELECTOR_REWRITES:  # e.g. "@mlp.3" becomes the real module names of this architecture
        specs = rewrite(model, index, specs)
    for name, node in specs.items():
        where = f"actions.{name}"
        if node is None:
            continue
        if not isinstance(node, Mapping):
            raise ConfigError(
                f"{where}: an action must be a mapping such as {{kind: capture, select: block1}}, got {node!r}"
            )
        if "kind" not in node:
            raise ConfigError(f"{where}.kind: every action needs a kind; kinds: {', '.join(KINDS.names())}")
        kind = KINDS.get(str(node["kind"]), f"{where}.kind")()
        cfg = shared.validated(kind, node, where) if shared is not None else validate(kind.schema, node, where)
        if getattr(cfg, "passes", "both") == "main" and kind.mechanism in ("apply pass", "state-dict hook"):
            raise ConfigError(
                f"{where}.passes: 'main' needs hooks that run in a pass; {kind.name} ({kind.mechanism}) changes the"
                " model for every pass, the source pass too; drop passes or use passes: both"
            )
        matched = shared.matched(cfg, index, where, strict) if shared is not None else _match(cfg, index, where, strict)
        ctx = BindContext(str(name), seed, strict, safe, model, ctx_added, flags, plan.steps)
        if not cfg.enabled:
            plan.steps.append(Step(str(name), kind.name, kind.mechanism, cfg, matched, _skip, enabled=False))
            continue
        step = kind.bind(cfg, matched, ctx)
        plan.steps.append(step)
        if step.replaced:
            index = ModuleIndex.from_targets(_with_replacements(index.targets(), step.replaced))
    plan.index, plan.specs = index, specs
    for step in plan.steps:
        if step.enabled and step.after_plan is not None:
            step.after_plan()
    if example_inputs is not None or example_kwargs:
        from surgery.core.probe import check_before_apply

        check_before_apply(plan.model, plan.steps, example_inputs or (), batches, example_kwargs)
    return plan


class Shared:
    """What the plans of one unmodified model share: its module index, and per action config its validated
    form and its selection, reused when a later plan holds the same plain (JSON-like) config again."""

    def __init__(self, configs: dict[tuple[Any, ...], Any] | None = None) -> None:
        self.index: ModuleIndex | None = None
        self._configs: dict[tuple[Any, ...], Any] = {} if configs is None else configs  # may outlive this model
        self._matches: dict[tuple[Any, ...], list[Target]] = {}

    def index_of(self, model: nn.Module) -> ModuleIndex:
        """The model's module index, walked once."""
        if self.index is None or self.index.modules[0] is not model:
            self.index = ModuleIndex.of(model)
        return self.index

    def validated(self, kind: Any, node: Any, where: str) -> Any:
        """``validate(kind.schema, node, where)``, once per distinct plain config (configs are never mutated).

        A config that differs from one validated before only in its ``select`` text (a study's cells, a layer
        each) is a copy of it holding the new text: ``select`` is read by the match alone, and the only check
        made on it (a glob string or a list of them) holds for any text.
        """
        content = plain(node)
        if content is None:
            return validate(kind.schema, node, where)
        key = (kind.name, where, content)
        if key not in self._configs:
            select = node.get("select")
            text = type(select) is str and "${" not in select and select != "???"
            rest = tuple(p for p in content[1] if p[0] != ("str", "select"))
            others = ("select", kind.name, where, rest) if text else None
            known = self._configs.get(others) if others is not None else None
            if known is not None:
                config = copy.copy(known)
                object.__setattr__(config, "select", select)
            else:
                config = validate(kind.schema, node, where)
                if others is not None:
                    self._configs[others] = config
            self._configs[key] = config
        return self._configs[key]

    def matched(self, cfg: Any, index: ModuleIndex, where: str, strict: bool) -> list[Target]:
        """``_match``, once per selector on the same index."""
        key = (id(index), where, strict, plain(cfg.select), plain(cfg.type), plain(cfg.exclude), cfg.allow_empty)
        if None in key[3:6]:
            return _match(cfg, index, where, strict)  # a selector that is not plain data: not shared
        if key not in self._matches:
            self._matches[key] = _match(cfg, index, where, strict)
        return list(self._matches[key])


def _with_replacements(targets: list[Target], replaced: list[Target]) -> list[Target]:
    """The module list after a replace_module step: each replaced subtree swapped for the new one."""
    by_name = {t.name: t for t in replaced}
    out: list[Target] = []
    skip: str | None = None
    for target in targets:
        if skip is not None and target.name.startswith(skip):
            continue
        skip = None
        new = by_name.get(target.name)
        if new is None:
            out.append(target)
            continue
        skip = target.name + "."
        for sub_name, sub in new.module.named_modules():
            suffix = f".{sub_name}" if sub_name else ""
            out.append(Target(new.name + suffix, new.real_name + suffix, sub))
    return out


def _skip(ledger: Any) -> None:
    """A disabled action applies nothing."""


def _match(cfg: Any, index: ModuleIndex, where: str, strict: bool) -> list[Target]:
    """The modules an action selects; nothing at all is a NoMatchError under strict."""
    select, types, exclude = as_list(cfg.select), as_list(cfg.type), as_list(cfg.exclude)
    matched = index.select(select, types, exclude, where)
    if matched or not strict or cfg.allow_empty:
        return matched
    names = index.names
    if exclude is not None and index.select(select, types, None, where):
        kept_out = [t.name for t in index.select(select, types, None, where)]
        raise NoMatchError(
            f"{where}.exclude: {_quote(exclude)} removed every module the selector matched"
            f" ({', '.join(kept_out[:6])}{' …' if len(kept_out) > 6 else ''})"
        )
    if select is not None:
        by_name = index.select(select, None, exclude, f"{where}.select")
        if not by_name:
            close = closest_names(select[0], names)
            hint = "".join(found(index, close, select[0]) for found in NO_MATCH_HINTS)
            raise NoMatchError(
                f"{where}.select: {_quote(select)} matched no module. Closest module names:"
                f" {', '.join(close)}.{hint} Set allow_empty: true if that is expected."
            )
        present = sorted({type(t.module).__name__ for t in by_name})
        raise NoMatchError(
            f"{where}.type: {_quote(types)} matched none of the {len(by_name)} module(s) selected by"
            f" {_quote(select)}; their types are: {', '.join(present[:12])}."
        )
    present = sorted({cls.__name__ for cls in set(index.classes)})
    hint = did_you_mean(types[0] if types else "", present)
    raise NoMatchError(
        f"{where}.type: {_quote(types)} matched no module.{hint} Types in this model:"
        f" {', '.join(present[:20])}. Set allow_empty: true if that is expected."
    )


def _quote(patterns: list[str] | None) -> str:
    return "nothing" if not patterns else ", ".join(repr(p) for p in patterns)
