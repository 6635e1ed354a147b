"""Paths that files from others name: never a URL, and under ``safe=true`` inside the directory they came from.

A data directory (a ``datasets`` directory, an image folder) is trusted no further than its own
tree: an image column holding ``/home/you/.ssh/id_rsa`` or ``../../x.arrow``, or a symlink in a
class sub-folder pointing out, would make the run read a file its author chose. Under
``limits.paths_inside`` (on under safe mode) each such path is resolved with ``os.path.realpath``
and refused unless it lies inside the directory; a URL is refused always (surgery runs offline).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from surgery.core.limits import active, check_memory
from surgery.errors import ConfigError

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # http://, https://, s3://, hf://, file:// ...


def refuse_url(name: str, key: str, what: str) -> None:
    """Refuse a URL where a data file names a file: nothing is ever fetched."""
    if URL.match(name):
        raise ConfigError(
            f"{key}: {what} names {name!r}, a URL; surgery reads local files only and never fetches one"
            " (download it into the data directory first)"
        )


def inside(name: str | Path, directory: Path, key: str, what: str) -> Path:
    """``name`` (taken from ``directory`` when relative) as a real path, refused where it may not lead.

    A URL is refused always; with ``limits.paths_inside`` (safe mode) so is a real path, after every
    symlink, outside ``directory``.
    """
    refuse_url(str(name), key, what)
    path = Path(directory, name)
    real = Path(os.path.realpath(path))
    if active().paths_inside and not real.is_relative_to(os.path.realpath(directory)):
        through = f" (a symlink to {str(real)!r})" if str(real) != os.path.normpath(os.path.abspath(path)) else ""
        raise ConfigError(
            f"{key}: {what} names {str(name)!r}{through}, outside {str(directory)!r}; under safe=true every path"
            " a data file names stays inside its directory. Copy the file in, or drop safe=true if you trust it"
        )
    return real


def must_be_file(path: Path, key: str) -> None:
    """Refuse a directory, a missing file, or a pipe or device (reading one may block or never end), naming ``key``."""
    if path.is_dir():
        raise ConfigError(f"{key}: {str(path)!r} is a directory, not a file")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{key}: {str(path)!r} is not a regular file (a pipe, socket or device is never read)")
    if not path.is_file():
        raise ConfigError(f"{key}: file {str(path)!r} does not exist")


JSON_GROWTH = 32  # Python objects parsed from JSON take up to this many times the text's bytes


def read_json_object(path: Path, key: str) -> dict[str, Any]:
    """A regular file holding one JSON object (a config another tool wrote), its parse bounded by limits.memory_gb."""
    must_be_file(path, key)
    check_memory(JSON_GROWTH * path.stat().st_size, key, f"parsing {str(path)!r}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot read {str(path)!r} as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {str(path)!r} holds a {type(data).__name__}, not a JSON object")
    return data


def read_failure(error: Exception) -> str:
    """Why a file could not be read, in one plain line (torch's weights-only reason, no terminal colours)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    marker = "WeightsUnpickler error:"
    if marker in text:  # torch's reason follows this marker, on the same line or the next
        rest = [line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()]
        return f"{marker} {rest[0]}" if rest else marker
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
