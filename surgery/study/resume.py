"""A study's finished cells, kept as it goes, so a rerun in the same run directory computes only the rest.

``study.partial.safetensors`` holds ``values/METRIC`` ``[cells, examples]`` and ``done``
``[cells, examples]`` (1 where that cell has scored that example), with the fingerprints of the config,
the model's weights and the input in its metadata: a rerun whose fingerprints differ is refused
rather than mixed. The file is written atomically (at most every few seconds, and at the end) and
removed once the study's own files are written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from surgery.errors import ConfigError

PARTIAL = "study.partial.safetensors"
EVERY_S = 2.0


class Progress:
    """Which (cell, example) pairs are scored, their values, and how to save them."""

    def __init__(
        self, values: dict[str, torch.Tensor], done: torch.Tensor, save: Callable[[Progress], None] | None = None
    ) -> None:
        self.values, self.done, self.save_with = values, done, save
        self._saved_at = time.monotonic()

    @classmethod
    def fresh(
        cls, metrics: list[str], cells: int, examples: int, save: Callable[[Progress], None] | None = None
    ) -> Progress:
        """Nothing scored yet."""
        values = {m: torch.full((cells, examples), torch.nan, dtype=torch.float64) for m in metrics}
        return cls(values, torch.zeros(cells, examples, dtype=torch.bool))

    def pending_groups(self, groups: list[list[int]], rows: slice) -> list[list[int]]:
        """The groups of cells with an example of ``rows`` still to score (``pending`` of each, in one pass)."""
        left = (~self.done[:, rows].all(dim=1)).tolist()
        return [g for g in groups if any(left[i] for i in g)]

    def finished(self, cells: list[int], rows: slice) -> None:
        """Mark ``cells`` × ``rows`` scored; save when a while has passed since the last save."""
        if cells and cells[-1] - cells[0] == len(cells) - 1:  # a run of cells: a slice, cheaper than a list
            self.done[cells[0] : cells[-1] + 1, rows] = True
        else:
            self.done[cells, rows] = True
        if self.save_with is not None and time.monotonic() - self._saved_at >= EVERY_S:
            self.save()

    def save(self) -> None:
        """Save now (when there is somewhere to save)."""
        if self.save_with is not None:
            self.save_with(self)
            self._saved_at = time.monotonic()

    @property
    def complete(self) -> bool:
        """Whether every cell scored every example."""
        return bool(self.done.all())


def load_partial(path: Path, prints: dict[str, str], metrics: list[str], cells: int, examples: int) -> Progress | None:
    """An interrupted study's progress from ``path``, or None when there is none; refused when it is another study.

    The file is only ever replaced whole (``write_atomic``), so what is here is one finished save; a file
    that is not (another tool's, cut short) is refused in one line rather than read.
    """
    from surgery.files.leftovers import is_resume_file, resume_tensors, tensor_of

    key = "hydra.run.dir"
    if not is_resume_file(path, key):
        return None
    tensors, saved = resume_tensors(path, key)
    for name, value in prints.items():
        if saved.get(name) != value:
            raise ConfigError(
                f"{key}: {path.parent} holds an interrupted study of another {name} ({PARTIAL});"
                " rerun the same command there, or choose another hydra.run.dir"
            )
    done = tensor_of(tensors, "done", key, path)
    values = {m: tensor_of(tensors, f"values/{m}", key, path) for m in metrics}
    if (
        done.dtype != torch.uint8
        or done.shape != (cells, examples)
        or any(v.dtype != torch.float64 or v.shape != done.shape for v in values.values())
    ):
        raise ConfigError(f"{key}: {path} does not fit this study's cells and examples; choose another hydra.run.dir")
    return Progress(values, done.bool())


def saver(path: Path, prints: dict[str, str]) -> Callable[[Progress], None]:
    """Write a Progress to ``path`` atomically, with the fingerprints in its metadata."""

    def save(progress: Progress) -> None:
        from surgery.files.leftovers import write_resume_file

        tensors = {f"values/{m}": v for m, v in progress.values.items()}
        tensors["done"] = progress.done.to(torch.uint8)
        write_resume_file(path, tensors, prints, "study.partial")

    return save
