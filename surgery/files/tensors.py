"""Tensors from others' files: what a file declares is checked before it is decompressed or allocated.

Each format says how big its tensors are before any of them is read: a ``.safetensors`` header
lists every shape and dtype, a ``.pt`` (a zip) lists each storage's uncompressed size in its
directory, an ``.npy`` header (also each member of an ``.npz``) gives shape and dtype. A 3 MB
deflated ``.pt`` or ``.npz`` can declare 4 GB; these readers check the declared bytes against the
file (an array larger than the bytes that hold it is refused always) and against
``limits.memory_gb`` (safe mode's 8 GB, or what the user set) before reading, and never unpickle.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from surgery.core.limits import GB, active, check_memory
from surgery.core.tensors import owned
from surgery.errors import ConfigError
from surgery.files import gate
from surgery.files.images import read_png
from surgery.files.paths import must_be_file, read_failure

INPUT_SUFFIXES = (".pt", ".pth", ".npy", ".safetensors", ".png")
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8, "C128": 16,
}  # fmt: skip
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own cap on its JSON header
MAX_EXPANSION = 100  # under a memory limit, zip entries may not inflate more than this many times ...
EXPANSION_FLOOR = 128 * 2**20  # ... past this many bytes: a 3 MB file inflating to 4 GB is a bomb, whatever the budget


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.3g} GB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3g} MB"


def _declared(path: Path, key: str, nbytes: float, what: str = "tensors") -> None:
    """Refuse ``nbytes`` of ``what`` that ``path`` declares, past ``limits.memory_gb``, before reading."""
    check_memory(nbytes, key, f"the {what} {str(path)!r} declares, {_size(path.stat().st_size)} on disk")


def safetensors_header(path: str | Path, key: str, cap: int = MAX_HEADER_BYTES) -> tuple[Any, int, int]:
    """A .safetensors file's parsed JSON header, its length and the file's size; the declared length is checked
    against the file and ``cap`` before anything is parsed (a header claiming 2**62 bytes is one line)."""
    with gate.open_regular(path, key) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= min(cap, size - 8):
            raise ConfigError(f"{key}: cannot read {str(path)!r} as .safetensors (its header length is not valid)")
        try:
            return json.loads(f.read(length)), length, size
        except ValueError as e:
            raise ConfigError(f"{key}: cannot read {str(path)!r} as .safetensors (header: {read_failure(e)})") from None


def safetensors_bytes(path: Path, key: str) -> int:
    """The bytes of every tensor a .safetensors header declares, checked against the file's size."""
    header, length, size = safetensors_header(path, key)
    try:  # the entries of a header from others: any may be missing or of the wrong type
        total = sum(
            math.prod(int(d) for d in entry["shape"]) * SAFETENSORS_DTYPE_BYTES[entry["dtype"]]
            for name, entry in header.items()
            if name != "__metadata__"
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{key}: cannot read {str(path)!r} as .safetensors (header: {read_failure(e)})") from None
    if total > size - 8 - length:
        raise ConfigError(
            f"{key}: {str(path)!r} declares {_size(total)} of tensors in a file of {_size(size)}; it is truncated"
            " or not a safetensors file"
        )
    return total


def torch_zip_entries(path: Path, key: str) -> list[zipfile.ZipInfo]:
    """The entries of a torch zip file (``torch.save``'s format), each with its declared uncompressed size."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot read {str(path)!r} as .pt ({read_failure(e)})") from None


def check_expansion(path: Path, entries: list[zipfile.ZipInfo], key: str) -> int:
    """The uncompressed bytes ``entries`` declare; under a memory limit, refused when they inflate like a bomb."""
    declared = sum(e.file_size for e in entries)
    packed = sum(e.compress_size for e in entries)
    if active().memory_gb is not None and declared > max(EXPANSION_FLOOR, MAX_EXPANSION * packed):
        raise ConfigError(
            f"{key}: {str(path)!r} inflates {_size(packed)} of compressed data to {_size(declared)}"
            f" ({declared // max(packed, 1):,}×, a decompression bomb); a file from others may inflate at most"
            f" {MAX_EXPANSION}× past {_size(EXPANSION_FLOOR)}. Save it again uncompressed (torch.save, np.savez)"
        )
    return declared


def npy_header(f: IO[bytes], where: str, key: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from an .npy header; object arrays (pickles) are refused."""
    try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
    except Exception as e:  # noqa: BLE001 - ValueError, EOFError, SyntaxError from a bad header
        raise ConfigError(f"{key}: cannot read {where} as .npy ({read_failure(e)})") from None
    if dtype.hasobject:
        raise ConfigError(f"{key}: {where} holds Python objects (a pickle); only numeric arrays are read")
    return tuple(int(s) for s in shape), dtype


def npy_bytes(path: Path, key: str) -> int:
    """The bytes an .npy file declares, refused past the bytes the file holds."""
    with gate.open_regular(path, key) as f:
        shape, dtype = npy_header(f, repr(str(path)), key)
        offset = f.tell()
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > path.stat().st_size - offset:
        raise ConfigError(
            f"{key}: {str(path)!r} declares a {list(shape)} {dtype} array ({_size(nbytes)}) in a file of"
            f" {_size(path.stat().st_size)}; it is truncated"
        )
    return nbytes


def npz_bytes(path: Path, names: list[str], key: str) -> int:
    """The bytes the ``names`` members of an .npz declare (their .npy headers, read without decompressing the rest)."""
    total = 0
    try:
        with zipfile.ZipFile(path) as archive:
            for name in names:
                info = archive.getinfo(f"{name}.npy")
                with archive.open(info) as member:
                    where = f"{name!r} in {str(path)!r}"
                    shape, dtype = npy_header(member, where, key)
                    nbytes = math.prod(shape) * dtype.itemsize
                    if nbytes > info.file_size:
                        raise ConfigError(
                            f"{key}: {where} declares a {list(shape)} {dtype} array ({_size(nbytes)}) in a member of"
                            f" {_size(info.file_size)}; it is truncated"
                        )
                    total += nbytes
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ConfigError(f"{key}: cannot read {str(path)!r} as .npz ({read_failure(e)})") from None
    return total


def npz_names(path: Path, key: str) -> list[str]:
    """The array names of an .npz (its members without ``.npy``), from the zip directory alone."""
    try:
        with zipfile.ZipFile(path) as archive:
            return [n[: -len(".npy")] if n.endswith(".npy") else n for n in archive.namelist()]
    except (zipfile.BadZipFile, OSError) as e:
        raise ConfigError(f"{key}: cannot read {str(path)!r} as .npz ({read_failure(e)})") from None


def read_npz(path: Path, names: list[str], key: str) -> dict[str, torch.Tensor]:
    """The ``names`` arrays of an .npz, their declared sizes checked first."""
    _declared(path, key, npz_bytes(path, names, key), "arrays")
    with zipfile.ZipFile(path) as archive:
        check_expansion(path, [archive.getinfo(f"{name}.npy") for name in names], key)
    try:
        with np.load(path, allow_pickle=False) as arrays:
            return {name: owned(torch.from_numpy(arrays[name])) for name in names}
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{key}: cannot read {str(path)!r} as .npz ({read_failure(e)})") from None


def read_npy(path: Path, key: str) -> torch.Tensor:
    """An .npy array, its declared size checked first."""
    _declared(path, key, npy_bytes(path, key), "array")
    try:
        return owned(torch.from_numpy(np.load(path, allow_pickle=False)))  # numpy aligns to 16 bytes only
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{key}: cannot read {str(path)!r} as .npy ({read_failure(e)})") from None


def _check_torch_file(path: Path, key: str) -> None:
    """A .pt/.pth/.bin is a zip whose declared sizes fit; a legacy (pre-zip) file cannot be checked first."""
    if zipfile.is_zipfile(path):
        entries = torch_zip_entries(path, key)
        _declared(path, key, sum(e.file_size for e in entries))
        check_expansion(path, entries, key)
    elif active().memory_gb is not None:
        raise ConfigError(
            f"{key}: {str(path)!r} is not a zip-format torch file (torch.save's format since PyTorch 1.6), so its"
            " size cannot be checked before reading under limits.memory_gb; save it again with torch.save, or as"
            " .safetensors"
        )


def read_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """Read a dict of tensors from .safetensors or a weights-only .pt/.pth; never unpickles objects."""
    must_be_file(path, what)
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors import safe_open

            _declared(path, what, safetensors_bytes(path, what))
            with safe_open(str(path), framework="pt") as f:  # one tensor at a time: peak is one extra copy
                return {key: owned(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118 - not a dict
        _check_torch_file(path, what)
        with warnings.catch_warnings():  # torch warns about pickle protocols it then refuses anyway
            warnings.simplefilter("ignore")
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - every read failure becomes one clear message
        first = read_failure(e)
        raise ConfigError(
            f"{what}: cannot read {str(path)!r} as {suffix or 'a checkpoint'} ({first}). Only tensors are"
            " accepted: .safetensors, or .pt/.pth saved from a state_dict (loaded with weights_only=True)"
        ) from None
    if isinstance(loaded, torch.Tensor):
        return {"tensor": owned(loaded)}
    if isinstance(loaded, dict) and "state_dict" in loaded and isinstance(loaded["state_dict"], dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ConfigError(f"{what}: {str(path)!r} holds a {type(loaded).__name__}, not a tensor or a dict of tensors")
    return {key: owned(value) for key, value in loaded.items()}


def read_input_file(path: Path, key: str | None) -> torch.Tensor:
    """One tensor from .pt/.pth (weights only), .npy, .safetensors or .png (H×W or C×H×W floats), owned and aligned."""
    suffix = path.suffix.lower()
    if suffix not in INPUT_SUFFIXES:
        raise ConfigError(f"input.path: {str(path)!r} is not one of {', '.join(INPUT_SUFFIXES)}")
    must_be_file(path, "input.path")
    if suffix == ".npy":
        return read_npy(path, "input.path")
    if suffix == ".png":
        return read_png(path, "input.path")
    tensors = read_tensors(path, "input.path")
    if key is not None:
        if key not in tensors:
            raise ConfigError(f"input.key: {key!r} is not in {str(path)!r}; keys: {', '.join(tensors)}")
        return tensors[key]
    return next(iter(tensors.values()))
