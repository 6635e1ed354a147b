"""``@attn_pattern``: each block's attention probabilities ``[batch, heads, query, key]`` (eager attention).

A capture records the item of the attention module's output that eager attention returns (the very tensor
``output_attentions=True`` gives: item 1, T5's item 2). A ``modify_output`` acts on the result of the ``softmax``
call inside the attention's forward (``function: softmax``), before the probabilities weight the values, so the
change reaches the attention result, and the pattern the module returns is the changed one. Fused kernels (sdpa,
flash) never materialise the probabilities: a model loaded with one is refused, naming the override to paste.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from surgery.core.select import ModuleIndex
from surgery.errors import ConfigError

FUNCTION = "softmax"  # what eager attention computes the probabilities with, in every family the tables know
EAGER_HINT = "load it with model.attn_implementation=eager (Python: model.set_attn_implementation('eager'))"


def check_eager(index: ModuleIndex, selected: list[str], where: str) -> None:
    """Refuse attention modules that run a fused kernel (no probabilities exist as a tensor)."""
    model = index.modules[0]
    position = {name: i for i, name in enumerate(index.names)}
    for name in selected:
        config = getattr(index.modules[position[name]], "config", None) or getattr(model, "config", None)
        found = getattr(config, "_attn_implementation", None)
        if found not in (None, "eager"):
            raise ConfigError(
                f"{where}.select: @attn_pattern needs eager attention: {name} runs {found!r}, which never"
                f" materialises the probabilities; {EAGER_HINT}"
            )


def pattern_index(node: dict[str, Any], part: str | None, where: str) -> None:
    """``head: N`` (``part``: its subscript) as the index ``[:, N]`` of ``[batch, heads, query, key]``."""
    if part is None:
        return
    if node.get("index") is not None:
        raise ConfigError(
            f"{where}.index: with head, @attn_pattern takes [:, {part}] for you; give head alone, or index"
            f" '[:, {part}, QUERY, KEY]' alone"
        )
    node["index"] = f"[:, {part}]"


def pattern_action(node: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """The capture or ``modify_output`` that reads or changes the probabilities (a capture's ``what`` and ``item``
    are set by the caller)."""
    if "function" in node:
        raise ConfigError(f"{where}.function: @attn_pattern reads the probabilities for you; drop function")
    if kind == "capture":
        return node
    if kind == "modify_input":
        raise ConfigError(
            f"{where}.kind: @attn_pattern is computed inside the attention's forward, not passed to it: use"
            " modify_output"
        )
    source = node.get("from")
    if isinstance(source, Mapping) and "capture" in source:
        raise ConfigError(
            f"{where}.from: a patch of @attn_pattern reads no capture (its change acts on the softmax inside the"
            " attention); use op: zero, scale, add or set with value"
        )
    if "item" in node:
        raise ConfigError(f"{where}.item: @attn_pattern changes the probabilities themselves; drop item")
    node["function"] = FUNCTION
    return node
