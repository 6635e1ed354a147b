"""Data sets through the CLI's job: a user's own .npz and image folder, scored as by hand; bad data refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from surgery.app.job import run_job
from surgery.errors import ConfigError
from tests.exact_runs import job_of, logits
from tests.test_cli import composed
from tests.test_data import image_folder


def cnn_on(path: Path, *more: str) -> list[str]:
    return ["+model=cnn", "+input=dataset", f"input.path={path}", "+actions=linearize", *more]


def test_an_npz_file_is_scored_as_by_hand(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.random((70, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 70)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    report = run_job(composed(*cnn_on(tmp_path / "mine.npz", "input.batch_size=32")), tmp_path / "run")
    model, _ = job_of("+model=cnn")
    batches = [torch.from_numpy(x[i : i + 32]) for i in range(0, 70, 32)]
    before = torch.cat([logits(model, (b,)) for b in batches])
    labels = torch.from_numpy(y)
    assert report["metrics"]["unmodified"]["accuracy"] == float((before.argmax(-1) == labels).double().mean())
    assert report["data"] == {"source": str(tmp_path / "mine.npz"), "examples": 70}
    assert report["batches"] == 3


def test_an_image_folder_is_scored_as_by_hand(tmp_path: Path) -> None:
    images, labels = image_folder(tmp_path / "digits", n_per_class=3, classes=10, side=28)
    report = run_job(composed(*cnn_on(tmp_path / "digits", "input.batch_size=8")), tmp_path / "run")
    model, _ = job_of("+model=cnn")
    before = torch.cat([logits(model, (images[i : i + 8],)) for i in range(0, 30, 8)])
    assert report["metrics"]["unmodified"]["accuracy"] == float((before.argmax(-1) == labels).double().mean())
    assert report["data"]["examples"] == 30


@pytest.mark.parametrize(
    ("labels", "more", "message"),
    [
        (np.arange(12) % 12, (), r"^input.y_key: labels run from 0 to 11 but the model's output has 10 classes"),
        (None, ("metrics=[accuracy]",), r"^metrics\[0\]: 'accuracy' needs labels and this input has none"),
        (np.zeros(12, np.int64), ("metrics=[acuracy]",), r"^metrics\[0\]: unknown metric 'acuracy'"),
        (np.zeros(12, np.int64), ("input.batch_size=0",), r"^input.batch_size: a positive int"),
    ],
)
def test_bad_data_is_refused_and_no_report_is_left(tmp_path: Path, labels, more, message) -> None:
    x = np.zeros((12, 1, 28, 28), np.float32)
    np.savez(tmp_path / "d.npz", **({"x": x} if labels is None else {"x": x, "y": labels}))
    extra = ("input.y_key=null",) if labels is None else ()
    with pytest.raises(ConfigError, match=message):
        run_job(composed(*cnn_on(tmp_path / "d.npz", *extra, *more)), tmp_path / "run")
    assert not (tmp_path / "run" / "report.json").exists()
