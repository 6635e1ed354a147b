"""What "restored exactly" means: every attribute PyTorch keeps for hooks, per module and per tensor.

``ModelState.of(model)`` is taken before a surgery is applied (``apply(..., verify=True)``) and
compared after ``remove()``: module classes, children, tensor slots, training flags, every hook
dict (keys in order) and ``_is_full_backward_hook``, non-persistent buffer names, each tensor's
hook dicts (``None`` is not an empty dict), ``requires_grad``, dtype, shape, device and storage,
and its values: a tensor PyTorch saw written in place (its version counter moved) must hold
exactly the values it had before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals

MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
TENSOR_HOOK_ATTRS = ("_backward_hooks", "_post_accumulate_grad_hooks")
GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_buffer_registration_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
)


def _keys(value: Any) -> Any:
    """A hook dict as its keys in order (None stays None: PyTorch makes some dicts only on first use)."""
    if value is None:
        return None
    if type(value) in _PLAIN_DICTS:  # what PyTorch keeps, tried before the slower ABC check of Mapping
        return tuple(value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(value))
    if isinstance(value, Mapping):
        return tuple(value)
    return value


_PLAIN_DICTS = (dict, OrderedDict)


def _module_facts(module: nn.Module) -> dict[str, Any]:
    own = module.__dict__
    facts: dict[str, Any] = {
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "object": id(module),
        "training": module.training,
        "children": tuple((n, id(c)) for n, c in module._modules.items()),
        "parameters": tuple((n, id(t)) for n, t in module._parameters.items()),
        "buffers": tuple((n, id(t)) for n, t in module._buffers.items()),
        "_non_persistent_buffers_set": _keys(module._non_persistent_buffers_set),
        "_is_full_backward_hook": own.get("_is_full_backward_hook", "absent"),
    }
    for name in MODULE_HOOK_DICTS:
        facts[name] = _keys(own.get(name, "absent"))
    return facts


def _storage(tensor: torch.Tensor) -> int | None:
    """Where the values live: an FSDP2 DTensor's local shard; none on meta."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return None if local.device.type == "meta" else local.untyped_storage().data_ptr()


def _tensor_facts(tensor: torch.Tensor) -> dict[str, Any]:
    facts: dict[str, Any] = {name: _keys(getattr(tensor, name, None)) for name in TENSOR_HOOK_ATTRS}
    facts.update(
        {
            "class": type(tensor).__name__,
            "requires_grad": tensor.requires_grad,
            "dtype": tensor.dtype,
            "shape": tuple(tensor.shape),
            "device": tensor.device,
            "storage": _storage(tensor),
            "version": tensor._version,
        }
    )
    return facts


@dataclass
class ModelState:
    """A model's hook state, structure, flags and tensor versions at one moment (no copy of the values)."""

    modules: dict[str, dict[str, Any]]
    tensors: dict[str, dict[str, Any]]
    globals: dict[str, Any]
    objects: dict[str, torch.Tensor]  # full name -> tensor, to read values when a version moved

    @classmethod
    def of(cls, model: nn.Module) -> ModelState:
        """Take the snapshot (O(modules + tensors), no tensor data is read)."""
        modules: dict[str, dict[str, Any]] = {}
        tensors: dict[str, dict[str, Any]] = {}
        objects: dict[str, torch.Tensor] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            modules[path or "<root>"] = _module_facts(module)
            for kind in ("_parameters", "_buffers"):
                for name, tensor in getattr(module, kind).items():
                    if tensor is None:
                        continue
                    full = f"{path}.{name}" if path else name
                    tensors[full] = _tensor_facts(tensor)
                    objects[full] = tensor
        globs = {name: _keys(getattr(module_globals, name, None)) for name in GLOBAL_HOOK_DICTS}
        globs["_global_is_full_backward_hook"] = getattr(module_globals, "_global_is_full_backward_hook", None)
        return cls(modules, tensors, globs, objects)

    def differences(self, now: ModelState, originals: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
        """What differs in ``now``; a tensor whose version moved must equal its value before (``originals``)."""
        diffs = _dict_diffs("module", self.modules, now.modules)
        diffs += _dict_diffs("tensor", self.tensors, now.tensors, skip=("version",))
        diffs += [f"torch.nn.modules.module.{k}: was {v!r}, now {now.globals.get(k)!r}"
                  for k, v in self.globals.items() if now.globals.get(k) != v]  # fmt: skip
        for name, facts in self.tensors.items():
            after = now.tensors.get(name)
            if after is None or after["version"] == facts["version"]:
                continue
            tensor = now.objects[name]
            kept = originals.get(id(tensor))
            if kept is None or kept[0] is not tensor:
                diffs.append(f"tensor {name}: written in place while the surgery was applied and not restored")
            elif not _equal_with_nan(tensor.detach(), kept[1]):
                diffs.append(f"tensor {name}: values differ from before the surgery")
        return diffs


def _equal_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, where a NaN restored in its place counts as equal (NaN != NaN would refuse the restore)."""
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def _dict_diffs(
    what: str, before: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]], skip: tuple = ()
) -> list[str]:
    diffs = [f"{what} {name}: gone" for name in before if name not in now]
    diffs += [f"{what} {name}: new" for name in now if name not in before]
    for name, facts in before.items():
        after = now.get(name)
        if after is None:
            continue
        for key, value in facts.items():
            if key not in skip and after.get(key) != value:
                diffs.append(f"{what} {name}: {key} was {_show(value)}, now {_show(after.get(key))}")
    return diffs


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) > 6:
        return f"({len(value)} entries)"
    return repr(value)


def hooks_on(model: nn.Module) -> int:
    """How many hooks sit on the model's modules and tensors (a quick count; ``ModelState`` compares everything)."""
    holding = [name for name in MODULE_HOOK_DICTS if not name.endswith(("_with_kwargs", "_always_called"))]
    count = 0
    for module in model.modules():
        count += sum(len(getattr(module, name, None) or {}) for name in holding)
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None:
                count += sum(len(getattr(tensor, name, None) or {}) for name in TENSOR_HOOK_ATTRS)
    return count
