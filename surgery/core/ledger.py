"""The one owner of everything a surgery changes: hook handles, undo records and captures."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TypeVar

from torch.utils.hooks import RemovableHandle

from surgery.core.records import Record

T = TypeVar("T")


class Ledger:
    """Records every change as an undo callable so ``rollback`` restores the model exactly."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], object]] = []
        self.hook_count: dict[str, int] = {}
        self.captures: dict[str, dict[str, Record]] = {}
        self.touched: set[Hashable] = set()  # tensors, flags and module slots whose old state undo restores
        self.streamed: set[str] = set()  # capture actions written to disk batch by batch
        self.plotted: set[str] = set()  # capture actions whose records are plotted
        self.action = ""
        self.where = ""

    def each(self, action: str, targets: Iterable[T], name: Callable[[T], str]) -> Iterator[T]:
        """Iterate targets while remembering which one is being changed, for error messages."""
        self.action = action
        for target in targets:
            self.where = name(target)
            yield target

    def add_handle(self, handle: RemovableHandle) -> None:
        """Own a hook handle: it is removed on rollback."""
        self._undo.append(handle.remove)
        self.hook_count[self.action] = self.hook_count.get(self.action, 0) + 1

    def add_undo(self, undo: Callable[[], object]) -> None:
        """Own an undo callable for a change made outside hooks (a weight, a new parameter)."""
        self._undo.append(undo)

    def touch(self, state: Hashable) -> None:
        """Note a piece of model state (a tensor's values, a flag, a module slot) this surgery changes."""
        self.touched.add(state)

    def record(self, action: str, key: str, reduce: str = "none") -> Record:
        """The capture record for (action, key), created on first use."""
        per_action = self.captures.setdefault(action, {})
        if key not in per_action:
            per_action[key] = Record(f"{action}/{key}", reduce)
        return per_action[key]

    def rollback(self) -> list[BaseException]:
        """Undo everything in reverse order; keep going past failures and return them."""
        errors: list[BaseException] = []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as e:  # noqa: BLE001 - every other undo must still run
                errors.append(e)
        self.hook_count.clear()
        return errors

    def __len__(self) -> int:
        return len(self._undo)
