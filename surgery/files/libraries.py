"""Libraries that open files themselves (safetensors' lazy reader, ``datasets``), called only past the gate.

Each helper first checks, through :mod:`surgery.files.gate`, what the library will open (a regular file,
a header that fits the file), then hands the checked path over and turns the library's failure into one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from surgery.errors import ConfigError
from surgery.files.gate import open_regular
from surgery.files.paths import read_failure
from surgery.files.tensors import safetensors_header


@contextlib.contextmanager
def safetensors_reader(path: str | Path, key: str) -> Iterator[Any]:
    """A ``.safetensors`` file opened lazily (``safe_open``) once it is a regular file whose header fits it."""
    from safetensors import safe_open

    safetensors_header(path, key)  # a regular file whose header fits it, parsed before safetensors maps it
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
