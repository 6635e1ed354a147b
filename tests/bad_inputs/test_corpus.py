"""Every row of the bad-input corpus gives one clear line naming the key, and changes nothing.

Each row runs in-process: ``run_job`` on the real composed config (a ``SurgeryError`` of the
row's type, one plain line starting with the key, raised before applying unless the row says
``at="forward"``, nothing written), and action rows also through ``surgery.plan/apply`` on a
model (which stays bit-identical). A representative subset runs through the CLI, each case in
its own process (``cli_driver``: forked ``surgery.app.cli.main()`` runs, one interpreter start for
all, next to one real ``python -m surgery``): exit 2, on stderr exactly ``error: `` + the
in-process message, no traceback, nothing written. docs/errors.md quotes are checked verbatim.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import open_dict

import surgery
import surgery.app.job as run_module
from surgery.app.job import run_job
from surgery.core.engine import apply_plan
from surgery.errors import SurgeryError
from surgery.models.cnn import CNN
from tests.bad_inputs.cases import CASES, Case, by_id
from tests.bad_inputs.files import WRITERS
from tests.conftest import Snapshot
from tests.test_cli import composed as compose_now

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")  # the pickled checkpoints

REPO = Path(__file__).resolve().parents[2]
INPUTS = ".inputs"  # the files a case starts with, so that anything else is known to be written by the run


@functools.cache
def _composed(overrides: tuple[str, ...]) -> Any:
    return compose_now(*overrides)


def composed(*overrides: str) -> Any:
    """The real config composed with ``overrides`` (cached: composing costs a tenth of a second)."""
    return copy.deepcopy(_composed(overrides))


def params(cases: list[Case]) -> list[Any]:
    """pytest params with ids, each finding marked as a strict xfail."""
    marks = lambda c: [pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else []  # noqa: E731
    return [pytest.param(c, id=c.id, marks=marks(c)) for c in cases]


def prepare(case: Case, workdir: Path) -> None:
    """Write the files the case reads into its working directory."""
    workdir.mkdir(parents=True, exist_ok=True)
    if case.files:
        WRITERS[case.files](workdir)
    (workdir / INPUTS).write_text("\n".join(sorted(str(p) for p in workdir.rglob("*"))))


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar, strings quoted, so the CLI sees the same types."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"


def cli_args(case: Case) -> list[str]:
    """The command line of a case."""
    args = list(case.overrides)
    if case.action is not None:
        args.append(f"+actions.a={hydra_value(case.action)}")
    return args


def message_in_process(case: Case, workdir: Path) -> str:
    """Run the case through ``run_job`` on the composed config, from ``workdir``; return the error's text."""
    prepare(case, workdir)
    applied = []
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        mp.setattr(run_module, "apply_plan", lambda *a, **k: applied.append(1) or apply_plan(*a, **k))
        cfg = composed(*case.overrides)
        if case.action is not None:
            with open_dict(cfg):
                cfg.actions["a"] = case.action
        with pytest.raises(SurgeryError) as info:
            run_job(cfg, workdir / "run")
    assert isinstance(info.value, case.error), f"{type(info.value).__name__}: {info.value}"
    if case.at == "plan":
        assert not applied, f"caught only after applying, not at plan time: {info.value}"
    return str(info.value)


def assert_clear(case: Case, message: str) -> None:
    """One line of plain text that starts with the key and holds every fragment."""
    assert "\n" not in message, message
    assert "\x1b" not in message, f"terminal escape codes in {message!r}"
    assert message.startswith(case.where), f"{message!r} does not start with {case.where!r}"
    for fragment in case.fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def written(workdir: Path) -> list[str]:
    """Files the run left under the working directory, Hydra's own .hydra/ and log aside (there must be none)."""
    before = set((workdir / INPUTS).read_text().splitlines()) | {
        str(workdir / n) for n in (INPUTS, ".stdout", ".stderr")
    }
    return sorted(
        str(p.relative_to(workdir))
        for p in workdir.rglob("*")
        if p.is_file() and str(p) not in before and ".hydra" not in p.parts and p.suffix != ".log"
    )


# ---------------------------------------------------------------- in-process, every row


def test_the_corpus_is_large_and_its_ids_unique() -> None:
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", params([c for c in CASES if not c.hydra]))
def test_run_job_refuses_with_one_clear_line(case: Case, tmp_path: Path) -> None:
    if case.id == "device_cuda_no_gpu" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    message = message_in_process(case, tmp_path)
    assert_clear(case, message)
    assert written(tmp_path) == []


