"""What a config will cost, from its arithmetic alone, checked against ``limits`` before any work (SPEC §19).

Nothing here builds what it measures: a grid's cells are the product of its variables' value counts
(a range ``start:stop:step`` is counted, never listed), a study's forward rows are cells × examples, a
figure's pixels come from its layout, a harvest's bytes from rows × site widths × the stored dtype. Each
check refuses in one line naming the key that asked and ending with the override that admits it.

``limits.count`` bounds the things a config asks for one by one (cells, actions, jobs, integrated-gradient
passes). The cheap work a study multiplies out of them (forward rows, bootstrap means) is bounded at
``WORK_PER_COUNT`` times as much: at safe mode's 10,000 that is 10 million.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from surgery.core.limits import GB, active, check_count, check_disk, check_memory
from surgery.errors import ConfigError

WORK_PER_COUNT = 1_000  # one forward row or one bootstrap mean is ~a thousandth of a planned cell's cost
MAX_CELLS = 1_000_000  # a grid larger than this is a typo, not a study (bounded with or without limits)
# A figure is drawn only within these: past them matplotlib takes minutes and GBs, and nobody reads the
# picture. The numbers are written as CSV instead, and the report says so.
FIGURE_MAX_PIXELS = 4_000  # each side, at the figure's dpi
FIGURE_MAX_PANELS = 64  # heatmap panels in one figure (one per value of the grid's other variables)
FIGURE_MIN_CELL_PIXELS = 4  # a heatmap squeezed to fit is drawn while each cell keeps at least this many pixels

_RANGE = re.compile(r"\s*(-?\d+)?\s*:\s*(-?\d+)?\s*(?::\s*(-?\d+)?\s*)?")


def parse_range(text: str, at: str) -> range | None:
    """``"start:stop[:step]"`` as a (lazy) ``range``, or None when ``text`` is no range; nothing is listed.

    >>> len(parse_range("0:1000000000000", "study.grid.pos"))
    1000000000000
    """
    found = _RANGE.fullmatch(text)
    if found is None:
        return None
    start, stop, step = (int(p) if p is not None else None for p in found.groups())
    if start is None or stop is None:
        raise ConfigError(f"{at}: a range needs its start and stop, e.g. '0:13'; got {text!r}")
    if step == 0:
        raise ConfigError(f"{at}: a range's step cannot be 0; got {text!r}")
    return range(start, stop, 1 if step is None else step)


def range_size(values: range) -> int:
    """How many values ``values`` holds, by arithmetic (``len`` overflows past 2**63)."""
    start, stop, step = values.start, values.stop, values.step
    return max(0, (stop - start + step - (1 if step > 0 else -1)) // step)


def check_cells(counts: Iterable[int], where: str) -> int:
    """The number of cells of a grid whose variables have ``counts`` values; refused past the bounds."""
    size = math.prod(counts)
    check_count(size, where, "study cells (the product of the grid's value counts)")
    if size > MAX_CELLS:
        raise ConfigError(f"{where}: {size:,} cells are more than {MAX_CELLS:,}; narrow a range")
    return size


def check_work(amount: int, key: str, what: str) -> None:
    """Refuse ``amount`` of cheap repeated work (``what``) past ``limits.count`` × WORK_PER_COUNT."""
    bound = active().count
    if bound is None or amount <= bound * WORK_PER_COUNT:
        return
    raise ConfigError(
        f"{key}: {amount:,} {what} are more than limits.count × {WORK_PER_COUNT:,} = {bound * WORK_PER_COUNT:,};"
        f" if that is meant, raise it: limits.count={-(-amount // WORK_PER_COUNT)}"
    )


def check_study(
    cells: int, examples: int, *, n_boot: int | None = None, steps: int | None = None, metrics: int = 1
) -> None:
    """A study's work before it starts: forward rows, bootstrap means, integrated-gradient passes, result memory.

    ``n_boot`` when an interval is asked for; ``steps`` for integrated gradients.
    """
    check_work(cells * examples, "study.grid", f"forward rows ({cells:,} cells × {examples:,} examples)")
    if n_boot is not None:
        check_work(cells * n_boot, "study.n_boot", f"bootstrap means ({n_boot:,} draws × {cells:,} cells)")
        check_memory(8.0 * cells * n_boot, "study.n_boot", f"{n_boot:,} bootstrap means of {cells:,} cells")
    if steps is not None:  # each step is a forward and backward per edited site: at most one site per cell
        check_count(steps * cells, "study.steps", f"integrated-gradient passes ({steps:,} steps × {cells:,} cells)")
    values = 8.0 * cells * examples * (metrics + 1)  # float64 values per metric, and which are done
    check_memory(2 * values, "study.grid", f"per-example values of {cells:,} cells × {examples:,} examples")


def check_circuit(
    edges: int,
    examples: int,
    *,
    exact: bool,
    steps: int | None = None,
    runs: int = 0,
    verified: int = 0,
    metrics: int = 1,
    stacked: int = 0,
    itemsize: int = 4,
) -> None:
    """A circuit study's work before it starts (SPEC §21): patched rows (``exact`` edge patching: edges ×
    examples; ``runs`` pruned circuits and ``verified`` edges run exactly), integrated-gradient passes, the
    per-example values and the ``stacked`` values of every sender and receiver (``itemsize`` bytes each)."""
    patched = (edges if exact else 0) + verified
    what = f"forward rows ({patched:,} edges run exactly × {examples:,} examples)"
    check_work(patched * examples, "study.method", what)
    if runs:
        check_count(runs, "study.top_edges", "pruned circuits")
        check_work(runs * examples, "study.top_edges", f"forward rows ({runs:,} circuits × {examples:,} examples)")
    if steps is not None:
        check_count(steps, "study.steps", "integrated-gradient passes (one forward and backward each)")
    values = 8.0 * edges * examples * metrics
    check_memory(2 * values, "study.method", f"per-example values of {edges:,} edges × {examples:,} examples")
    check_memory(float(stacked) * itemsize, "study.batch_size",
                 f"every sender's and receiver's activations ({stacked:,} values) for a batch")  # fmt: skip


def check_forward_rows(rows: int, per_row: int, itemsize: int, key: str) -> None:
    """One forward of ``rows`` rows, each making about ``per_row`` values (positions × the model's widest
    dimension: an LM's logits), against ``limits.memory_gb``."""
    check_memory(float(rows) * per_row * itemsize, key, f"{rows:,} rows in one forward, about {per_row:,} values each")


def figure_refusal(width_in: float, height_in: float, dpi: int, panels: int = 1) -> str | None:
    """Why a figure of this size is not drawn (past FIGURE_MAX_PIXELS or FIGURE_MAX_PANELS), or None."""
    if panels > FIGURE_MAX_PANELS:
        return f"{panels:,} panels are more than {FIGURE_MAX_PANELS} a figure draws"
    width, height = round(width_in * dpi), round(height_in * dpi)
    if max(width, height) > FIGURE_MAX_PIXELS:
        return f"{width:,} × {height:,} pixels at dpi {dpi} are past {FIGURE_MAX_PIXELS:,} × {FIGURE_MAX_PIXELS:,}"
    return None


def harvest_bytes(rows: int, site_row_bytes: Iterable[int], context: int) -> int:
    """What a harvest of ``rows`` rows writes: every site's activations (bytes a row, stored dtype) and the
    token ids (int64 ids and the kept positions, 16 bytes a token at most)."""
    return rows * (sum(site_row_bytes) + 16 * context)


def check_harvest_disk(nbytes: float, written: float, key: str, about: str = "") -> None:
    """Refuse a harvest of ``nbytes`` past ``limits.disk_gb`` before its first shard (``about``: how it was
    estimated, said before the override)."""
    try:
        check_disk(nbytes, written, key)
    except ConfigError as e:
        if not about:
            raise
        head, _, tail = str(e).partition("; if that is meant")
        raise ConfigError(f"{head} ({about}); if that is meant{tail}") from None


def gigabytes(nbytes: float) -> str:
    """``nbytes`` as a short GB text for notes."""
    return f"{nbytes / GB:.3g} GB"
