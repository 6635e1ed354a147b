"""What one run may cost: the memory, disk and counts a config or a file from others may ask for.

Under ``safe=true`` the CLI enforces the run setting ``limits`` (``conf/config.yaml``) for the
whole job with :func:`enforced`; a Python user may do the same. Outside it nothing is bounded
(``active()`` returns unbounded limits). Every check runs before the allocation or the write it
guards, and a refusal names the key that asked and the setting that would admit it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from surgery.errors import ConfigError

GB = 2**30


@dataclass(frozen=True)
class Limits:
    """Bounds for one run; None is unbounded."""

    memory_gb: float | None = None  # tensors a config or file asks for (shapes, dims, parameters, decoded files)
    disk_gb: float | None = None  # everything the run writes into its directory
    count: int | None = None  # actions, calls: entries, batches, new tokens, sweep jobs one config may ask for
    paths_inside: bool = False  # a path a data file names (image, arrow file, symlink) must stay in its directory


UNBOUNDED = Limits()
SAFE_DEFAULTS = Limits(memory_gb=8.0, disk_gb=8.0, count=10_000, paths_inside=True)
_ACTIVE: ContextVar[Limits] = ContextVar("surgery_limits", default=UNBOUNDED)
_WRITTEN: ContextVar[list[float]] = ContextVar("surgery_written")  # bytes written inside the current enforced()


def active() -> Limits:
    """The limits in force here (unbounded unless inside :func:`enforced`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def enforced(limits: Limits) -> Iterator[Limits]:
    """Enforce ``limits`` for everything run inside the block (this thread and tasks it starts)."""
    token, written = _ACTIVE.set(limits), _WRITTEN.set([0.0])
    try:
        yield limits
    finally:
        _WRITTEN.reset(written)
        _ACTIVE.reset(token)


def check_memory(nbytes: float, key: str, what: str = "") -> None:
    """Refuse ``nbytes`` asked for at ``key`` when more than ``limits.memory_gb``, before allocating."""
    bound = active().memory_gb
    if bound is not None and nbytes > bound * GB:
        about = f" ({what})" if what else ""
        raise ConfigError(
            f"{key}: would need {nbytes / GB:.3g} GB{about}, more than limits.memory_gb={bound:g};"
            f" if that is meant, raise it: limits.memory_gb={_above(nbytes / GB)}"
        )


def check_disk(nbytes: float, written: float, key: str) -> None:
    """Refuse writing ``nbytes`` more when ``written`` bytes are already out and ``limits.disk_gb`` would be passed."""
    bound = active().disk_gb
    if bound is not None and written + nbytes > bound * GB:
        total = (written + nbytes) / GB
        raise ConfigError(
            f"{key}: the run would write {total:.3g} GB, more than limits.disk_gb={bound:g};"
            f" if that is meant, raise it: limits.disk_gb={_above(total)}"
        )


def charge_disk(nbytes: float, key: str) -> None:
    """Count ``nbytes`` the run is about to write against ``limits.disk_gb`` (see :func:`check_disk`), before writing."""
    written = _WRITTEN.get(None)
    check_disk(nbytes, written[0] if written else 0.0, key)
    if written is not None:
        written[0] += nbytes


def check_count(count: int, key: str, what: str) -> None:
    """Refuse ``count`` of ``what`` asked for at ``key`` when more than ``limits.count``."""
    bound = active().count
    if bound is not None and count > bound:
        raise ConfigError(
            f"{key}: {count:,} {what} are more than limits.count={bound};"
            f" if that is meant, raise it: limits.count={count}"
        )


def _above(value: float) -> str:
    """A round number of GB at least ``value``, for a suggestion that works when pasted."""
    whole = int(value) + 1
    return str(whole)
