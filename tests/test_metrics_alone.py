"""Metrics of the surgered model alone (issue 25: ``metrics`` refused ``compare=false``): a sweep need not pay for
the unmodified forward in every job. The unmodified model never runs, and the numbers equal compare=true's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from surgery.app.job import run_job
from surgery.errors import ConfigError
from surgery.models.cnn import CNN
from tests.test_cli import composed


def npz(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x, y = rng.random((40, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 40)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    return tmp_path / "mine.npz"


def counted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> tuple[dict, int]:
    """The report of a run of the digits CNN over 3 batches of a file, and how many forwards the CNN made."""
    calls = []
    forward = CNN.forward
    monkeypatch.setattr(CNN, "forward", lambda self, x: calls.append(1) or forward(self, x))
    cfg = composed(
        "+model=cnn", "+input=dataset", f"input.path={npz(tmp_path)}", "input.batch_size=16", "+actions=linearize",
        "metrics=[accuracy,loss,top5]", *overrides,
    )  # fmt: skip
    report = run_job(cfg, tmp_path / "run")
    monkeypatch.setattr(CNN, "forward", forward)
    return report, len(calls)


def test_compare_false_scores_the_surgered_model_alone_without_running_the_unmodified_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone, forwards_alone = counted_run(tmp_path / "a", monkeypatch, "compare=false")
    both, forwards_both = counted_run(tmp_path / "b", monkeypatch)
    assert alone["batches"] == both["batches"] == 3
    assert forwards_alone == 3  # one surgered forward a batch, nothing else
    assert forwards_both == 3 + 3 + 1  # and the unmodified model per batch, and batch 0's comparison
    assert alone["metrics"] == {"surgered": both["metrics"]["surgered"]}  # no unmodified, no delta
    assert alone["data"]["examples"] == both["data"]["examples"] == 40
    assert alone["difference"] is None


def test_a_metric_that_needs_the_unmodified_model_is_refused_without_compare(tmp_path: Path) -> None:
    cfg = composed(
        "+model=cnn", "+input=dataset", f"input.path={npz(tmp_path)}", "+actions=linearize",
        "metrics=[accuracy,kl]", "compare=false",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^metrics\[1\]: 'kl' compares with the unmodified model.*compare=true"):
        run_job(cfg, tmp_path / "run")


def test_compare_false_without_metrics_still_computes_none(tmp_path: Path) -> None:
    cfg = composed("+model=cnn", "+input=dataset", f"input.path={npz(tmp_path)}", "+actions=linearize", "compare=false")
    assert run_job(cfg, tmp_path / "run")["metrics"] is None


def test_a_sweep_collects_metrics_of_the_surgered_model_alone(tmp_path: Path) -> None:
    from surgery.app.sweep import collect, write_summary

    data = npz(tmp_path)
    for job, value in enumerate(["0.5", "2"]):
        overrides = [f"actions.scale_output.value={value}", "metrics=[accuracy,loss]", "compare=false"]
        cfg = composed("+model=cnn", "+input=dataset", f"input.path={data}", "+actions=scale_output", *overrides)
        run_job(cfg, tmp_path / "sweep" / str(job))
        (tmp_path / "sweep" / str(job) / ".hydra").mkdir(exist_ok=True)
        (tmp_path / "sweep" / str(job) / ".hydra" / "overrides.yaml").write_text(f"- {overrides[0]}\n")
    written = write_summary(tmp_path / "sweep")
    assert [p.name for p in written] == ["summary.csv", "summary.md", "summary.png"]
    header, *rows = (tmp_path / "sweep" / "summary.csv").read_text().splitlines()
    reports = [job["report"] for job in collect(tmp_path / "sweep")]
    column = header.split(",").index("metrics.surgered.loss")
    assert [float(r.split(",")[column]) for r in rows] == [r["metrics"]["surgered"]["loss"] for r in reports]
    assert len(set(r["metrics"]["surgered"]["loss"] for r in reports)) == 2
