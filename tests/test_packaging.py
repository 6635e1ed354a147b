"""A non-editable install ships the configs and runs from any directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    return next(out.glob("surgery-*.whl"))


def test_wheel_holds_every_config_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"surgery/conf/{p.relative_to(REPO / 'conf')}" for p in (REPO / "conf").rglob("*.yaml")}
    assert shipped and shipped <= names
    assert "surgery/app/cli.py" in names
    assert {"surgery/report/report.js", "surgery/report/report.css"} <= names  # report.html's script and style
    assert {f"surgery/models/weights/induction_lm/{n}" for n in ("model.safetensors", "tokenizer.json")} <= names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "surgery = surgery.app.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_runs_the_main_job_from_another_directory(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run(
        [sys.executable, "-m", "surgery", "+model=cnn", "+actions=linearize", f"hydra.run.dir={elsewhere / 'run'}"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((elsewhere / "run" / "report.json").read_text())
    assert report["restored"] and report["plan"][0]["matched"] == ["block1.act", "block2.act", "block3.act"]
    assert "<script>" in (elsewhere / "run" / "report.html").read_text()  # its script read from the installed wheel
    assert (
        str(site)
        in subprocess.run(
            [sys.executable, "-c", "import surgery; print(surgery.__file__)"],
            env=env,
            cwd=elsewhere,
            capture_output=True,
            text=True,
        ).stdout
    )
