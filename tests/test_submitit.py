"""Cluster sweeps: Hydra's submitit launcher (the `slurm` extra) through the real command line.

``submitit_local`` runs each job as its own process the way ``submitit_slurm`` runs it on a node
(the job pickled, unpickled in a fresh ``python -m submitit.core._submit``), so it checks here what
a SLURM sweep would do, short of ``sbatch``. The two sweeps run side by side: a failed job costs
submitit a fixed 15 s wait for a result file that never comes.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file

from surgery.app import hydra_messages
from surgery.app import sweep as surgery_sweep
from surgery.app.cli import InternalFailure
from surgery.core.paths import config_dir

pytest.importorskip(
    "hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra: pip install 'surgery[slurm]'"
)
UncompletedJobError = pytest.importorskip("submitit.core.utils").UncompletedJobError  # the plugin's dependency

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"}
LOCAL = ["-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=3", "hydra.launcher.cpus_per_task=1"]
# safe=true: the launcher must not be refused; input.batches: a key the config lacks, which surgery's
# override check adds (it must do so in the job's own process too, where the job's config is composed)
SWEEP = ["+model=functions", "+actions=add_five", "safe=true", "input.batches=2"]
CAPTURE_INPUTS = "+actions.inputs={kind: capture, select: ab, what: [input]}"  # x1, x2 for the plain-PyTorch check


def start(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """``python -m surgery ARGS`` in ``cwd``, not waited for."""
    command = [sys.executable, "-m", "surgery", *args]
    return subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str]]:
    """A good 2-job sweep (value 1, 2), one whose second job has a bad value, and one without the extra, at once."""
    root = tmp_path_factory.mktemp("submitit")
    runs = {
        "good": start(*LOCAL, *SWEEP, CAPTURE_INPUTS, "actions.add_five.value=1,2", f"hydra.sweep.dir={root / 'good'}",
                      cwd=root),
        "bad": start(*LOCAL, *SWEEP, "actions.add_five.value=1,abc", f"hydra.sweep.dir={root / 'bad'}", cwd=root),
    }  # fmt: skip
    hidden = (  # as if the extra were not installed
        "import sys; sys.modules['hydra_plugins.hydra_submitit_launcher'] = None;"
        " sys.argv = ['surgery', '-m', '+model=mlp', 'hydra/launcher=submitit_slurm', 'mode=plan'];"
        " from surgery.app.cli import main; main()"
    )
    runs["missing"] = subprocess.Popen(
        [sys.executable, "-c", hidden], cwd=root, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    done = {}
    for name, process in runs.items():
        _, stderr = process.communicate(timeout=240)
        done[name] = (root / name, process.returncode, stderr)
    return done


def report(job: Path) -> dict:
    return json.loads((job / "report.json").read_text())


def test_each_job_runs_with_its_own_value_and_matches_plain_pytorch(sweeps: dict[str, tuple[Path, int, str]]) -> None:
    sweep, code, stderr = sweeps["good"]
    assert code == 0, stderr
    for value in (1, 2):
        job = sweep / str(value - 1)
        assert f"actions.add_five.value={value}" in (job / ".hydra" / "overrides.yaml").read_text()
        found = report(job)
        assert found["complete"] is True and found["batches_done"] == 2  # input.batches=2 reached the job
        inputs = load_file(job / "captures.safetensors")
        x1, x2 = inputs["inputs/ab/input.0/0"], inputs["inputs/ab/input.1/0"]
        # Functions with add_five: every Function's output + v, in the model's own order of operations
        a = (x1 + torch.tensor([2.0])) + value
        b = (x2 - torch.tensor([1.0])) + value
        expected = ((a + b) * torch.tensor([3.0]) + value) / torch.tensor([2.0]) + value
        assert torch.equal(load_file(job / "output.safetensors")["output"], expected)
        assert found["difference"]["mean_abs"] == pytest.approx(4.5 * value)
    assert report(sweep / "0")["fingerprints"]["input"] == report(sweep / "1")["fingerprints"]["input"]


def test_safe_mode_admits_the_submitit_launcher(sweeps: dict[str, tuple[Path, int, str]]) -> None:
    sweep, code, stderr = sweeps["good"]
    assert code == 0, stderr
    assert "safe: true" in (sweep / "0" / ".hydra" / "config.yaml").read_text().splitlines()
    assert (
        "_target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
        in (sweep / "multirun.yaml").read_text()
    )


def test_surgery_sweep_collects_both_jobs(
    sweeps: dict[str, tuple[Path, int, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    sweep, _, _ = sweeps["good"]
    assert surgery_sweep.main([str(sweep), "--metric", "difference.mean_abs", "--no-plot"]) == 0  # .submitit/ is no job
    assert "collected 2 job(s)" in capsys.readouterr().out
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"], r["actions.add_five.value"]) for r in rows] == [("0", "ok", "1"), ("1", "ok", "2")]
    assert float(rows[1]["difference.mean_abs"]) == pytest.approx(9.0)


def test_a_bad_value_in_one_job_is_its_one_line_error_and_exit_2(sweeps: dict[str, tuple[Path, int, str]]) -> None:
    sweep, code, stderr = sweeps["bad"]
    assert code == 2, stderr
    errors = [line for line in stderr.splitlines() if not line.startswith("[")]  # Hydra's [HYDRA] lines
    assert len(errors) == 1, stderr
    assert errors[0].startswith("error: actions.add_five.value: Value 'abc' of type 'str' could not be converted")
    assert f"job logs: {sweep / '.submitit'}" in errors[0]
    assert (sweep / "0" / "report.json").is_file()  # the other job ran to its end
    assert (sweep / "1" / ".hydra").is_dir() and not (sweep / "1" / "report.json").exists()
    assert surgery_sweep.main([str(sweep), "--no-plot"]) == 0
    with (sweep / "summary.csv").open() as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["ok", "no report"]


def test_without_the_extra_the_launcher_names_its_pip_line(sweeps: dict[str, tuple[Path, int, str]]) -> None:
    _, code, stderr = sweeps["missing"]
    assert (code, stderr) == (2, "error: hydra/launcher=submitit_slurm: not installed; pip install 'surgery[slurm]'\n")


def test_the_launcher_file_of_the_docs_extends_submitit_slurm(tmp_path: Path) -> None:
    """docs/sweeps.md's my_slurm.yaml, found the way --config-dir finds it (first on the search path)."""
    docs = (REPO / "docs" / "sweeps.md").read_text()
    block = re.search(r"```yaml\n(\s*# DIR/hydra/launcher/my_slurm.yaml\n.*?)```", docs, re.S)
    assert block is not None, "docs/sweeps.md: the my_slurm.yaml example is gone"
    (tmp_path / "hydra" / "launcher").mkdir(parents=True)
    (tmp_path / "hydra" / "launcher" / "my_slurm.yaml").write_text(textwrap.dedent(block.group(1)))
    overrides = [f"hydra.searchpath=[file://{tmp_path}]", "hydra/launcher=my_slurm", "+model=cnn"]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        launcher = compose("config", overrides=overrides, return_hydra_config=True).hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    written = yaml.safe_load(textwrap.dedent(block.group(1)))
    assert {k: launcher[k] for k in written if k != "defaults"} == {k: v for k, v in written.items() if k != "defaults"}
    folder = OmegaConf.to_container(launcher, resolve=False)["submitit_folder"]  # type: ignore[index]
    assert folder == "${hydra.sweep.dir}/.submitit/%j"  # where the docs say the logs go


