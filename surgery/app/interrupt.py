"""Ctrl-C and SIGTERM during a run: finish the current batch, then stop cleanly; a second one stops at once.

``run_job`` holds an ``Interrupts`` for the whole job. While batches run (``deferring()``) the
first SIGINT or SIGTERM only sets ``signal``, and the batch loop stops after the batch it is in,
so the run writes what finished and a report marked ``"complete": false``. A signal at any other
time, or a second one, raises ``Interrupted`` where the program is, so the job stops at once
(atomic writes remove their temporary file on the way out).
"""

from __future__ import annotations

import signal as signals
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

HANDLED = (signals.SIGINT, signals.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Raised by our handler: a signal that stops the job where it is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signals.Signals(signum).name)
        self.signum = signum


def exit_code(signum: int) -> int:
    """The shell's convention for a process stopped by a signal: 128 + its number (130 SIGINT, 143 SIGTERM)."""
    return 128 + signum


class Interrupts:
    """SIGINT/SIGTERM handlers for one job (main thread only); restores the previous ones on exit."""

    def __init__(self) -> None:
        self.signal: int | None = None  # the first signal received
        self.count = 0  # signals received
        self._deferring = False
        self._raised = False
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str:
        """The first signal's name (``SIGINT``), or an empty string."""
        return signals.Signals(self.signal).name if self.signal is not None else ""

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():  # Python only lets the main thread set handlers
            for signum in HANDLED:
                self._previous[signum] = signals.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signals.signal(signum, handler)
        self._previous.clear()

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """While inside, the first signal waits for ``requested`` to be read (the batch loop's check)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    @property
    def requested(self) -> bool:
        """Whether a signal asked the job to stop."""
        return self.signal is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self._raised:  # already stopping at once: let the cleanup finish
            return
        if self.signal is None:
            self.signal = signum
            if self._deferring:
                return
        self._raised = True
        raise Interrupted(signum)


def remove_temporary_files(directory: Path) -> list[Path]:
    """Delete the temporary files ``write_atomic`` makes (``.NAME.XXXXXXXX.tmp``) under ``directory``; those removed."""
    from surgery.files.leftovers import remove_temporary_files as remove

    return remove(directory)
