"""Under safe mode, paths a config file names stay inside the directory the run starts in.

A key named ``path``, ``checkpoint``, ``file``, ``tokenizer`` or ``dir`` anywhere in the job config
(``model.checkpoint``, ``input.path``, ``actions.NAME.from.file``, ...) that a config file set must be a
relative path without ``..`` or ``~``: it is read from the start directory and cannot reach outside
it. A path typed on the command line is the user's own choice and is taken as it is. Replay has no
command line: every path of a saved config is checked (``--trust`` runs it as saved).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from surgery.errors import ConfigError

PATH_KEYS = ("path", "checkpoint", "file", "tokenizer", "dir")
GROUPS = {
    "model",
    "actions",
    "input",
    "source",
    "study",
    "experiment",
}  # +GROUP=NAME picks a file: its paths are checked
ALLOWED = "a config file may name only a relative path without '..' inside the start directory"


def check_config_paths(config: Any, typed: set[str], where: str = "", hint: str = "") -> None:
    """Refuse a path-like value set by a file (not ``typed`` on the command line) that could leave the start dir."""
    if isinstance(config, dict):
        for key, value in config.items():
            at = f"{where}.{key}" if where else str(key)
            if at == "hydra" or _typed(at, typed):
                continue
            if str(key) in PATH_KEYS and isinstance(value, str):
                _inside(value, at, hint)
            else:
                check_config_paths(value, typed, at, hint)
    elif isinstance(config, list):
        for i, value in enumerate(config):
            check_config_paths(value, typed, f"{where}[{i}]", hint)


def _typed(key: str, typed: set[str]) -> bool:
    """Whether ``key`` (or a node above it) was set on the command line (choosing a group's file is not setting it)."""
    parts = key.split(".")
    return any(".".join(parts[:n]) in typed - GROUPS for n in range(1, len(parts) + 1))


def _inside(value: str, where: str, hint: str) -> None:
    path = Path(value)
    if path.is_absolute() or value.startswith("~") or ".." in path.parts or "://" in value:
        then = hint or "; type it on the command line if you mean it"
        raise ConfigError(f"{where}: {value!r} is refused because safe=true: {ALLOWED}{then}")
