"""surgery.sweep over reports that hold metrics: every metric in the table, a panel or heatmap per metric."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from surgery.app import sweep


def fake_job(root: Path, number: int, overrides: list[str], accuracy: float, kl: float) -> None:
    """A job dir as Hydra and the CLI leave it: .hydra/overrides.yaml and a report with metrics."""
    job = root / str(number)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    metrics = {
        "surgered": {"accuracy": accuracy, "kl": kl},
        "unmodified": {"accuracy": 0.99, "kl": 0.0},
        "delta": {"accuracy": accuracy - 0.99, "kl": kl},
    }
    (job / "report.json").write_text(json.dumps({"mode": "run", "metrics": metrics, "restored": True}))


def test_every_metric_is_a_column_for_each_model(tmp_path: Path) -> None:
    for i, value in enumerate([0.5, 1.0, 2.0]):
        fake_job(tmp_path, i, ["+model=cnn", f"actions.s.value={value}"], accuracy=0.9 - 0.1 * i, kl=0.1 * i)
    written = sweep.write_summary(tmp_path)
    assert [p.name for p in written] == ["summary.csv", "summary.md", "summary.png"]
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [float(r["metrics.surgered.accuracy"]) for r in rows] == pytest.approx([0.9, 0.8, 0.7])
    assert [float(r["metrics.delta.kl"]) for r in rows] == pytest.approx([0.0, 0.1, 0.2])
    assert {r["metrics.unmodified.accuracy"] for r in rows} == {"0.99"}
    assert "metrics.surgered.accuracy" in (tmp_path / "summary.md").read_text()


def test_two_swept_keys_give_a_heatmap_per_metric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = {}
    monkeypatch.setattr(sweep, "plot_heatmaps", lambda path, values, rows, cols, labels: drawn.update(
        values=values, rows=rows, cols=cols, labels=labels) or path.write_bytes(b"png"))  # fmt: skip
    number = 0
    for block in ("block1", "block2"):
        for value in (0, 1):
            fake_job(tmp_path, number, [f"actions.z.select={block}", f"actions.z.value={value}"], 0.1 * number, 0)
            number += 1
    sweep.write_summary(tmp_path)
    assert drawn["labels"] == ("actions.z.select", "actions.z.value")
    assert drawn["values"]["accuracy"] == pytest.approx({"0": 0.0, "1": 0.1, "2": 0.2, "3": 0.3})
    assert drawn["rows"] == {"0": "block1", "1": "block1", "2": "block2", "3": "block2"}
    assert drawn["cols"] == {"0": "0", "1": "1", "2": "0", "3": "1"}


def test_heatmap_png_is_written(tmp_path: Path) -> None:
    number = 0
    for block in ("block1", "block2", "block3"):
        for value in (0, 1):
            fake_job(tmp_path, number, [f"actions.z.select={block}", f"actions.z.value={value}"], 0.5, 0.1)
            number += 1
    sweep.write_summary(tmp_path)
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_explicit_metric_still_plots_just_that(tmp_path: Path) -> None:
    for i in range(3):
        fake_job(tmp_path, i, [f"actions.s.value={i}"], accuracy=0.5, kl=float(i))
    sweep.write_summary(tmp_path, metric="metrics.delta.kl")
    assert (tmp_path / "summary.png").is_file()
