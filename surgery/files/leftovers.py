"""What a killed run leaves behind, and how a rerun in the same run directory reads back what it kept.

A run stopped at once (SIGKILL, a power cut) can leave the temporary files of :func:`surgery.files.write.write_atomic`
(``.NAME.XXXXXXXX.tmp``) beside the files it was replacing; they are never read as data (no reader
looks for that name) and :func:`remove_temporary_files` deletes them before a rerun writes. A resume file
(a study's finished cells) is read with :func:`resume_tensors`: a regular file of the run directory, never
a link, its safetensors header checked before anything is mapped.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from surgery.errors import ConfigError
from surgery.files.gate import METADATA_MAX, open_regular, remove_file
from surgery.files.tensors import read_tensors, safetensors_header

# tempfile.mkstemp(prefix=".NAME.", suffix=".tmp"): eight characters of [a-z0-9_] between them
TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
DEPTH = 3  # run dir / activations / MODULE / file, run dir / .rankR / captures / file
SCAN_MAX = 200_000  # entries looked at, at most (a run directory given as a big project folder is not walked whole)


def temporary_files(directory: str | Path, depth: int = DEPTH) -> list[Path]:
    """``write_atomic``'s temporary files under ``directory`` (``depth`` folders down), sorted; links never followed.

    Folders whose name starts with a dot are skipped (``.hydra``, a ``.venv`` of a project folder), except a
    torchrun rank's staging folder ``.rankR``.
    """
    found: list[Path] = []
    seen = 0
    folders = [(Path(directory), 0)]
    while folders:
        folder, level = folders.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:  # gone, or not a folder: nothing of ours there
            continue
        for entry in entries:
            seen += 1
            if seen > SCAN_MAX:
                return sorted(found)
            if entry.is_symlink():
                continue
            if entry.is_dir(follow_symlinks=False):
                hidden = entry.name.startswith(".") and not re.fullmatch(r"\.rank\d+", entry.name)
                if level + 1 < depth and not hidden:
                    folders.append((Path(entry.path), level + 1))
            elif entry.is_file(follow_symlinks=False) and TEMPORARY.match(entry.name):
                found.append(Path(entry.path))
    return sorted(found)


def remove_temporary_files(directory: str | Path) -> list[Path]:
    """Delete ``write_atomic``'s temporary files under ``directory`` (see :func:`temporary_files`); those removed."""
    found = temporary_files(directory)
    for path in found:
        remove_file(path)
    return found


def is_resume_file(path: str | Path, key: str) -> bool:
    """Whether ``path`` exists; refused when it is a link or not a regular file (a run dir prepared by others)."""
    if os.path.islink(path):
        raise ConfigError(f"{key}: {str(path)!r} is a symlink in the run directory; refused (use a fresh one)")
    if not os.path.lexists(path):
        return False
    open_regular(path, key).close()  # a directory, FIFO or device is refused here
    return True


def safetensors_metadata(path: str | Path, key: str) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (string to string), its header size checked before reading."""
    header = safetensors_header(path, key, METADATA_MAX)[0]
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ConfigError(f"{key}: {str(path)!r} has a safetensors header without string metadata; refused")
    return dict(metadata)


def resume_tensors(path: str | Path, key: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A resume file's tensors and metadata (a truncated or hostile file refused in one line)."""

    metadata = safetensors_metadata(path, key)
    return read_tensors(Path(path), key), metadata


def tensor_of(tensors: dict[str, Any], name: str, key: str, path: str | Path) -> torch.Tensor:
    """``tensors[name]``, refused in one line when the file lacks it."""
    found = tensors.get(name)
    if not isinstance(found, torch.Tensor):
        raise ConfigError(f"{key}: {str(path)!r} has no tensor {name!r}; it is not this run's resume file")
    return found


def write_resume_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], key: str) -> None:
    """Replace a resume file whole (temp file + rename): a kill leaves the previous save or this one, never half."""
    from safetensors.torch import save_file

    from surgery.files.write import write_atomic

    flat = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    write_atomic(path, lambda p: save_file(flat, str(p), metadata=dict(metadata)), None, key)
