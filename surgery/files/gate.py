"""The gate: the one place a path becomes an open file, a listing or a write.

Four narrow doors, each checking the value that is actually used (after every substitution, with
symlinks resolved), not the text a config held:

- :func:`config_path`: a path a config file names (any key, a list element, a study grid value, an
  interpolation's result) stays inside the start directory under ``safe=true``; a path the user typed
  on the command line is theirs (:func:`confined` says which keys were typed).
- :func:`member`: a name read from inside a data file (a manifest's shard, a ``cfg.json`` value) is a
  plain name joined to its directory, never a path: ``..``, absolute names and links out are refused.
- :func:`open_regular` (and :func:`read_bytes`, :func:`read_text`, :func:`read_json`, :func:`text_lines`):
  regular files only (a FIFO, socket or device is never opened for reading and so never blocks),
  metadata sizes capped before parsing, contents that do not parse refused in one line.
- :func:`walk`: the regular files under a directory, never following a link out of it.

Writes (:mod:`surgery.files.write`) go through :func:`writable`: nothing is written through a symlink
inside the run directory (:func:`writing_into`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import stat
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from surgery.errors import ConfigError
from surgery.files.paths import refuse_url

PACKAGE = os.path.realpath(Path(__file__).resolve().parent.parent)  # surgery's own files (shipped weights, conf)
MiB = 2**20
METADATA_MAX = 4 * MiB  # a cfg.json, manifest, state.json or report.json: a few MiB at most
LINE_MAX = 1 * MiB  # one line of a corpus; a longer one is refused naming file and line
GROUPS = frozenset({"model", "actions", "input", "source", "study", "experiment", "vectors"})


@dataclass(frozen=True)
class Confinement:
    """Where config-named paths must stay (the start directory, real) and which keys the user typed."""

    start: str
    typed: frozenset[str]


_CONFINED: ContextVar[Confinement | None] = ContextVar("surgery_confined", default=None)
_RUN_DIR: ContextVar[str | None] = ContextVar("surgery_run_dir", default=None)


@contextlib.contextmanager
def confined(start: str | Path, typed: set[str] | frozenset[str] = frozenset()) -> Iterator[Confinement]:
    """Inside the block, paths named by config keys (other than ``typed`` ones) must stay inside ``start``."""
    token = _CONFINED.set(Confinement(os.path.realpath(start), frozenset(typed) - GROUPS))
    try:
        yield _CONFINED.get()  # type: ignore[misc]
    finally:
        _CONFINED.reset(token)


def confinement() -> Confinement | None:
    """The confinement in force (None outside :func:`confined`: the Python API's own paths are the caller's)."""
    return _CONFINED.get()


def _typed(key: str, typed: frozenset[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:n]) in typed for n in range(1, len(parts) + 1))


def _through(path: str | Path, real: str) -> str:
    plain = os.path.normpath(os.path.abspath(path))
    return f" (a symlink to {real!r})" if real != plain else ""


def config_path(value: str | Path, key: str) -> Path:
    """The path a config key names, as given; under confinement refused unless its real path stays inside.

    Call it on the value in hand, after every substitution: the check is on the real path (links resolved).
    """
    text = str(value)
    limit = _CONFINED.get()
    if limit is None or _typed(key, limit.typed):
        return Path(text)
    refuse_url(text, key, "the config")
    real = os.path.realpath(text)
    if not _within(real, limit.start) and not _within(real, PACKAGE):  # the package's files are the program's
        raise ConfigError(
            f"{key}: {text!r}{_through(text, real)} is outside the start directory {limit.start!r}, refused because"
            f" safe=true: a config file may name only paths inside it; to use it anyway, type it on the command"
            f" line: {key}={text}"
        )
    return Path(text)  # as given (messages name what the user wrote); the check was on its real path


def _within(real: str, directory: str) -> bool:
    return real == directory or real.startswith(directory.rstrip(os.sep) + os.sep)


def member(directory: str | Path, name: object, key: str, what: str = "a name") -> Path:
    """``name`` from inside a data file, as a file of ``directory``: a plain relative name that stays inside."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ConfigError(f"{key}: {what} must be a non-empty file name, not {name!r}")
    parts = Path(name).parts
    if os.path.isabs(name) or ".." in parts or name.startswith("~") or "\\" in name:
        raise ConfigError(f"{key}: {what} {name!r} is not a plain name inside {str(directory)!r}; refused")
    path = Path(directory, name)
    real = os.path.realpath(path)
    if not _within(real, os.path.realpath(directory)):
        raise ConfigError(f"{key}: {what} {name!r} leads outside {str(directory)!r}{_through(path, real)}; refused")
    return Path(real)


