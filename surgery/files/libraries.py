"""Libraries that open files themselves (safetensors' lazy reader, ``datasets``), called only past the gate.

Each helper first checks, through :mod:`surgery.files.gate`, what the library will open (a regular file,
a header that fits the file), then hands the checked path over and turns the library's failure into one line.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from surgery.errors import ConfigError
from surgery.files.gate import open_regular
from surgery.files.paths import read_failure

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own cap on its JSON header


@contextlib.contextmanager
def safetensors_reader(path: str | Path, key: str) -> Iterator[Any]:
    """A ``.safetensors`` file opened lazily (``safe_open``) once it is a regular file whose header fits it."""
    from safetensors import safe_open

    with open_regular(path, key) as file:
        size = os.fstat(file.fileno()).st_size
        head = file.read(8)
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
        raise ConfigError(f"{key}: cannot read {str(path)!r} as .safetensors (its header length is not valid)")
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file: one line
        raise ConfigError(f"{key}: cannot read {str(path)!r} as .safetensors ({read_failure(e)})") from None
    with handle as reader:
        yield reader


def load_datasets_dir(path: str | Path, key: str) -> Any:
    """A Hugging Face ``datasets`` directory (``save_to_disk``), memory-mapped by ``datasets`` itself."""
    from datasets import load_from_disk

    try:
        return load_from_disk(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:  # a directory whose JSON does not match its files
        raise ConfigError(f"{key}: cannot read {str(path)!r} as a datasets directory ({read_failure(e)})") from None


def gzip_text(path: str | Path, key: str) -> IO[str]:
    """A gzip-compressed UTF-8 text file (a package's bundled data), opened through the gate."""
    import gzip

    return gzip.open(open_regular(path, key), "rt", encoding="utf-8")
