"""Actions that add a vector: ``vector: NAME`` put in as the engine's ``value:`` tensor before planning.

```yaml
steer: {kind: modify_output, select: "@resid_post.1", vector: love_hate, scale: 4.0, index: "[:, -1]"}
```
becomes ``{kind: modify_output, select: ..., op: add, value: <the vector>, scale: 4.0, index: ...}``: the
engine adds ``scale * vector`` (computed once) to the part ``index`` selects. ``scale`` stays as written, so a
study's ``scale: "{coef}"`` is filled per cell.

>>> with surgery.apply(model, steering({"steer": {..., "vector": "love_hate", "scale": 4.0}}, {"love_hate": v})):
...     model.generate(**batch, max_new_tokens=20)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from surgery.core.compiler import load_actions
from surgery.errors import ConfigError, did_you_mean
from surgery.vectors.contrast import Vector


def steering(actions: Any, vectors: Mapping[str, torch.Tensor | Vector] | None = None,
             where: str = "actions") -> dict[str, Any]:  # fmt: skip
    """``actions`` (a name, a YAML path, a dict) with every ``vector:`` (a name in ``vectors``, or a tensor) put in
    as ``op: add, value: TENSOR``; a name naming no vector, or another op, is refused naming the key."""
    known = dict(vectors or {})
    out: dict[str, Any] = {}
    for name, node in load_actions(actions).items():
        if not isinstance(node, Mapping) or node.get("vector") is None:
            out[name] = node
            continue
        at = f"{where}.{name}"
        out[name] = _put_in(dict(node), known, at)
    return out


def _put_in(node: dict[str, Any], known: dict[str, torch.Tensor | Vector], at: str) -> dict[str, Any]:
    given = node.pop("vector")
    if isinstance(given, torch.Tensor):
        tensor = given
    elif isinstance(given, str):
        if given not in known:
            listed = ", ".join(known) or "none"
            raise ConfigError(f"{at}.vector: {given!r} names no vector.{did_you_mean(given, known)} Vectors of this"
                              f" run: {listed} (the top-level vectors: block, docs/vectors.md)")  # fmt: skip
        found = known[given]
        tensor = found.tensor if isinstance(found, Vector) else found
    else:
        raise ConfigError(f"{at}.vector: the name of a vector of the vectors: block; got {given!r}")
    op = node.get("op", "add")
    if op != "add":
        raise ConfigError(f"{at}.op: a vector is added (op: add, its strength in scale); got op {op!r}")
    for key in ("value", "from"):
        if key in node:
            raise ConfigError(f"{at}.{key}: vector gives the tensor to add; drop {key} (scale sets its strength)")
    return {**node, "op": "add", "value": tensor}


@contextlib.contextmanager
def named_as_vectors(actions: Mapping[str, Any], where: str = "actions") -> Iterator[None]:
    """Inside, a refusal of a steering action's ``value`` (a width that does not fit) names its ``vector`` key."""
    names = [str(n) for n, node in actions.items() if isinstance(node, Mapping) and node.get("vector") is not None]
    try:
        yield
    except ConfigError as e:
        text = str(e)
        for name in names:
            if f"{where}.{name}.value:" in text:
                text = text.replace(f"{where}.{name}.value:", f"{where}.{name}.vector:")
                raise ConfigError(text.replace("the tensor given as value", "the vector")) from None
        raise
