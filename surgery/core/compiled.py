"""Whether ``torch.compile`` may ignore a change to a model: its wrapper, or the model's own compiled past.

Dynamo keeps compiled graphs on code objects, shared by every instance of a class, and does not
guard on hooks added to modules that had none (``torch._dynamo.config.skip_nnmodule_hook_guards``).
The signs read here are per instance: ``torch.compile``'s wrapper, ``Module.compile()``, and the
mark Dynamo leaves on the parameters and buffers of a module it traced. Only private torch state
is available for this; when it is missing the check says nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

WRAPPER = "wrapper"
RAN = "ran"


def compiled_state(model: nn.Module) -> str | None:
    """``WRAPPER`` if the model is or holds a ``torch.compile`` wrapper; ``RAN`` if it (or a submodule)
    has run compiled and Dynamo still holds compiled graphs; else None."""
    if "torch._dynamo" not in sys.modules:  # Dynamo never imported: nothing was ever compiled
        return None
    entries = _cache_entries()
    live = entries is not None and _holds_graphs(entries)
    ran = False
    for module in model.modules():  # one pass: a wrapper anywhere wins over RAN
        if type(module).__name__ == "OptimizedModule":
            return WRAPPER
        ran = ran or (live and _ran_compiled(module, entries))
    return RAN if ran else None


def _cache_entries() -> Any:
    """Dynamo's per-code cache entry lister (private), or None when this torch lacks it."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    return _debug_get_cache_entry_list


def _holds_graphs(entries: Any) -> bool:
    """Some code compiled since the last ``torch._dynamo.reset()`` still has cached graphs."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    try:
        codes = [ref() for ref in convert_frame.input_codes.seen]  # type: ignore[union-attr]
        return any(code is not None and entries(code) for code in codes)
    except Exception:  # private API changed: say nothing rather than guess
        return False


def _ran_compiled(module: nn.Module, entries: Any) -> bool:
    """Dynamo traced this module's own tensors, or compiled this instance and its class's forward."""
    # Dynamo marks the tensors of modules it traces "unguarded" (a compiled optimizer marks "guarded").
    for tensors in (module._parameters, module._buffers):
        for tensor in tensors.values():
            if getattr(tensor, "_dynamo_static_input_type", None) == "unguarded":
                return True
    # Module.compile() sets _compiled_call_impl; torch.compile(module) sets _is_torch_compile on it.
    own = vars(module)
    if own.get("_compiled_call_impl") is None and not own.get("_is_torch_compile"):
        return False
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    try:
        return code is not None and bool(entries(code))
    except Exception:
        return False
