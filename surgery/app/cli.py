"""The command line: the only ``@hydra.main``. Thin: compose → run_job → exit code.

Exit codes: 0 success; 2 a bad config or input (one message, no traceback unless
``verbose=true``, nothing written); 1 an unexpected internal failure.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import hydra
from omegaconf import DictConfig

from surgery.core.paths import config_dir, group_options
from surgery.errors import SurgeryError

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1


class InternalFailure(SystemExit):
    """Our own exit 1, told apart from Hydra's exit 1 for a bad override; launchers re-raise it intact."""


def usage(options: Callable[[str], list[str]] = group_options) -> str:
    """The short help printed when no model is given; ``options`` lists a group's options (the user's too)."""
    groups = {g: options(g) for g in ("model", "actions", "input", "experiment")}
    lines = [
        "surgery: declarative model surgery for PyTorch.",
        "",
        "  python -m surgery +model=MODEL +actions=ACTIONS        run",
        "  python -m surgery +model=MODEL +actions=A mode=plan    what would match, change nothing",
        "  python -m surgery +model=MODEL mode=modules            list module names and types",
        "  python -m surgery +experiment=NAME                     a whole experiment",
        "  python -m surgery --help                               every setting (Hydra)",
        "",
    ]
    for group, names in groups.items():
        lines.append(f"{group + ':':12}{', '.join(names) or '(none)'}")
    lines += ["", "Example: python -m surgery +model=cnn +actions=linearize"]
    return "\n".join(lines)


class _Task:
    """Hydra's task function: one job.

    A launcher that runs jobs in other processes (submitit, joblib) pickles it there, and the job's
    config is composed in that process: unpickling installs surgery's Hydra hooks first, so the
    override checks and safe mode act there as they do here.
    """

    def __call__(self, cfg: DictConfig) -> None:
        from surgery.core.output import use_logging

        use_logging(True)  # Hydra has configured logging now: lines go to the console and surgery.log
        try:
            _job(cfg)
        finally:
            use_logging(False)  # a library call later in this process prints again

    def __reduce__(self) -> tuple[Callable[[], _Task], tuple[()]]:
        return _task_in_worker, ()


def _task_in_worker() -> _Task:
    """The task as a launcher's worker process unpickles it: with surgery's Hydra hooks installed."""
    from surgery.app.hydra_hooks import install

    install()
    return _Task()


_task = hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(_Task())


def _job(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from surgery.core.output import say

    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    if cfg.get("model") is None:
        _remove_run_dir(out_dir)
        if not hydra_cfg.overrides.task:  # only --config-dir or hydra.searchpath: the overview, with their configs
            print(usage(_user_options))
            return
        models = ", ".join(_user_options("model"))
        from surgery.app.hydra_messages import refuse

        refuse(f"model: no model chosen; add +model=NAME (models: {models})")

    from surgery.app.job import run_job

    verbose = bool(cfg.get("verbose", False))
    try:
        typed = {str(o).partition("=")[0].lstrip("+~") for o in hydra_cfg.overrides.task}
        run_job(cfg, out_dir, typed, Path(hydra_cfg.runtime.cwd))
    except SurgeryError as e:
        if verbose:
            traceback.print_exc()
        from surgery.app.hydra_messages import printable

        print(f"error: {printable(str(e))}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except RecursionError:
        from surgery.app.hydra_messages import NESTED_TOO_DEEPLY, refuse

        refuse(NESTED_TOO_DEEPLY)
    except Exception:
        traceback.print_exc()
        print(
            "error: an unexpected internal failure (exit 1); please report it with the traceback above", file=sys.stderr
        )
        raise InternalFailure(EXIT_INTERNAL) from None
    if cfg.get("mode") == "plan":
        more = "" if verbose else "; verbose=true prints them here"
        say(f"every matched name: {out_dir / 'report.json'}{more}")
    elif cfg.get("mode") == "modules":
        say(f"wrote {out_dir} (the table is in its surgery.log)")


def _user_options(group: str) -> list[str]:
    """A group's options on Hydra's search path: the shipped ones and those of --config-dir or hydra.searchpath."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    try:
        searchpath = [o for o in HydraConfig.get().overrides.hydra if str(o).startswith("hydra.searchpath")]
        found = GlobalHydra.instance().config_loader().get_group_options(group, overrides=searchpath)
    except Exception:  # noqa: BLE001 - the overview still lists the shipped options
        return group_options(group)
    return sorted(set(found))


def _remove_run_dir(out_dir: Path) -> None:
    """Remove a run directory that holds only what Hydra wrote on its own, and its emptied parents up to cwd."""
    from surgery.files import gate

    ours = {".hydra", "surgery.log"}
    if not out_dir.is_dir() or not set(gate.listing(out_dir, "hydra.run.dir")) <= ours:
        return
    gate.remove_tree(out_dir / ".hydra")
    gate.remove_file(out_dir / "surgery.log")
    cwd = Path.cwd().resolve()
    for directory in [out_dir.resolve(), *out_dir.resolve().parents]:
        if directory == cwd or cwd not in directory.parents or not gate.remove_empty_dir(directory):
            break


def _reader_left() -> None:
    """The reader of our output left (``| head``): point stdout at devnull so the exit flush says nothing; exit 0."""
    from surgery.files.gate import null_output

    null_output(sys.stdout.fileno())
    sys.exit(0)


def main() -> None:
    """Entry point of ``python -m surgery`` and the ``surgery`` console script."""
    # A user's own module (_target_: mynet.TinyNet) imports from where they started, as with python -m;
    # Hydra 1.3 with hydra.job.chdir false (the default here) never changes directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # Hugging Face libraries' own progress bars (transformers, datasets, hub) would interleave with our output.
    for variable in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(variable, "1")
    if len(sys.argv) == 1:  # no model, no overrides: help without creating a run directory
        try:
            print(usage(), flush=True)
        except BrokenPipeError:  # surgery | head: the reader left
            _reader_left()
        return
    from surgery.app.hydra_hooks import install

    install()
    try:
        _task()
    except InternalFailure:
        sys.exit(EXIT_INTERNAL)
    except RecursionError:  # a config nested thousands deep, met outside Hydra's own error handling
        from surgery.app.hydra_messages import NESTED_TOO_DEEPLY, refuse

        refuse(NESTED_TOO_DEEPLY)
    except BrokenPipeError:  # e.g. --help | head: the reader left; say nothing more
        _reader_left()
    except SystemExit as e:
        # Hydra reports its own composition errors (unknown option, bad override) with exit 1;
        # those are bad input, so they exit 2 like ours.
        if e.code == EXIT_INTERNAL:
            sys.exit(EXIT_BAD_INPUT)
        raise
