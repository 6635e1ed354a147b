"""``on_load``: load_state_dict pre/post hooks that rename checkpoint keys and forgive added tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from surgery.actions.base import KINDS, STATE_DICT_HOOK, BindContext, Kind, Step, hook_failed
from surgery.core.globs import ROOT, glob_rename
from surgery.core.ledger import Ledger
from surgery.core.schema import OnLoadAction
from surgery.core.select import Target
from surgery.errors import ConfigError


def _renamer(rename: dict[str, str], where: str) -> Callable[[str], str]:
    """One function applying the first matching rule of ``rename`` to a key."""
    rules = [glob_rename(str(old), str(new), f"{where}.rename.{old}") for old, new in rename.items()]

    def apply(key: str) -> str:
        for rule in rules:
            renamed = rule(key)
            if renamed is not None:
                return renamed
        return key

    return apply


def _added_names(ctx: BindContext) -> set[str]:
    """state_dict names (relative to the root) of tensors this plan adds (all of them, once the plan is compiled)."""
    names: set[str] = set()
    for real_name, module in ctx.root.named_modules():
        for tensor_name in ctx.added.get(id(module), {}):
            names.add(f"{real_name}.{tensor_name}" if real_name else tensor_name)
    return names


@KINDS.register()
class OnLoad(Kind):
    """Rewrite checkpoint keys by ``rename`` as ``load_state_dict`` reads them (pre-hook), and
    drop tensors added by this plan (before or after this action) from the missing keys
    (post-hook), so a checkpoint of the original model loads strictly into the surgered one."""

    name = "on_load"
    schema = OnLoadAction
    mechanism = STATE_DICT_HOOK

    def bind(self, cfg: Any, targets: list[Target], ctx: BindContext) -> Step:
        """Check every rename rule now; the tensors the plan adds are collected when it is applied."""
        rename = _renamer(cfg.rename, ctx.where)
        if not cfg.rename and not cfg.ignore_added:
            raise ConfigError(f"{ctx.where}.rename: nothing to do: give rename rules, or leave ignore_added true")
        action, root, where = ctx.name, ctx.root, ctx.where

        def check_plan() -> None:
            # Every action is bound now, so ctx.added holds what all of them add, those listed after this one too.
            if not cfg.rename and not _added_names(ctx):
                raise ConfigError(
                    f"{where}.rename: nothing to do: give rename rules, or add tensors (add_parameter, add_buffer)"
                    " in the same plan"
                )

        def apply(ledger: Ledger) -> None:
            # the post-hook is counted for this action even with no rename (ledger.each would not set it)
            ledger.action = action
            # added tensors are forgiven whatever the order of the actions (ctx.added is complete once compiled)
            added = _added_names(ctx) if cfg.ignore_added else set()
            if cfg.rename:
                for target in ledger.each(action, targets, lambda t: t.name):
                    hook = _pre_hook(rename, action, target.name)
                    ledger.hook(target.module.register_load_state_dict_pre_hook, hook)
            if added:  # names are relative to the root, which is what loads a whole checkpoint
                ledger.where = ROOT
                ledger.hook(root.register_load_state_dict_post_hook, _post_hook(added))

        return Step(ctx.name, self.name, self.mechanism, cfg, targets, apply, after_plan=check_plan)


def _pre_hook(rename: Callable[[str], str], action: str, name: str) -> Callable[..., None]:
    def pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        try:
            for key in [k for k in state_dict if k.startswith(prefix)]:
                new = prefix + rename(key[len(prefix) :])
                if new != key:
                    state_dict[new] = state_dict.pop(key)
        except Exception as e:
            raise hook_failed(action, name, e) from e

    return pre_hook


def _post_hook(added: set[str]) -> Callable[[nn.Module, Any], None]:
    def post_hook(module: nn.Module, incompatible: Any) -> None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in added]

    return post_hook
