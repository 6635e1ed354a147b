"""The batches a run feeds the model: seeded tensors or a file (one spec, any number of batches), or a data set.

``make_batches`` returns batch 0 at once (the plan's probe forward and the comparison use it) and
iterates every batch, batch 0 first, with its labels when the input has them. A data set is read
through its DataLoader in one pass, so memory stays flat whatever its size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from surgery.app.inputs import batch_count, make_inputs
from surgery.errors import ConfigError

Batch = tuple[tuple[torch.Tensor, ...], "torch.Tensor | None"]


@dataclass
class Batches:
    """Batch 0's inputs, how many batches and examples there are, and the iterator over all of them."""

    first: tuple[torch.Tensor, ...]
    count: int
    labelled: bool
    examples: int
    source: str  # for the report: "random", "digits (test)", a path, ...
    first_labels: torch.Tensor | None = None
    _iterator: Iterator[Batch] = field(repr=False, default_factory=lambda: iter(()))

    def __iter__(self) -> Iterator[Batch]:
        return self._iterator


def input_spec(model_input: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The model config's input defaults overridden by the run's ``input``.

    When the run picks another kind (``+input=random`` on a model whose default is a data set), only
    the defaults every kind shares (``shape``, ``shapes``, ``target``) are kept.
    """
    model_kind = model_input.get("kind") or "random"
    kind = given.get("kind") or model_kind
    if kind == model_kind:
        return {**model_input, **given}
    shared = {k: v for k, v in model_input.items() if k in ("shape", "shapes", "target")}
    return {**shared, **given}


def make_batches(spec: Mapping[str, Any], seed: int, dtype: torch.dtype, device: torch.device) -> Batches:
    """The run's batches from its input spec (kinds random, tokens, digit, file, dataset)."""
    if (spec.get("kind") or "random") == "dataset":
        return _dataset_batches(spec, dtype, device)
    count = batch_count(spec)
    first = make_inputs(spec, seed, dtype, device)

    def every() -> Iterator[Batch]:
        yield first, None
        for batch in range(1, count):
            yield make_inputs(spec, seed, dtype, device, batch), None

    examples = count * (int(first[0].shape[0]) if first and first[0].dim() else 1)
    return Batches(first, count, False, examples, str(spec.get("kind") or "random"), None, every())


def _dataset_batches(spec: Mapping[str, Any], dtype: torch.dtype, device: torch.device) -> Batches:
    from surgery.data.loader import data_loader, dataset_input

    if spec.get("batches") is not None:
        raise ConfigError("input.batches: a data set's size sets the number of batches; use input.limit=N instead")
    config = dataset_input({k: v for k, v in spec.items() if k != "batches"})
    loader = data_loader(config)
    rows = iter(loader)
    first_x, first_y = _split(next(rows), config.y_key)
    first_y = None if first_y is None else first_y.to(device)
    as_inputs = lambda x: (x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype),)  # noqa: E731

    def every() -> Iterator[Batch]:
        yield as_inputs(first_x), first_y
        for row in rows:
            x, y = _split(row, config.y_key)
            yield as_inputs(x), None if y is None else y.to(device)

    examples = len(loader.dataset)  # type: ignore[arg-type]
    where = f"{config.source} ({config.split})" if config.source else str(config.path)
    return Batches(as_inputs(first_x), len(loader), first_y is not None, examples, where, first_y, every())


def _split(row: Any, y_key: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    x, y = (row[0], row[1]) if len(row) == 2 else (row[0], None)
    return x, (y if y_key is not None else None)