def open_regular(path: str | Path, key: str) -> IO[bytes]:
    """``path`` opened for binary reading, refused unless it is a regular file (checked on the open file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, then is refused
    except FileNotFoundError:
        raise ConfigError(f"{key}: file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{key}: {str(path)!r} is a directory, not a file") from None
    except OSError as e:
        raise ConfigError(f"{key}: cannot open {str(path)!r} ({e.strerror or type(e).__name__})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a pipe, socket or device)"
        raise ConfigError(f"{key}: {str(path)!r} is {kind}; only regular files are read")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb")


def regular_file(path: str | Path, key: str) -> Path:
    """``path`` if it is a regular file (for libraries that open it themselves), refused otherwise."""
    open_regular(path, key).close()
    return Path(path)


def _capped(file: IO[bytes], path: str | Path, key: str, cap: int | None, what: str) -> bytes:
    size = os.fstat(file.fileno()).st_size
    if cap is not None and size > cap:
        raise ConfigError(
            f"{key}: {str(path)!r} is {size / MiB:.3g} MiB, more than the {cap / MiB:g} MiB {what} may be; refused"
        )
    return file.read() if cap is None else file.read(cap + 1)


def read_bytes(path: str | Path, key: str, cap: int | None = METADATA_MAX, what: str = "such a file") -> bytes:
    """A regular file's bytes, refused when larger than ``cap`` (checked before reading)."""
    with open_regular(path, key) as file:
        return _capped(file, path, key, cap, what)


