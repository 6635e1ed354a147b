"""The run's own files: written atomically (temp file + rename) and counted against ``limits.disk_gb``.

Every file a run writes (report.json, report.md, captures, capture shards, model.safetensors, plots)
goes through :func:`write_atomic`, which charges its size to the run's disk budget before the file
appears (:func:`surgery.core.limits.charge_disk`): a refusal leaves no half-written file behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from surgery.core.limits import charge_disk, check_disk, written
from surgery.files.gate import writable

SAFETENSORS_ENTRY_BYTES = 128  # a generous bound on one tensor's entry in the safetensors JSON header


def write_atomic(
    path: Path, write: Callable[[Path], object], nbytes: int | None = None, key: str | None = None
) -> None:
    """Write via a temp file in the same directory and rename, so no half file is ever left.

    ``nbytes`` (when known) is charged to the disk budget before anything is written; otherwise the
    temp file's size is, before the rename. ``key`` names what asked for the file in a refusal.
    """
    where = key or path.name
    if nbytes is not None:
        charge_disk(nbytes, where)
    path = writable(path, where)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        if nbytes is None:
            charge_disk(os.path.getsize(tmp), where)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp (and safetensors) make 0600; give open()'s usual mode, as Hydra's
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def expect_disk(nbytes: float, key: str) -> None:
    """Refuse now a run that is going to write ``nbytes`` more (say, one shard a batch) past ``limits.disk_gb``."""
    check_disk(nbytes, written(), key)


def _umask() -> int:
    """The process umask (reading it means setting it; set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str, key: str | None = None) -> None:
    """Atomically write UTF-8 text, its size charged first."""
    write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"), len(text.encode("utf-8")), key)


def write_bytes(path: Path, data: bytes, key: str | None = None) -> None:
    """Atomically write bytes, their size charged first."""
    write_atomic(path, lambda p: p.write_bytes(data), len(data), key)


def write_figure(path: Path, figure: Any, key: str | None = None, dpi: int | None = None) -> None:
    """Atomically write a matplotlib figure as PNG, its size charged before the rename."""
    write_atomic(path, lambda p: figure.savefig(p, format="png", dpi=dpi), None, key)


def make_dir(path: Path, key: str) -> Path:
    """A folder in the run directory (made if missing), refused if it or a folder above it is a symlink."""
    return writable(Path(path, ".keep"), key).parent


def write_json(path: Path, data: Any, key: str | None = None) -> None:
    """Atomically write pretty JSON."""
    write_text(path, json.dumps(data, indent=2, default=str) + "\n", key)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], key: str | None = None) -> None:
    """Atomically write tensors as safetensors (contiguous CPU copies), their size charged before writing."""
    from safetensors.torch import save_file

    size = 8 + sum(t.numel() * t.element_size() + len(k.encode()) + SAFETENSORS_ENTRY_BYTES for k, t in tensors.items())
    charge_disk(size, key or path.name)  # before the copies below: a refused file costs neither memory nor disk
    flat = host_copies(tensors)
    write_atomic(path, lambda p: save_file(flat, str(p)), 0, key)


def host_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory; GPU tensors are copied into pinned memory, all queued, one wait.

    The copies from a GPU run asynchronously (``non_blocking``), so the host waits once per device for all
    of them instead of once per tensor.
    """
    flat: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    devices: set[torch.device] = set()
    for name, value in tensors.items():
        tensor = value.detach()
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            flat[name] = host.copy_(tensor, non_blocking=True)
            devices.add(tensor.device)
            continue
        tensor = tensor.to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in storages:  # safetensors refuses shared memory (block i's output is block i+1's input)
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        flat[name] = tensor
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return flat
