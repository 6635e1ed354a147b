"""Run ``python -m surgery ARGS`` for many cases at the cost of one interpreter start.

``python -m tests.bad_inputs.cli_driver SPEC.json``: SPEC maps a run id to ``[cwd, args]``.
torch, Hydra and surgery are imported once; then each case runs in a forked child process
exactly as ``surgery/__main__.py`` does (``surgery.app.cli.main()`` with ``sys.argv`` set), with
its own working directory, its own stdout/stderr files (``cwd/.stdout``, ``cwd/.stderr``) and
its own exit status, which the driver prints as JSON. A real interpreter start costs seconds,
mostly importing torch; a fork costs milliseconds.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import surgery.app.cli
import surgery.app.job  # noqa: F401 - imported lazily by the CLI; loaded here once, before forking


def run_case(cwd: str, args: list[str]) -> int:
    """Fork, run the CLI in the child, and return the child's exit status."""
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    code = 1
    try:
        os.chdir(cwd)
        for fd, name in ((1, ".stdout"), (2, ".stderr")):
            os.dup2(os.open(os.path.join(cwd, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = ["surgery", *args]
        try:
            surgery.app.cli.main()
            code = 0
        except SystemExit as e:  # what the interpreter does with an uncaught SystemExit
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - what the interpreter does with any other uncaught error
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    """Run every case of the spec file; print {run id: exit status} as JSON."""
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print(json.dumps({run_id: run_case(cwd, args) for run_id, (cwd, args) in spec.items()}))


if __name__ == "__main__":
    main()