def read_text(path: str | Path, key: str, cap: int | None = METADATA_MAX, what: str = "such a file") -> str:
    """A regular file's UTF-8 text (capped like :func:`read_bytes`); invalid UTF-8 is refused naming the line."""
    data = read_bytes(path, key, cap, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{key}: {str(path)!r} line {line} is not valid UTF-8; refused") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def read_json(path: str | Path, key: str, cap: int | None = METADATA_MAX) -> Any:
    """A small JSON file (a manifest, a ``cfg.json``): capped, strict (no NaN), nesting bounded, one-line errors."""
    text = read_text(path, key, cap, "a JSON metadata file")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ConfigError(f"{key}: {str(path)!r} is nested too deeply to read; refused") from None
    except ValueError as e:
        raise ConfigError(f"{key}: cannot read {str(path)!r} as JSON ({str(e).splitlines()[0]})") from None


def read_json_object(path: str | Path, key: str, cap: int | None = METADATA_MAX) -> dict[str, Any]:
    """:func:`read_json` that must hold one JSON object."""
    data = read_json(path, key, cap)
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {str(path)!r} holds a JSON {type(data).__name__}, not an object")
    return data


def text_lines(path: str | Path, key: str, max_line: int = LINE_MAX) -> Iterator[str]:
    """A text file's lines, streamed: an over-long line or invalid UTF-8 is refused naming file and line."""
    with open_regular(path, key) as file:
        number = 0
        while True:
            raw = file.readline(max_line + 1)
            if not raw:
                return
            number += 1
            if len(raw) > max_line and not raw.endswith(b"\n"):
                raise ConfigError(
                    f"{key}: {str(path)!r} line {number} is longer than {max_line} bytes; refused (split the text"
                    " into lines)"
                )
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{key}: {str(path)!r} line {number} is not valid UTF-8; refused") from None


def listing(directory: str | Path, key: str, missing_ok: bool = False) -> list[str]:
    """The names in ``directory``, sorted (one level; nothing is followed or opened); none if missing and allowed."""
    try:
        return sorted(os.listdir(directory))
    except FileNotFoundError:
        if missing_ok:
            return []
        raise ConfigError(f"{key}: directory {str(directory)!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"{key}: cannot list {str(directory)!r} ({e.strerror or type(e).__name__})") from None


def walk(directory: str | Path, key: str, suffix: str = "", limit: int | None = None) -> list[Path]:
    """Every regular file under ``directory`` ending in ``suffix``, sorted; a link leading out is refused.

    Links to directories are not descended into; a link to a file is followed only when it stays inside.
    ``limit`` bounds how many entries are looked at (a directory of millions is refused, not listed).
    """
    top = os.path.realpath(directory)
    found: list[Path] = []
    seen = 0
    for root, dirs, files in os.walk(directory, followlinks=False):
        seen += len(dirs) + len(files)
        if limit is not None and seen > limit:
            raise ConfigError(f"{key}: {str(directory)!r} holds more than {limit} entries; refused")
        for name in dirs:
            path = os.path.join(root, name)
            if os.path.islink(path) and not _within(os.path.realpath(path), top):
                raise ConfigError(f"{key}: {path!r} is a link leading outside {str(directory)!r}; refused")
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            if not name.endswith(suffix):
                continue
            real = os.path.realpath(path)
            if not _within(real, top):
                raise ConfigError(f"{key}: {path!r} is a link leading outside {str(directory)!r}; refused")
            if os.path.isfile(real):
                found.append(Path(path))
    return found


# ---------------------------------------------------------------- writes


@contextlib.contextmanager
def writing_into(run_dir: str | Path) -> Iterator[None]:
    """Inside the block, every write below ``run_dir`` refuses a symlink on its way (a run dir from others)."""
    token = _RUN_DIR.set(os.path.abspath(run_dir))
    try:
        yield
    finally:
        _RUN_DIR.reset(token)


def writable(path: str | Path, key: str) -> Path:
    """``path`` ready to be written (its folders made), refused if it or a folder on its way is a symlink.

    Inside :func:`writing_into` every folder from the run directory down is checked; elsewhere the file
    and its own folder. The run directory itself may be reached through links the user chose.
    """
    target = os.path.abspath(path)
    run = _RUN_DIR.get()
    if run is None or not _within(target, run):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        _not_a_link(os.path.dirname(target), key, run_dir=False)
        _not_a_link(target, key, run_dir=False)
        return Path(target)
    os.makedirs(run, exist_ok=True)  # the run directory itself: the user's choice, links on its way included
    here = run
    for part in os.path.relpath(target, run).split(os.sep) if target != run else []:
        here = os.path.join(here, part)
        _not_a_link(here, key)
        if here != target and not os.path.isdir(here):
            try:
                os.mkdir(here)
            except FileExistsError:
                _not_a_link(here, key)
    return Path(target)


def _not_a_link(path: str, key: str, run_dir: bool = True) -> None:
    if os.path.islink(path):
        where = "in the run directory" if run_dir else "on the way"
        raise ConfigError(
            f"{key}: {path!r} is a symlink {where}; surgery never writes through a link (a run directory"
            " prepared by someone else), refused: remove the link or use a fresh run directory"
        )


def move(source: str | Path, target: str | Path, key: str) -> None:
    """Rename ``source`` (a file the run wrote whole) onto ``target`` in the run directory, never through a link."""
    os.replace(source, writable(target, key))


def remove_file(path: str | Path) -> None:
    """Remove one file the run wrote (a link is removed itself, never followed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_tree(path: str | Path) -> None:
    """Remove a folder the run made, links inside removed as links (never followed)."""
    import shutil

    if os.path.islink(path):
        os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def temp_dir(prefix: str) -> Path:
    """A new private folder under the system's temporary directory (a replay's scratch run directory)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=prefix))


def remove_empty_dir(path: str | Path) -> bool:
    """Remove ``path`` if it is an empty folder (never a link); whether it was removed."""
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def null_output(fd: int) -> None:
    """Point file descriptor ``fd`` at the null device (a reader of our output left)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)


@contextlib.contextmanager
def stderr_muted() -> Iterator[None]:
    """File descriptor 2 pointed at the null device inside the block: a native library's panic report (Rust
    prints its backtrace itself, before Python sees the exception) cannot spill past our one line."""
    import sys

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def finite(value: object, key: str, low: float = -math.inf, high: float = math.inf) -> float:
    """A number read from a data file: a real int or float, finite, in ``[low, high]``; refused otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, not {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{key}: {value!r} is out of range [{low:g}, {high:g}]")
    return value


def whole(value: object, key: str, low: int = 0, high: int = 2**62) -> int:
    """A count or offset read from a data file: an int (not a bool) in ``[low, high]``; refused otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: must be a whole number, not {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{key}: {value!r} is out of range [{low}, {high}]")
    return value
