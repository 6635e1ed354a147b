"""Memory-mapped safetensors files from others: every header entry checked against the file before a view is made.

A shard of an activation dataset is mapped, not read: an item touches only its own bytes. The header
is data, so each entry's dtype, shape and offsets are checked (known dtype, whole non-negative sizes,
offsets inside the file, the bytes the shape needs) before :func:`torch.frombuffer` sees them; a
mismatch is one line naming the file and the tensor, never a traceback or a read past the end.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import torch

from surgery.errors import ConfigError
from surgery.files import gate

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32}  # fmt: skip
HEADER_MAX = 100 * 2**20  # safetensors' own cap on its JSON header


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _header(file: Any, path: Path, key: str, size: int) -> tuple[dict[str, Any], int]:
    head = file.read(8)
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 0 < length <= min(HEADER_MAX, size - 8):
        raise ConfigError(f"{key}: {str(path)!r} is not a safetensors file (its header length is not valid)")
    try:
        header = json.loads(file.read(length), parse_constant=_no_constant)
    except RecursionError:
        raise ConfigError(f"{key}: {str(path)!r} has a safetensors header nested too deeply; refused") from None
    except ValueError as e:
        raise ConfigError(f"{key}: {str(path)!r} has a safetensors header that is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{key}: {str(path)!r} has a safetensors header that is not a JSON object")
    return header, 8 + length


def _entry(name: str, entry: Any, path: Path, key: str, data_bytes: int) -> tuple[torch.dtype, list[int], int, int]:
    where = f"{key}: tensor {name!r} in {str(path)!r}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is described by a {type(entry).__name__}, not an object")
    dtype = DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise ConfigError(f"{where} has dtype {entry.get('dtype')!r}; one of {', '.join(DTYPES)} is read")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > 8:
        raise ConfigError(f"{where} has shape {shape!r}; a list of at most 8 sizes is read")
    dims = [gate.whole(d, f"{where} shape", 0, 2**40) for d in shape]
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise ConfigError(f"{where} has data_offsets {offsets!r}; [begin, end] is read")
    begin = gate.whole(offsets[0], f"{where} data_offsets", 0, data_bytes)
    end = gate.whole(offsets[1], f"{where} data_offsets", begin, data_bytes)
    needed = math.prod(dims) * dtype.itemsize
    if end - begin != needed:
        raise ConfigError(
            f"{where} has shape {dims} of {str(dtype).removeprefix('torch.')} ({needed} bytes) but data_offsets"
            f" [{begin}, {end}] hold {end - begin} bytes; the file is damaged"
        )
    return dtype, dims, begin, end


def map_safetensors(path: str | Path, key: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views into a private memory map of it (nothing read until used).

    Only a regular file is mapped (a FIFO is refused, never waited on); every header entry is checked first.
    """
    path = Path(path)
    with gate.open_regular(path, key) as file:
        size = os.fstat(file.fileno()).st_size
        header, start = _header(file, path, key, size)
        entries = {
            name: _entry(str(name), entry, path, key, size - start)
            for name, entry in header.items()
            if name != "__metadata__"
        }
        memory = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) if size > start else None
    tensors: dict[str, torch.Tensor] = {}
    for name, (dtype, dims, begin, end) in entries.items():
        if end == begin or memory is None:
            tensors[name] = torch.empty(dims, dtype=dtype)
            continue
        with warnings.catch_warnings():  # a private copy-on-write map: torch's "not writable" warning does not apply
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(memory, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start + begin)
        tensors[name] = flat.view(dims)
    return tensors
