"""Rows streamed to the harvest loop: cut into shards, and made one shard ahead by a background thread."""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch


def in_shards(rows: Iterator[torch.Tensor], per_shard: int) -> Iterator[torch.Tensor]:
    """The rows ``per_shard`` at a time as one int64 ``[n, context]`` tensor (the last may be shorter)."""
    chunk: list[torch.Tensor] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == per_shard:
            yield torch.stack(chunk)
            chunk = []
    if chunk:
        yield torch.stack(chunk)


def prefetched(items: Iterator[Any]) -> Iterator[Any]:
    """``items`` made one ahead by a background thread: reading and tokenizing the next shard's rows overlaps the
    forwards of this one. An exception there is raised here; leaving early stops the thread."""
    ahead: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
    leaving = threading.Event()

    def put(entry: tuple[str, Any]) -> bool:
        while not leaving.is_set():
            try:
                ahead.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def fill() -> None:
        try:
            for item in items:
                if not put(("item", item)):
                    return
            put(("done", None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            put(("error", e))

    thread = threading.Thread(target=contextvars.copy_context().run, args=(fill,), name="harvest-rows", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = ahead.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        leaving.set()
        thread.join()


def chained(first: torch.Tensor, rest: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    """``first``, then the rest."""
    yield first
    yield from rest
