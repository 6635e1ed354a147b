"""Safe mode's check of the composed ``hydra.*`` tree: an allowlist of keys and values (docs/sharing.md).

Hydra acts on its own node before surgery's job starts: it configures logging, builds launchers,
sweepers and callbacks (instantiating nested ``_target_`` nodes), sets environment variables and
creates directories. Under ``safe=true`` every key of the composed ``hydra`` node must be on the
table below, with a value that cannot run code, open a socket or write outside the run directory.
Values are read resolved where they can be now (``${now:...}``) and as their text where not
(``${hydra.job.num}``); logging file names are checked again, resolved, when Hydra applies them.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from surgery.errors import ConfigError
from surgery.safe.logging_tree import check_log, refused, resolved

PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
SLURM_WORD = re.compile(r"[\w.,:=@%+-]*")  # written into an sbatch script: no spaces, quotes or newlines

# The table: each key of the hydra node, what safe=true admits there (the message says it).
HYDRA_KEYS = {
    "run": "run.dir: any path from the command line; from a file a relative path without '..'",
    "sweep": "sweep.dir as run.dir; sweep.subdir a relative path without '..'",
    "launcher": "the basic, joblib or submitit launcher with plain settings",
    "sweeper": "the basic sweeper",
    "help": "any text",
    "hydra_help": "any text",
    "hydra_logging": "StreamHandler to ext://sys.stdout/stderr, NullHandler, Formatter",
    "job_logging": "StreamHandler to ext://sys.stdout/stderr, NullHandler, Formatter, FileHandler to a .log file"
    " inside the run directory",
    "env": "nothing (empty)",
    "mode": "RUN; MULTIRUN only from the command line (-m)",
    "searchpath": "file:// directories only",
    "callbacks": "hydra.experimental.callbacks.LogJobReturnCallback only",
    "output_subdir": "null or a plain relative name such as .hydra",
    "overrides": "what Hydra fills in",
    "job": "job.name a plain name, job.chdir, job.config.*; env_set and env_copy empty",
    "runtime": "what Hydra fills in",
    "verbose": "any value",
}
JOB_KEYS = {
    "name": "a plain name (letters, digits, _ . -)",
    "chdir": "true, false or null",
    "override_dirname": "what Hydra fills in",
    "id": "what Hydra fills in",
    "num": "what Hydra fills in",
    "config_name": "what Hydra fills in",
    "env_set": "nothing: an environment variable (RANK, MASTER_ADDR, ...) can make the job join a process group",
    "env_copy": "nothing: an environment variable (RANK, MASTER_ADDR, ...) can make the job join a process group",
    "config": "any override_dirname setting",
}


def _any(value: Any) -> str | None:
    return None


def _integer(low: int, high: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high)
        return None if ok else f"null or an integer from {low} to {high}"

    return check


def _number(value: Any) -> str | None:
    ok = value is None or isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf
    return None if ok else "null or a number >= 0"


def _one_of(*choices: Any) -> Callable[[Any], str | None]:
    return lambda value: None if value in choices else f"one of {', '.join(map(repr, choices))}"


def _word(value: Any) -> str | None:
    ok = value is None or isinstance(value, (int, float)) or isinstance(value, str) and SLURM_WORD.fullmatch(value)
    return None if ok else r"null, a number or a word of letters, digits and _ . , : = @ % + -"


def _name(value: Any) -> str | None:
    return None if isinstance(value, str) and PLAIN_NAME.fullmatch(value) else "a plain name (letters, digits, _ . -)"


def _n_jobs(value: Any) -> str | None:
    cpus = os.cpu_count() or 1
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= abs(value) <= cpus
    return None if ok else f"an integer from 1 to {cpus} (this machine's CPU count), or -1 to -{cpus}"


def _pre_dispatch(value: Any) -> str | None:
    ok = (
        value == "all"
        or isinstance(value, int)
        or isinstance(value, str)
        and re.fullmatch(r"\d+(\.\d+)? ?\* ?n_jobs", value)
    )
    return None if ok else "'all', an integer or 'N*n_jobs'"


def _empty(value: Any) -> str | None:
    return None if not value else "nothing (empty or null)"


def _shipped(default: str) -> Callable[[Any], str | None]:
    return lambda value: None if value == default else f"{default!r} as shipped"


SUBMITIT_LOCAL = {
    "submitit_folder": _shipped("${hydra.sweep.dir}/.submitit/%j"), "timeout_min": _integer(0, 10**6),
    "cpus_per_task": _integer(1, 4096), "gpus_per_node": _integer(0, 64), "tasks_per_node": _integer(1, 4096),
    "mem_gb": _number, "nodes": _integer(1, 4096), "name": _shipped("${hydra.job.name}"),
    "stderr_to_stdout": _one_of(True, False),
}  # fmt: skip
LAUNCHERS: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "hydra._internal.core_plugins.basic_launcher.BasicLauncher": {},
    "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher": {
        "n_jobs": _n_jobs, "backend": _one_of(None, "loky", "threading", "multiprocessing"),
        "prefer": _one_of(None, "processes", "threads"), "require": _one_of(None, "sharedmem"),
        "verbose": _integer(0, 100), "timeout": _number, "pre_dispatch": _pre_dispatch,
        "batch_size": lambda v: None if v == "auto" else _integer(1, 10**6)(v), "temp_folder": _one_of(None),
        "max_nbytes": _one_of(None), "mmap_mode": _one_of("r", None),
    },
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher": SUBMITIT_LOCAL,
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher": {
        **SUBMITIT_LOCAL, **dict.fromkeys(("partition", "qos", "comment", "constraint", "exclude", "gres", "account",
                                           "cpus_per_gpu", "gpus_per_task", "mem_per_gpu", "mem_per_cpu"), _word),
        "signal_delay_s": _integer(0, 10**6), "max_num_timeout": _integer(0, 1000),
        "array_parallelism": _integer(1, 10**6), "additional_parameters": _empty, "setup": _empty, "srun_args": _empty,
    },
}  # fmt: skip
SWEEPERS: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "hydra._internal.core_plugins.basic_sweeper.BasicSweeper": {"max_batch_size": _integer(1, 10**9), "params": _any},
}


def check_hydra(config: DictConfig, overrides: list[str], multirun: bool) -> None:
    """Under safe mode, refuse any key of the composed ``hydra`` node not on the table, or a value it does not admit.

    ``overrides`` are the command line's (what the user typed decides where to write and whether to sweep).
    """
    node = config.get("hydra") if isinstance(config, DictConfig) else None
    if node is None:
        return
    typed = {_override_key(o) for o in overrides}
    for key in node.keys():
        key = str(key)
        where = f"hydra.{key}"
        if key not in HYDRA_KEYS:
            raise ConfigError(f"{where}: not on safe mode's table of Hydra keys, refused because safe=true ({_keys()})")
        check = _CHECKS.get(key)
        if check is not None:
            check(config, where, typed)
    if multirun:
        check_sweep_size(config, overrides)
    from surgery.safe.config_paths import check_config_paths

    check_config_paths(OmegaConf.to_container(config, resolve=False), typed)
    check_job_targets(config)


def check_job_targets(config: DictConfig) -> None:
    """Under safe mode, every ``_target_`` of the job's own nodes is allowlisted, checked as soon as the config is
    composed: a sweep is refused in one line before Hydra launches (and logs) a single job.

    A ``_target_`` that is an interpolation is checked once resolved, when the job builds it.
    """
    from surgery.core.callables import is_allowed, refusal

    def walk(node: Any, where: str) -> None:
        if isinstance(node, Mapping):
            target = node.get("_target_")
            if target is not None and not (isinstance(target, str) and "${" in target) and not is_allowed(target):
                raise refusal(f"{where}._target_", target)
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    body = OmegaConf.to_container(config, resolve=False)
    for key, value in body.items() if isinstance(body, dict) else ():
        if key != "hydra":
            walk(value, str(key))


def _keys() -> str:
    return "allowed: " + ", ".join(f"hydra.{k}" for k in HYDRA_KEYS)


def _override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def _inside(value: Any, where: str, allowed: str, absolute_ok: bool) -> None:
    """A directory that stays where it is put: relative (unless ``absolute_ok``), no '..', not the start directory."""
    if value is None:
        return
    text = str(value)
    parts = Path(text).parts
    escapes = ".." in parts or not text.strip()
    if not absolute_ok:
        escapes = escapes or Path(text).is_absolute() or text.startswith("~") or not [p for p in parts if p != "."]
    if escapes:
        raise refused(where, value, allowed)


def _check_run(config: DictConfig, where: str, typed: set[str]) -> None:
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        if key.startswith(where) and key not in typed:
            _inside(
                resolved(config, key), key, HYDRA_KEYS["run"] + " (set it on the command line: DIR is yours)", False
            )
    if where == "hydra.sweep":
        _inside(resolved(config, "hydra.sweep.subdir"), "hydra.sweep.subdir", "a relative path without '..'", False)


def _check_output_subdir(config: DictConfig, where: str, typed: set[str]) -> None:
    value = resolved(config, where)
    if value is None:
        return
    parts = Path(str(value)).parts
    if (
        not parts
        or Path(str(value)).is_absolute()
        or any(p in (".", "..") or not PLAIN_NAME.fullmatch(p.lstrip(".")) for p in parts)
    ):
        raise refused(where, value, HYDRA_KEYS["output_subdir"])


def _check_job(config: DictConfig, where: str, typed: set[str]) -> None:
    job = config.hydra.job
    for key in sorted(job.keys(), key=lambda k: k != "env_copy"):  # Hydra has copied env_copy into env_set
        at = f"{where}.{key}"
        if key not in JOB_KEYS:
            raise refused(at, resolved(config, at), "keys " + ", ".join(JOB_KEYS))
        if key == "name" and _name(resolved(config, at)) is not None:
            raise refused(at, resolved(config, at), JOB_KEYS["name"])
        if key == "chdir" and resolved(config, at) not in (True, False, None):
            raise refused(at, resolved(config, at), JOB_KEYS["chdir"])
        if key in ("env_set", "env_copy") and len(job[key]):
            entries = list(job[key].keys()) if key == "env_set" else list(job[key])
            raise refused(f"{at}.{entries[0]}" if key == "env_set" else at, entries[0], JOB_KEYS[key])


def _check_env(config: DictConfig, where: str, typed: set[str]) -> None:
    if config.hydra.env:
        raise refused(where, resolved(config, where), HYDRA_KEYS["env"])


def _check_mode(config: DictConfig, where: str, typed: set[str]) -> None:
    mode = config.hydra.mode
    if mode is not None and str(getattr(mode, "name", mode)) == "MULTIRUN" and where not in typed:
        raise ConfigError(
            f"{where}: MULTIRUN set by a config file, refused because safe=true: a sweep starts only from the"
            " command line (-m); remove hydra.mode from the file"
        )


def _check_searchpath(config: DictConfig, where: str, typed: set[str]) -> None:
    for i, entry in enumerate(config.hydra.searchpath or []):
        check_search_entry(str(entry), f"{where}[{i}]")


def check_search_entry(entry: str, where: str) -> None:
    """A search path entry safe mode admits: a directory (``file://`` or a plain path), never ``pkg://`` (an import)."""
    scheme = entry.split("://", 1)[0] if "://" in entry else "file"
    if scheme != "file":
        raise refused(where, entry, f"{HYDRA_KEYS['searchpath']}; {scheme}:// imports or builds what it names")


def _check_callbacks(config: DictConfig, where: str, typed: set[str]) -> None:
    from surgery.core.callables import check_callbacks

    try:
        callbacks = OmegaConf.to_container(config.hydra.callbacks, resolve=True)
    except Exception:  # noqa: BLE001
        raise ConfigError("hydra.callbacks: cannot be read, so safe=true cannot check it") from None
    check_callbacks(callbacks, safe=True)


def _check_plugin(table: dict[str, dict[str, Callable[[Any], str | None]]], what: str) -> Callable[..., None]:
    def check(config: DictConfig, where: str, typed: set[str]) -> None:
        node = resolved(config, where)
        if not isinstance(node, Mapping):
            raise refused(where, node, HYDRA_KEYS[what])
        target = node.get("_target_")
        if target not in table:
            names = ", ".join(t.rsplit(".", 1)[1] for t in table)
            raise refused(f"{where}._target_", target, f"{names} ({HYDRA_KEYS[what]})")
        settings = table[str(target)]
        for key in node:
            if key == "_target_":
                continue
            at = f"{where}.{key}"
            if key not in settings:
                keys = f"the keys {', '.join(settings)}" if settings else "no keys besides _target_"
                raise refused(at, node[key], f"{keys} for {str(target).rsplit('.', 1)[1]}")
            value = resolved(config, at)
            if (isinstance(value, Mapping) and key != "params" or isinstance(value, list)) and value:
                raise refused(at, value, "a plain value; nested nodes (and the _target_ nodes in them) are not built")
            why = settings[key](value) and settings[key](node[key])  # resolved, or the text as shipped
            if why is not None:
                raise refused(at, value, why)
        if what == "sweeper":
            for name, value in (node.get("params") or {}).items():
                if not isinstance(value, (str, int, float, bool)) and value is not None:
                    raise refused(f"{where}.params.{name}", value, "a sweep string such as 1,2,3 or range(0,4)")

    return check


_CHECKS: dict[str, Callable[[DictConfig, str, set[str]], None]] = {
    "run": _check_run,
    "sweep": _check_run,
    "launcher": _check_plugin(LAUNCHERS, "launcher"),
    "sweeper": _check_plugin(SWEEPERS, "sweeper"),
    "hydra_logging": check_log,
    "job_logging": check_log,
    "env": _check_env,
    "mode": _check_mode,
    "searchpath": _check_searchpath,
    "callbacks": _check_callbacks,
    "output_subdir": _check_output_subdir,
    "job": _check_job,
}


def check_sweep_size(config: DictConfig, overrides: list[str]) -> None:
    """Refuse a sweep of more than ``limits.count`` jobs (``hydra.sweeper.params`` and the command line's sweeps,
    as the basic sweeper combines them) before any job runs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from surgery.core.limits import SAFE_DEFAULTS

    bound = OmegaConf.select(config, "limits.count", default=None, throw_on_resolution_failure=False)
    bound = int(bound) if isinstance(bound, int) and not isinstance(bound, bool) else int(SAFE_DEFAULTS.count or 0)
    params = resolved(config, "hydra.sweeper.params") or {}
    lines = [f"{k}={v}" for k, v in params.items()] if isinstance(params, Mapping) else []
    lines += [o for o in overrides if not _override_key(o).startswith("hydra.")]
    counts: dict[str, int] = {}
    named: dict[str, str] = {}  # where each swept key was set: hydra.sweeper.params.KEY or the command line's KEY
    try:
        parsed = OverridesParser.create().parse_overrides(lines)
    except Exception:  # noqa: BLE001 - Hydra's own parser says what is wrong when the sweep starts
        return
    for i, override in enumerate(parsed):
        if not override.is_sweep_override():
            continue
        key = override.get_key_element()
        named[key] = f"hydra.sweeper.params.{key}" if i < len(params or ()) else key
        try:
            counts[key] = sum(1 for _ in itertools.islice(override.sweep_string_iterator(), bound + 1))
        except Exception:  # noqa: BLE001 - glob(...) needs the config loader: a group's few options
            counts[key] = 1
    jobs = math.prod(counts.values())
    if jobs > bound:
        biggest = max(counts, key=lambda k: counts[k])
        sizes = " x ".join(f"{named[k]} ({n if n <= bound else f'more than {bound:,}'})" for k, n in counts.items())
        exact = f"limits.count={jobs}" if max(counts.values()) <= bound else "limits.count=N"
        raise ConfigError(
            f"{named[biggest]}: the sweep would run more than {bound:,} jobs ({sizes}), more than"
            f" limits.count={bound}; if that is meant, raise it: {exact}"
        )
