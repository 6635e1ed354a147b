"""The ``study:`` block of a run (SPEC §13), as a schema checked before anything runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from surgery.core.schema_actions import FieldError

BATCH_CELLS = "auto"


@dataclass
class StudyConfig:
    """``study:`` keys; grid and metrics are required."""

    grid: Any = MISSING  # named variables: a list, "start:stop[:step]", or "all" (every position of a text input)
    metrics: Any = MISSING  # per-example metrics: [{logit_diff: {correct, wrong}}, {prob: {token}}, loss, kl, ...]
    normalize: Any = False  # first metric on a 0-1 scale: true (per example), mean, or {zero: B, one: B} (studies.md)
    ci: Any = None  # bootstrap confidence level over examples, e.g. 0.95 (null: none)
    n_boot: int = 1000  # bootstrap resamples (seeded by the run's seed)
    batch_cells: Any = BATCH_CELLS  # how many cells share one forward by replicating rows; 1 = one per forward
    method: str = "patch"  # patch | attribution | integrated_gradients; edges | eap | eap_ig: docs/circuits.md
    steps: Any = None  # integrated_gradients only
    verify_top: Any = None  # attribution only

    def __post_init__(self) -> None:
        if self.ci is not None and (isinstance(self.ci, bool) or not isinstance(self.ci, float | int)
                                    or not 0 < self.ci < 1):  # fmt: skip
            raise FieldError("ci", f"a level between 0 and 1, e.g. 0.95, or null; got {self.ci!r}")
        cells = self.batch_cells
        if cells != BATCH_CELLS and (isinstance(cells, bool) or not isinstance(cells, int) or cells < 1):
            raise FieldError("batch_cells", f"'auto' or a number of cells per forward (1 or more); got {cells!r}")
