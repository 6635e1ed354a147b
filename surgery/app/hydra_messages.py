"""What the CLI says when Hydra fails: one ``error: ...`` line in our words and exit 2 for bad input.

Control characters are escaped (a name from a config cannot forge output lines); a composition error a new
user meets (a missing plugin, an actions file written as a list, an unwritable run directory, a config nested
past the recursion limit) gets a message with what would work; a sweep job that failed in another process
(submitit) exits 2 with its own error line, or 1 when it failed unexpectedly.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from surgery.errors import SurgeryError

EXIT_BAD_INPUT = 2
# Launcher and sweeper plugins a shipped extra installs: Hydra's "Could not find" gets the pip line.
PLUGIN_EXTRAS = {
    "hydra/launcher/joblib": "sweep",
    "hydra/launcher/submitit_slurm": "slurm",
    "hydra/launcher/submitit_local": "slurm",
}
NESTED_TOO_DEEPLY = (
    "the config is nested too deeply to read (more levels than Python's recursion limit); a config from someone"
    " else that does this is refused"
)


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``): a name from a config cannot forge output lines."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def refuse(message: str) -> NoReturn:
    """One line on stderr and exit 2: the CLI's answer to bad input."""
    print(f"error: {printable(message)}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def hydra_message(error: Exception) -> str | None:
    """Our words for a Hydra composition error a new user meets, or None to leave Hydra's."""
    if isinstance(error, RecursionError) or isinstance(error.__cause__, RecursionError):
        return NESTED_TOO_DEEPLY
    for found in (error, error.__cause__, error.__context__):
        if isinstance(found, SurgeryError):  # our own check inside Hydra's loading (a config file's YAML)
            return str(found)
    if isinstance(error, OSError) and error.errno is not None:  # creating the run directory, writing .hydra/ there
        # (Hydra's MissingConfigException is an OSError too, without an errno)
        where = f"{error.filename}: " if error.filename else ""
        return (
            f"{where}cannot write the run directory there ({error.strerror or error}); choose another with"
            " hydra.run.dir=DIR (hydra.sweep.dir=DIR with -m)"
        )
    text = str(error)
    for missing, extra in PLUGIN_EXTRAS.items():
        if f"Could not find '{missing}'" in text:
            name = missing.rsplit("/", 1)[1]
            return f"{missing.replace('/' + name, '')}={name}: not installed; pip install 'surgery[{extra}]'"
    if "Cannot merge DictConfig with ListConfig" in text and "In 'actions/" in text:
        name = text.split("In 'actions/", 1)[1].split("'", 1)[0]
        return (
            f"actions/{name}: an actions file is a mapping of named actions (NAME: {{kind: ..., select: ...}}),"
            " not a YAML list"
        )
    return None


def failed_job(error: Exception) -> tuple[str, bool] | None:
    """A submitit job that ended without a result: (what to print, whether it was bad input), or None.

    The job exited (``sys.exit(2)`` with its one-line error, or exit 1 after a traceback) or was
    killed; submitit then raises ``UncompletedJobError`` holding the job's error stream.
    """
    # submitit.core.utils's class (or its FailedJobError), by name: the slurm extra may be absent
    if "UncompletedJobError" not in {kind.__name__ for kind in type(error).__mro__}:
        return None
    text = str(error)
    lines = text.splitlines()
    path = re.search(r" with path (\S+)", lines[0])
    logs = f"job logs: {Path(path.group(1)).parent}" if path else "job logs: hydra.sweep.dir/.submitit/"
    said = [line for line in lines if line.startswith("error: ")]
    if said and "unexpected internal failure" not in said[-1]:
        return f"{said[-1].removeprefix('error: ')} ({logs})", True
    return f"{text}\nerror: a sweep job failed ({logs})", False


def translating(run_and_report: Any) -> Any:
    """Hydra's ``run_and_report`` with our one-line answers: a failed sweep job's error, a composition error."""

    def translated(func: Any) -> Any:
        def call() -> Any:
            try:
                return func()
            except Exception as e:
                failed = failed_job(e)
                if failed is not None:
                    text, bad_input = failed
                    if bad_input:
                        refuse(text)
                    from surgery.app.cli import InternalFailure

                    print(text, file=sys.stderr)
                    raise InternalFailure(1) from None
                message = hydra_message(e)
                if message is None:
                    raise
                refuse(message)

        return run_and_report(call)

    return translated
