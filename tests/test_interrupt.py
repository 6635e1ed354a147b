"""Interrupted runs (SIGINT, SIGTERM): stop after the batch, no temporary files, a report marked incomplete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import surgery.app.forwards as forwards_module
from surgery.app.interrupt import Interrupted, Interrupts
from surgery.app.job import run_job
from tests.test_cli import composed

REPO = Path(__file__).resolve().parents[1]
DISK_CAPTURE = "+actions.c={kind: capture, select: head, to: disk}"


def temporary_files(run_dir: Path) -> list[str]:
    return [str(p.relative_to(run_dir)) for p in run_dir.rglob("*.tmp")]


def assert_incomplete(run_dir: Path, batches: int) -> dict[str, Any]:
    """report.json says incomplete, names the shards that finished, and no temporary file is left."""
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is False
    assert report["batches"] == batches
    assert 1 <= report["batches_done"] < batches
    assert temporary_files(run_dir) == []
    return report


# ---------------------------------------------------------------- the handlers, in-process


def test_first_signal_while_deferring_is_only_recorded_and_a_second_raises() -> None:
    before = signal.getsignal(signal.SIGINT)
    with Interrupts() as interrupts:
        with interrupts.deferring():
            os.kill(os.getpid(), signal.SIGINT)
            assert interrupts.requested and interrupts.name == "SIGINT"
            with pytest.raises(Interrupted):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs before this returns
        assert interrupts.count == 2
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_outside_the_batches_raises_at_once() -> None:
    with Interrupts(), pytest.raises(Interrupted) as caught:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert caught.value.signum == signal.SIGTERM


def test_a_complete_run_says_so(tmp_path: Path) -> None:
    report = run_job(composed("+model=mlp", "+actions=linearize", "+input.batches=2"), tmp_path)
    assert report["complete"] is True and report["batches_done"] == 2


def test_sigint_after_a_batch_stops_there_and_writes_what_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_shard = forwards_module.write_shard

    def signal_at_batch_2(surgery: Any, directory: Path, number: int) -> int:
        if number == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return write_shard(surgery, directory, number)

    monkeypatch.setattr(forwards_module, "write_shard", signal_at_batch_2)
    cfg = composed("+model=mlp", "+actions=capture", "+actions.capture.to=disk", "+input.batches=50")
    with pytest.raises(SystemExit) as caught:
        run_job(cfg, tmp_path)
    assert caught.value.code == 130
    report = assert_incomplete(tmp_path, 50)
    assert report["batches_done"] == 3  # batch 2 finished, shard written, then it stopped
    assert report["captures"]["shards"] == [f"batch-0000{i}.safetensors" for i in range(3)]
    assert sorted(p.name for p in (tmp_path / "captures").iterdir()) == report["captures"]["shards"]
    err = capsys.readouterr().err
    assert err == (
        "interrupted by SIGINT: stopped after 3 of 50 batches; wrote what finished and an incomplete report to"
        f" {tmp_path / 'report.json'}\n"
    )


def test_second_signal_while_writing_stops_at_once_without_temporary_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import safetensors.torch

    save_file = safetensors.torch.save_file

    def half_then_signal(tensors: dict[str, Any], filename: str, *a: Any, **k: Any) -> None:
        if "batch-00001" in filename:  # a second Ctrl-C in the middle of writing a shard
            Path(filename).write_bytes(safetensors.torch.save(tensors)[:100])
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        save_file(tensors, filename, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_signal)
    cfg = composed("+model=mlp", "+actions=capture", "+actions.capture.to=disk", "+input.batches=50")
    with pytest.raises(SystemExit) as caught:
        run_job(cfg, tmp_path)
    assert caught.value.code == 130
    report = assert_incomplete(tmp_path, 50)
    assert report["batches_done"] == 1 and report["interrupted"] == "SIGINT"
    assert sorted(p.name for p in (tmp_path / "captures").iterdir()) == ["batch-00000.safetensors"]
    assert capsys.readouterr().err == (
        f"interrupted by SIGINT again: stopped at once after 1 of 50 batches; incomplete report in"
        f" {tmp_path / 'report.json'}\n"
    )


# ---------------------------------------------------------------- through the real CLI


def start_run(tmp_path: Path, *overrides: str) -> subprocess.Popen[str]:
    """``python -m surgery`` with many batches streaming to disk, returned once its first shard is written."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "surgery", "+model=mlp", DISK_CAPTURE, "+input.batches=100000", "hydra.run.dir=run"]
    proc = subprocess.Popen(
        [*args, *overrides], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "captures" / "batch-00000.safetensors").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run did not start streaming: {proc.communicate()[1]}")
        time.sleep(0.02)
    return proc


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_cli_run_stops_cleanly_on_a_signal(tmp_path: Path, signum: int, code: int) -> None:
    proc = start_run(tmp_path)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    name = signal.Signals(signum).name
    assert len(err.splitlines()) == 1 and err.startswith(f"interrupted by {name}: stopped after "), err
    report = assert_incomplete(tmp_path / "run", 100000)
    shards = sorted(p.name for p in (tmp_path / "run" / "captures").iterdir())
    assert shards == report["captures"]["shards"] and len(shards) == report["batches_done"]


def test_cli_second_ctrl_c_exits_at_once(tmp_path: Path) -> None:
    # batches slow enough (a wide MLP on 2048 rows) that the second Ctrl-C comes while one runs
    proc = start_run(tmp_path, "model.hidden=512", "model.depth=8", "model.input.shape=[2048,16]", "compare=false")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert len(err.splitlines()) == 1 and err.startswith("interrupted by SIGINT again: stopped at once after "), err
    assert_incomplete(tmp_path / "run", 100000)
