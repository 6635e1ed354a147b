"""Safe mode's check of Hydra's logging configs (``hydra.job_logging``, ``hydra.hydra_logging``).

``logging.config.dictConfig`` imports and calls what ``()`` and ``class`` name, imports what ``ext://``
names, and opens what a FileHandler names. Under ``safe=true`` a logging config may name only the
classes below, write only to stdout/stderr and to ``.log`` files inside the run directory (checked by
text when composed, and resolved when Hydra applies it: :func:`check_log_files`). Formats are checked
for everyone: a bad one would otherwise fail on every log line.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from surgery.errors import ConfigError

SAFE_STREAMS = ("ext://sys.stdout", "ext://sys.stderr")
LOG_SUFFIX = ".log"


def refused(where: str, value: Any, allowed: str) -> ConfigError:
    """The one-line safe-mode refusal of a value: the key, the value, what is allowed."""
    return ConfigError(f"{where}: {value!r} refused because safe=true (allowed: {allowed}; set safe=false to allow it)")


def resolved(config: DictConfig, key: str) -> Any:
    """The value at ``key`` resolved where it can be now, else its text (``${hydra.job.num}``); nodes as plain text."""
    try:
        value = OmegaConf.select(config, key, throw_on_resolution_failure=True, throw_on_missing=True)
    except Exception:  # noqa: BLE001 - resolvable only once the job runs
        parent, _, name = key.rpartition(".")
        container = OmegaConf.select(config, parent, throw_on_resolution_failure=False)
        node = container._get_node(name) if isinstance(container, DictConfig) else None
        value = str(node._value()) if node is not None else None
    if isinstance(value, DictConfig) or OmegaConf.is_list(value):
        return OmegaConf.to_container(value, resolve=False)
    return value


def check_log(config: DictConfig, where: str, typed: set[str] | None = None) -> None:
    """The logging config at ``where`` (``hydra.job_logging``: FileHandlers allowed) against the table."""
    found = OmegaConf.select(config, where, default=None, throw_on_resolution_failure=False)
    if found is not None:  # None: no logging config, Hydra's plain default names nothing
        check_log_node(resolved(config, where), where, files=where.endswith("job_logging"))


def check_logging(config: DictConfig) -> None:
    """Under safe mode, refuse a logging config that could run code or write outside the run directory."""
    for key in ("hydra_logging", "job_logging"):
        check_log(config, f"hydra.{key}")


LOG_TOP = ("version", "formatters", "filters", "handlers", "loggers", "root", "incremental", "disable_existing_loggers")
LOG_KEYS = {
    "formatters": ("format", "datefmt", "style", "validate", "class", "defaults"),
    "filters": ("name",),
    "handlers": ("class", "level", "formatter", "filters", "stream", "filename", "mode", "encoding", "delay", "errors"),
    "loggers": ("level", "handlers", "propagate", "filters"),
}
HANDLERS = ("logging.StreamHandler", "logging.FileHandler", "logging.NullHandler")


def check_log_node(node: Any, where: str, files: bool) -> None:
    """One ``logging.config.dictConfig`` mapping against the table; ``files``: whether a FileHandler may appear."""
    classes = HANDLERS if files else tuple(h for h in HANDLERS if h != "logging.FileHandler")
    allowed = f"{', '.join(classes)}, logging.Formatter; streams {' or '.join(SAFE_STREAMS)}"
    if not isinstance(node, Mapping):
        raise refused(where, node, allowed)
    for key, value in node.items():
        at = f"{where}.{key}"
        if key in ("()", "."):
            raise ConfigError(f"{at}: a logging factory or property can run any code; safe=true admits only {allowed}")
        if key not in LOG_TOP:
            raise refused(at, value, "the keys " + ", ".join(LOG_TOP))
        if key in LOG_KEYS and value is not None:
            if not isinstance(value, Mapping):
                raise refused(at, value, f"a mapping of named {key}")
            for name, entry in value.items():
                _check_log_entry(entry, f"{at}.{name}", LOG_KEYS[key], classes, allowed)
        elif key == "root" and value is not None:
            _check_log_entry(value, at, LOG_KEYS["loggers"], classes, allowed)


def _check_log_entry(entry: Any, at: str, keys: tuple[str, ...], classes: tuple[str, ...], allowed: str) -> None:
    if not isinstance(entry, Mapping):
        raise refused(at, entry, allowed)
    for key, value in entry.items():
        where = f"{at}.{key}"
        if key in ("()", "."):
            raise ConfigError(
                f"{where}: a logging factory or property can run any code; safe=true admits only {allowed}"
            )
        if key not in keys:
            raise refused(where, value, "the keys " + ", ".join(keys))
        if isinstance(value, str) and value.startswith("ext://") and value not in SAFE_STREAMS:
            raise ConfigError(f"{where}: {value!r} imports a module; safe=true admits only {allowed} there")
    kind = entry.get("class")
    if "format" in keys:
        if kind not in (None, "logging.Formatter"):
            raise ConfigError(f"{at}.class: {kind!r} is not allowed; safe=true admits only {allowed} there")
        return
    if "class" in keys:
        if kind not in classes:
            raise ConfigError(f"{at}.class: {kind!r} is not allowed; safe=true admits only {allowed} there")
        if kind == "logging.StreamHandler" and entry.get("stream", SAFE_STREAMS[1]) not in SAFE_STREAMS:
            raise refused(f"{at}.stream", entry.get("stream"), " or ".join(SAFE_STREAMS))
        if kind == "logging.FileHandler" and not str(entry.get("filename", "")).endswith(LOG_SUFFIX):
            raise refused(f"{at}.filename", entry.get("filename"), f"a {LOG_SUFFIX} file inside the run directory")
        if entry.get("mode", "a") not in ("a", "w"):
            raise refused(f"{at}.mode", entry.get("mode"), "'a' or 'w'")


def check_log_files(node: Any, where: str, run_dir: Path) -> None:
    """Resolved, when Hydra applies logging: each FileHandler writes a regular ``.log`` file inside ``run_dir``."""
    handlers = node.get("handlers") if isinstance(node, Mapping) else None
    for name, handler in (handlers or {}).items():
        if not isinstance(handler, Mapping) or handler.get("class") != "logging.FileHandler":
            continue
        at = f"{where}.handlers.{name}.filename"
        file = Path(str(handler.get("filename", "")))
        inside = run_dir.resolve() in Path(os.path.realpath(file)).parents
        if not inside or not file.name.endswith(LOG_SUFFIX) or file.is_symlink():
            raise refused(at, str(file), f"a {LOG_SUFFIX} file inside the run directory {run_dir}")
        if file.exists() and not file.is_file():
            raise refused(at, str(file), "a regular file (not a FIFO, device or directory)")


def check_formats(config: DictConfig, safe: bool) -> None:
    """Every logging ``format`` is a valid format string (else logging fails on every line); under ``safe`` it also
    names only LogRecord fields (no filter can add one there)."""
    fields = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
    for key in ("hydra_logging", "job_logging"):
        formatters = OmegaConf.select(
            config, f"hydra.{key}.formatters", default=None, throw_on_resolution_failure=False
        )
        if not isinstance(formatters, DictConfig):
            continue
        for name in map(str, formatters.keys()):
            at = f"hydra.{key}.formatters.{name}"
            entry = resolved(config, at)
            if not isinstance(entry, Mapping) or "format" not in entry:
                continue
            text, style = resolved(config, f"{at}.format"), resolved(config, f"{at}.style") if "style" in entry else "%"
            if not isinstance(text, str) or "${" in text or style not in ("%", "{", "$"):
                continue  # not resolvable yet, or a style logging itself refuses (one line when applied)
            try:
                logging.Formatter(text, style=style, validate=True)  # type: ignore[arg-type]
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{at}.format: {text!r} is not a valid logging format ({e})") from None
            unknown = sorted(set(re.findall(r"%\((\w+)\)", text)) - fields) if style == "%" and safe else []
            if unknown:
                raise ConfigError(
                    f"{at}.format: {text!r} names {', '.join(unknown)}, which a log record does not have"
                    " (fields: asctime, levelname, message, name, ...)"
                )
