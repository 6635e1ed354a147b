"""Running elementwise statistics over calls (``reduce: mean|stats``): each call's float64 copy, folded when read."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from surgery.errors import SurgeryError

STACK_NUMEL = 1 << 14  # calls this small are folded several at a time (the launches cost more than the arithmetic)


def _runs(calls: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive calls of the same shape, in order."""
    runs: list[list[torch.Tensor]] = []
    for x in calls:
        if runs and runs[-1][0].shape == x.shape:
            runs[-1].append(x)
        else:
            runs.append([x])
    return runs


class Running:
    """Elementwise mean (and with ``stats`` std/min/max) over calls and the batch dim, without keeping the tensors.

    ``mean`` keeps float64 sums of x and x² (two reductions a call: what a hand-written mean costs, and
    enough for ``moments``); ``stats`` merges batches with Chan et al.'s pairwise update, in float64.
    A call only keeps its float64 copy. The copies are folded in, oldest first and to the bits that folding each call
    as it came gives, when the statistics are read or they pass ``HELD_BYTES``; ``moments`` leaves min and max
    owed until ``summary`` asks (a training log reads only the moments). Folded inside the forward pass, each call
    paid a dozen kernel launches with the framework's code in between.
    Safe when the model runs in several threads: calls are appended and folded under a lock.
    """

    HELD_BYTES = 1 << 20  # at most this much of float64 copies waits to be folded (plus the last call), per statistic

    def __init__(self, stats: bool = True) -> None:
        self._lock = threading.Lock()
        self.stats = stats
        self._count = 0
        self._shape: torch.Size | None = None  # every call's shape but the batch dim
        self._pending: list[torch.Tensor] = []  # float64 copies not folded in yet, oldest first
        self._owed: list[tuple[torch.Tensor, bool]] = []  # (copy or stack of copies, stacked): min and max not yet
        self._held = 0  # bytes in _pending and _owed
        self._sum: torch.Tensor | None = None  # mean only: the float64 sums over every row so far
        self._sumsq: torch.Tensor | None = None
        self._mean: torch.Tensor | None = None
        self._m2: torch.Tensor | None = None
        self._min: torch.Tensor | None = None
        self._max: torch.Tensor | None = None

    def add(self, tensor: torch.Tensor) -> None:
        """Take in one call's tensor (a float64 copy); dim 0 is the batch."""
        x = tensor.detach()
        x = x.clone() if x.dtype == torch.float64 else x.double()  # a copy: the model may write its tensor in place
        shape = x.shape
        if not shape:
            x = x.unsqueeze(0)
        elif self.stats and not shape[0]:
            torch.aminmax(x, dim=0)  # a call without rows fails here, in its hook, as folding it at once did
        rest = shape[1:]
        with self._lock:
            if rest != self._shape:
                if self._shape is not None:
                    seen, now = list(self._shape), list(rest)
                    raise SurgeryError(f"reduce needs the same shape on every call: {seen} then {now}")
                self._shape = rest
            self._pending.append(x)
            self._held += x.numel() * 8
            if self._held > self.HELD_BYTES or x.device.type != "cpu":  # off the CPU launches are asynchronous:
                self._fold(extremes=True)  # fold at once and keep the card's memory free

    def _fold(self, extremes: bool) -> None:
        """Fold the waiting copies into the moments, oldest first; with ``extremes`` also min and max owed so far.

        The caller holds the lock.
        """
        pending, self._pending = self._pending, []
        if not self.stats:  # a sum per call: the deviations, min and max would be thrown away
            for x in pending:
                total, squares = x.sum(0), (x * x).sum(0)
                if self._sum is None or self._sumsq is None:
                    self._sum, self._sumsq = total, squares
                else:
                    self._sum, self._sumsq = self._sum + total, self._sumsq + squares
                self._count += x.shape[0]
            self._held = 0
            return
        for run in _runs(pending):
            cpu = run[0].device.type == "cpu" and type(run[0]) is torch.Tensor  # numpy can view its memory
            if len(run) > 1 and cpu and run[0].numel() <= STACK_NUMEL and all(x.is_contiguous() for x in run):
                # small calls of one shape: each call's moments in four operations for all of them, not four each;
                # a CPU reduction over dim 1 of the stack gives each slice the bits of dim 0 of the (contiguous) call
                stacked = torch.stack(run)
                means = stacked.mean(1)
                deviations = stacked - means.unsqueeze(1)
                m2s = deviations.mul_(deviations).sum(1)
                self._merge_on_cpu(list(zip([x.shape[0] for x in run], means.numpy(), m2s.numpy())))
                self._owed.append((stacked, True))
                continue
            for x in run:
                mean = x.mean(0)
                deviations = x - mean
                m2 = deviations.mul_(deviations).sum(0)  # the values of ((x - mean) ** 2).sum(0), one tensor fewer
                if cpu:
                    self._merge_on_cpu([(x.shape[0], mean.numpy(), m2.numpy())])
                else:
                    self._merge(x.shape[0], mean, m2)
                self._owed.append((x, False))
        if extremes:
            self._settle_extremes()

    def _merge_on_cpu(self, calls: list[tuple[int, Any, Any]]) -> None:
        """``_merge`` of each call in turn, in numpy: the same IEEE operations one by one, each a microsecond where a
        tensor operation on a few values costs several."""
        count = self._count
        mean = None if self._mean is None else self._mean.numpy()
        m2 = None if self._m2 is None else self._m2.numpy()
        for n, call_mean, call_m2 in calls:
            if mean is None or m2 is None:
                count, mean, m2 = n, call_mean, call_m2
                continue
            total = count + n
            delta = call_mean - mean
            mean = mean + delta * (n / total)
            m2 = (m2 + call_m2) + (delta * delta) * (count * n / total)  # delta**2 is delta * delta in torch too
            count = total
        self._count = count
        self._mean, self._m2 = torch.from_numpy(np.asarray(mean)), torch.from_numpy(np.asarray(m2))

    def _merge(self, n: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Chan et al.'s update of the moments (off the CPU); results go into tensors of this call."""
        if self._mean is None or self._m2 is None:
            self._count, self._mean, self._m2 = n, mean, m2
            return
        total = self._count + n
        delta = mean - self._mean
        step = delta * (n / total)
        self._mean = torch.add(self._mean, step, out=step)  # self.mean + delta * (n / total), operands in that order
        spread = delta.pow_(2).mul_(self._count * n / total)
        self._m2 = torch.add(self._m2, m2, out=m2).add_(spread)  # (m2 + m2') + delta² c
        self._count = total

    def _settle_extremes(self) -> None:
        """Min and max of every owed call, in the order they came (the caller holds the lock)."""
        for held, stacked in self._owed:
            if stacked:
                lows, highs = torch.aminmax(held, dim=1)
                pairs = list(zip(lows.unbind(0), highs.unbind(0)))
            else:
                pairs = [torch.aminmax(held, dim=0)]  # amin and amax in one pass
            for low, high in pairs:
                if self._min is None or self._max is None:
                    self._min, self._max = low, high
                else:
                    self._min = torch.minimum(self._min, low, out=low)
                    self._max = torch.maximum(self._max, high, out=high)
        self._owed, self._held = [], 0

    @property
    def count(self) -> int:
        """Rows seen so far (every call's batch dim)."""
        with self._lock:
            return self._count + sum(x.shape[0] for x in self._pending)

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float64 elementwise mean and sum of squared deviations (M2) over every row so far."""
        with self._lock:
            self._fold(extremes=False)
            if self.stats:
                assert self._mean is not None and self._m2 is not None
                return self._mean, self._m2
            assert self._sum is not None and self._sumsq is not None
            mean = self._sum / self._count
            return mean, (self._sumsq - self._sum * mean).clamp_min(0.0)

    def summary(self) -> dict[str, torch.Tensor]:
        """``mean`` (and with ``stats`` also ``std``, ``min``, ``max``) as float32 tensors."""
        with self._lock:  # one consistent state, even while other threads still add
            self._fold(extremes=True)
            if not self.stats:
                assert self._sum is not None
                return {"mean": (self._sum / self._count).float()}
            assert self._mean is not None and self._m2 is not None and self._min is not None and self._max is not None
            std = (self._m2 / max(self._count - 1, 1)).sqrt()
            return {"mean": self._mean.float(), "std": std.float(), "min": self._min.float(), "max": self._max.float()}