def failing_with(stream: str) -> None:
    """What the CLI does when submitit reports a job that ended without a result and with this error stream."""
    text = "Job 123 (task: 0) with path /s/.submitit/123/123_0_result.pkl\nhas not produced any output (state: FAILED)"
    error = UncompletedJobError(f"{text}\nError stream produced:\n{'-' * 40}\n{stream}")

    def launch() -> None:
        raise error

    hydra_messages.translating(lambda call: call())(launch)


def test_an_internal_failure_in_a_job_exits_1_with_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    stream = "Traceback (most recent call last):\nRuntimeError: boom\nerror: an unexpected internal failure (exit 1)\n"
    with pytest.raises(InternalFailure) as stop:
        failing_with(stream)
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "RuntimeError: boom" in err and err.endswith("error: a sweep job failed (job logs: /s/.submitit/123)\n")


def test_a_job_killed_without_a_message_exits_1_pointing_at_its_logs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InternalFailure):
        failing_with("slurmstepd: error: *** JOB 123 CANCELLED DUE TO TIME LIMIT ***\n")
    assert capsys.readouterr().err.endswith("error: a sweep job failed (job logs: /s/.submitit/123)\n")


def test_a_jobs_own_error_line_is_the_one_line_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        failing_with("error: actions.a.value: must be a number\n")
    assert stop.value.code == 2 and not isinstance(stop.value, InternalFailure)
    assert capsys.readouterr().err == "error: actions.a.value: must be a number (job logs: /s/.submitit/123)\n"
