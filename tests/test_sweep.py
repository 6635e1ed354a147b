"""Sweeps: a real joblib sweep through the CLI, and the collector on hand-made sweep directories."""

from __future__ import annotations

import csv
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from surgery.app import sweep

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_job(root: Path, name: str, overrides: list[str], report: dict[str, Any] | None) -> Path:
    """A job directory as Hydra and surgery leave it: .hydra/overrides.yaml and (unless None) report.json."""
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if report is not None:
        (job / "report.json").write_text(json.dumps(report))
    return job


def report_with(max_abs: float, mean: float = 0.0, kl: float | None = None) -> dict[str, Any]:
    """The parts of a run's report.json the collector reads."""
    diff: dict[str, Any] = {"comparable": True, "max_abs": max_abs, "mean_abs": max_abs / 2, "mse": max_abs**2}
    if kl is not None:
        diff["kl"] = kl
    return {
        "mode": "run",
        "output": {"shape": [2, 3], "mean": mean, "std": 1.0},
        "difference": diff,
        "restored": True,
        "fingerprints": {"output": f"{int(max_abs * 1000):064x}"},
    }


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- a real sweep with the joblib launcher


@pytest.fixture(scope="module")
def joblib_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two add_five jobs (value 1 and 2) on the functions model, run in parallel by joblib."""
    root = tmp_path_factory.mktemp("joblib")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"}
    args = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "+model=functions", "+actions=add_five"]
    args += ["actions.add_five.value=1,2", f"hydra.sweep.dir={root / 'sweep'}"]
    result = subprocess.run(
        [sys.executable, "-m", "surgery", "-m", *args], cwd=root, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr
    return root / "sweep"


def test_joblib_sweep_runs_each_job_with_its_own_value(joblib_sweep: Path) -> None:
    one, two = (json.loads((joblib_sweep / n / "report.json").read_text()) for n in ("0", "1"))
    # add_five adds v to each Function's output: ((x1+2+v) + (x2-1+v)) * 3 + v, then / 2 + v,
    # so the output moves by 3v + v/2 + v = 4.5 v from the unmodified model
    assert one["difference"]["mean_abs"] == pytest.approx(4.5)
    assert two["difference"]["mean_abs"] == pytest.approx(9.0)
    assert two["output"]["mean"] - one["output"]["mean"] == pytest.approx(4.5)
    assert one["fingerprints"]["input"] == two["fingerprints"]["input"]  # same seed, same input
    assert one["fingerprints"]["output"] != two["fingerprints"]["output"]
    overrides = (joblib_sweep / "1" / ".hydra" / "overrides.yaml").read_text()
    assert "actions.add_five.value=2" in overrides and "launcher" not in overrides


def test_collecting_the_joblib_sweep_writes_csv_markdown_and_plot(
    joblib_sweep: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sweep.main([str(joblib_sweep), "--metric", "difference.mean_abs"]) == 0
    assert "collected 2 job(s)" in capsys.readouterr().out
    rows = read_csv(joblib_sweep / "summary.csv")
    assert [(r["job"], r["model"], r["actions"], r["actions.add_five.value"]) for r in rows] == [
        ("0", "functions", "add_five", "1"),
        ("1", "functions", "add_five", "2"),
    ]
    assert float(rows[1]["difference.max_abs"]) == pytest.approx(9.0)
    assert rows[0]["restored"] == "True" and len(rows[0]["fingerprints.output"]) == 12
    assert "| 1 | ok | functions | add_five | 2 | 9 |" in (joblib_sweep / "summary.md").read_text()
    assert (joblib_sweep / "summary.png").read_bytes().startswith(PNG_MAGIC)
    assert not [p for p in joblib_sweep.iterdir() if p.name.endswith(".tmp")]  # atomic writes left nothing behind


# ---------------------------------------------------------------- the collector on hand-made sweeps


def test_jobs_sort_numerically_and_override_names_lose_their_plus(tmp_path: Path) -> None:
    for i in (0, 1, 2, 10, 11):
        fake_job(
            tmp_path, str(i), ["+model=cnn", "++seed=3", "~actions.drop", f"actions.a.value={i / 2}"], report_with(i)
        )
    jobs = sweep.collect(tmp_path)
    assert [job["job"] for job in jobs] == ["0", "1", "2", "10", "11"]
    assert jobs[3]["overrides"] == {"model": "cnn", "seed": "3", "actions.drop": "~", "actions.a.value": "5.0"}
    assert sweep.varying(jobs) == ["actions.a.value"]
    axis = sweep.choose_x(jobs, None, sweep.metric_points(jobs, "difference.max_abs"))
    assert axis["label"] == "actions.a.value" and axis["values"]["10"] == 5.0


def test_several_varying_overrides_plot_against_the_job_index(tmp_path: Path) -> None:
    for i, (model, value) in enumerate([("cnn", 1), ("cnn", 2), ("mlp", 1), ("mlp", 2)]):
        fake_job(tmp_path, str(i), [f"+model={model}", f"actions.s.value={value}"], report_with(i + 1.0, kl=0.1))
    assert sweep.main([str(tmp_path)]) == 0
    jobs = sweep.collect(tmp_path)
    axis = sweep.choose_x(jobs, None, sweep.metric_points(jobs, "difference.max_abs"))
    assert axis["label"] == "job" and axis["ticks"]["2"] == "2\nmodel=mlp\nvalue=1"
    rows = read_csv(tmp_path / "summary.csv")
    assert list(rows[0])[:4] == ["job", "status", "model", "actions.s.value"]
    assert rows[3]["difference.kl"] == "0.1"
    # --x picks one of them; the other gives one line per value
    assert sweep.main([str(tmp_path), "--x", "actions.s.value"]) == 0
    axis = sweep.choose_x(jobs, "actions.s.value", sweep.metric_points(jobs, "difference.max_abs"))
    assert axis["series"] == {"0": "model=cnn", "1": "model=cnn", "2": "model=mlp", "3": "model=mlp"}


def test_a_job_without_a_report_is_listed_and_left_out_of_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_job(tmp_path, "0", ["actions.s.value=1"], report_with(1.0))
    fake_job(tmp_path, "1", ["actions.s.value=abc"], None)  # a bad config: the job wrote no report
    fake_job(tmp_path, "2", ["actions.s.value=3"], report_with(3.0))
    assert sweep.main([str(tmp_path)]) == 0
    assert "1 without a report: 1" in capsys.readouterr().out
    rows = read_csv(tmp_path / "summary.csv")
    assert [r["status"] for r in rows] == ["ok", "no report", "ok"]
    assert rows[1]["difference.max_abs"] == ""
    assert "kl" not in "".join(rows[0])  # no report had a KL: no column


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing"], "missing: no such directory"),
        (["empty"], "no job reports (DIR/N/report.json) found"),
        (["root"], "no job reports directly inside (DIR/N/report.json); sweeps inside it: 2026-11-22/04-32-50"),
        (["sweep", "--metric", "difference.max_ab"], "--metric difference.max_ab: not in any report. Did you mean"),
        (["sweep", "--metric", "output.shape"], "--metric output.shape: not a number in any report"),
        (["sweep", "--x", "model"], "--x model: cannot plot against non-numeric values (cnn, mlp)"),
        (["sweep", "--x", "actions.s.valu"], "--x actions.s.valu: not an override of this sweep. Did you mean"),
    ],
)
def test_bad_input_exits_2_with_one_message_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    (tmp_path / "empty").mkdir()
    fake_job(tmp_path / "root" / "2026-11-22" / "04-32-50", "0", ["seed=1"], report_with(1.0))
    fake_job(tmp_path / "sweep", "0", ["+model=cnn", "actions.s.value=1"], report_with(1.0))
    fake_job(tmp_path / "sweep", "1", ["+model=mlp", "actions.s.value=2"], report_with(2.0))
    assert sweep.main([str(tmp_path / args[0]), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not list(tmp_path.glob("**/summary.*"))


@pytest.mark.filterwarnings("ignore:'surgery.sweep' found in sys.modules:RuntimeWarning")
def test_the_module_runs_as_a_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_job(tmp_path, "0", ["actions.s.value=1"], report_with(1.0))
    monkeypatch.setattr(sys, "argv", ["python -m surgery.sweep", str(tmp_path), "--no-plot"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("surgery.sweep", run_name="__main__")
    assert exit_info.value.code == 0
    assert f"wrote {tmp_path / 'summary.csv'}, {tmp_path / 'summary.md'}" in capsys.readouterr().out
    assert not (tmp_path / "summary.png").exists()