@pytest.mark.parametrize("case", params([c for c in CASES if c.python]))
def test_python_api_refuses_and_leaves_the_model_untouched(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepare(case, tmp_path)
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model, x = CNN().eval(), torch.randn(2, 1, 28, 28)
    before = Snapshot.of(model)
    with pytest.raises(case.error) as info:
        if case.at == "plan":
            surgery.plan(model, {"a": case.action}, example_inputs=(x,))
        else:
            with surgery.apply(model, {"a": case.action}, example_inputs=(x,)):
                model(x)
    assert_clear(case, str(info.value))
    before.assert_same(model)


# ---------------------------------------------------------------- the real CLI, a representative subset

CLI_CASES = [
    "key_selct", "select_nothing", "init_xavier_on_bias", "checkpoint_wrong_keys", "input_wrong_shape", "mode_unknown",
    "expr_wrong_shape", "model_unknown",
]  # fmt: skip
VERBOSE = "expr_import+verbose"


@dataclass
class CliResult:
    """What one CLI run left: its directory, exit status and stderr."""

    workdir: Path
    returncode: int
    stderr: str


def cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CliResult]:
    """The CLI subset, each case in its own process: forked ``surgery.app.cli.main()`` runs (``cli_driver``, one
    interpreter start for all) alongside one real ``python -m surgery`` (the verbose case)."""
    root = tmp_path_factory.mktemp("cli")
    spec = {}
    for case_id in CLI_CASES:
        prepare(by_id(case_id), root / case_id)
        spec[case_id] = [str(root / case_id), cli_args(by_id(case_id))]
    (root / "spec.json").write_text(json.dumps(spec))
    verbose_dir = root / VERBOSE
    prepare(by_id(VERBOSE.split("+")[0]), verbose_dir)
    real = subprocess.Popen(
        [sys.executable, "-m", "surgery", *cli_args(by_id(VERBOSE.split("+")[0])), "verbose=true"],
        cwd=verbose_dir, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    driver = subprocess.run(
        [sys.executable, "-m", "tests.bad_inputs.cli_driver", str(root / "spec.json")],
        cwd=root, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert driver.returncode == 0, driver.stderr
    codes = json.loads(driver.stdout.strip().splitlines()[-1])
    results = {i: CliResult(root / i, codes[i], (root / i / ".stderr").read_text()) for i in CLI_CASES}
    _, stderr = real.communicate(timeout=120)
    results[VERBOSE] = CliResult(verbose_dir, real.returncode, stderr)
    return results


@pytest.mark.parametrize("case", params([by_id(i) for i in CLI_CASES]))
def test_cli_exits_2_with_the_same_one_line_message(case: Case, cli_results: dict, tmp_path: Path) -> None:
    result = cli_results[case.id]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert written(result.workdir) == []
    if case.hydra:  # Hydra's own composition error: no in-process message to compare with
        assert all(fragment in result.stderr for fragment in case.fragments), result.stderr
        return
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    assert_clear(case, lines[0][len("error: ") :])
    # the same text as in-process: the CLI adds nothing and loses nothing
    expected = message_in_process(case, tmp_path / "in_process")
    assert lines[0] == f"error: {expected}"


def test_cli_verbose_adds_the_traceback(cli_results: dict) -> None:
    """The real entry point, ``python -m surgery``, with verbose=true: exit 2, the traceback, then the line."""
    result = cli_results[VERBOSE]
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "error: actions.a.expr: '__import__" in result.stderr
    assert written(result.workdir) == []


@pytest.mark.parametrize("case", params([c for c in CASES if c.hydra]))
def test_hydra_composition_errors_are_raised_before_surgery_runs(case: Case) -> None:
    """Hydra's own errors (the CLI exits 2 on them): composing fails, with the fragments in the text."""
    with pytest.raises(Exception) as info:  # noqa: B017 - Hydra raises several exception types
        composed(*case.overrides)
    assert not isinstance(info.value, SurgeryError)
    for fragment in case.fragments:
        assert fragment in str(info.value), str(info.value)


# ---------------------------------------------------------------- docs/errors.md stays true

DOC = REPO / "docs" / "errors.md"
QUOTED = re.compile(r"<!-- case: (?P<id>\w+) -->\s*```text\n(?P<message>.*?)\n```", re.S)


def test_every_message_in_docs_errors_is_produced_verbatim(tmp_path: Path) -> None:
    quoted = QUOTED.findall(DOC.read_text())
    assert len(quoted) >= 10, "docs/errors.md quotes fewer than ten messages"
    for case_id, message in quoted:
        case = by_id(case_id)
        if case.hydra:
            continue  # checked below through the CLI
        assert message.startswith("error: "), message
        got = message_in_process(case, tmp_path / case_id)
        assert f"error: {got}" == message, f"docs/errors.md is out of date for {case_id}:\n{got}"


def test_docs_errors_hydra_messages_match_the_cli(cli_results: dict) -> None:
    for case_id, message in QUOTED.findall(DOC.read_text()):
        if by_id(case_id).hydra:
            assert message.strip() in cli_results[case_id].stderr, cli_results[case_id].stderr
