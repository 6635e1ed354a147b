"""``replace_module``: swap selected modules for new ones in an apply pass; undo puts them back."""

from __future__ import annotations

from typing import Any

from torch import nn

from surgery.actions.base import APPLY_PASS, KINDS, BindContext, Kind, Step
from surgery.actions.sharded import DDP_ADVICE
from surgery.core.callables import instantiate_node
from surgery.core.ledger import Ledger
from surgery.core.limits import check_built, check_forward
from surgery.core.schema import ReplaceModuleAction
from surgery.core.select import ROOT, Target
from surgery.errors import ConfigError


def _move_like(new: nn.Module, old: nn.Module) -> nn.Module:
    """Put the new module on the old one's device and floating dtype, and in its train/eval mode."""
    tensors = [t for t in list(old.parameters()) + list(old.buffers()) if t.is_floating_point()]
    if tensors:
        new = new.to(device=tensors[0].device, dtype=tensors[0].dtype)
    return new.train(old.training)


@KINDS.register()
class ReplaceModule(Kind):
    """Each selected module is replaced in its parent by a new module built from ``with``.

    The new modules are built when the plan is compiled, so later actions of the same plan
    select them (and their children) by the same names.
    """

    name = "replace_module"
    schema = ReplaceModuleAction
    mechanism = APPLY_PASS
    ddp_advice = DDP_ADVICE["replace_module"]

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Build one replacement per module now; refuse the root and nested selections."""
        by_parent: dict[int, list[tuple[str, str, nn.Module, nn.Module]]] = {}  # parent -> (name, attr, old, new)
        replaced: list[Target] = []
        names = [t.name for t in targets]
        if targets:  # under limits.memory_gb: one built on meta first, then refused if every copy would not fit
            check_built(lambda: instantiate_node(cfg.with_, f"{ctx.where}.with", ctx.safe), f"{ctx.where}.with",
                        str(cfg.with_.get("_target_")), copies=len(targets))  # fmt: skip
        for target in targets:
            if target.name == ROOT:
                raise ConfigError(f"{ctx.where}.select: the root module has no parent to be replaced in")
            outer = next((n for n in names if target.name.startswith(n + ".")), None)
            if outer is not None:
                raise ConfigError(
                    f"{ctx.where}.select: matches both {outer!r} and {target.name!r} inside it; select one level"
                )
            new = instantiate_node(cfg.with_, f"{ctx.where}.with", ctx.safe)
            if not isinstance(new, nn.Module):
                built = type(new).__name__
                raise ConfigError(f"{ctx.where}.with: {cfg.with_['_target_']!r} built a {built}, not a Module")
            new = _move_like(new, target.module)
            check_forward(new, lambda: instantiate_node(cfg.with_, f"{ctx.where}.with", ctx.safe), f"{ctx.where}.with")
            parent_name, _, attr = target.real_name.rpartition(".")
            parent = ctx.root.get_submodule(parent_name)
            by_parent.setdefault(id(parent), []).append((target.name, attr, target.module, new))
            replaced.append(Target(target.name, target.real_name, new))
        root, action = ctx.root, ctx.name

        def apply(ledger: Ledger) -> None:
            ledger.action = action

            def visit(module: nn.Module) -> None:
                for name, attr, _old, new in by_parent.get(id(module), ()):
                    ledger.where = name
                    ledger.swap_child(module, attr, new)

            root.apply(visit)

        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply, replaced=replaced)
