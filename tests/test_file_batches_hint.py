"""``+input=file ... +input.batches=10`` suggests what the user wants (issue 25: it said "use kind random"): the
same file read as a data set. Each suggestion is pasted back and run; an ``.npy`` works as a data set path."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from surgery.app.job import run_job
from surgery.errors import ConfigError
from tests.test_cli import composed

ROWS = 20


def images() -> torch.Tensor:
    return torch.rand(ROWS, 1, 28, 28, generator=torch.Generator().manual_seed(0))


def save(path: Path, x: torch.Tensor, form: str) -> None:
    if form == "npy":
        np.save(path, x.numpy())
    elif form == "pt dict":
        torch.save({"images": x, "other": x[:1]}, path)
    elif form == "pt tensor":
        torch.save(x, path)
    else:
        from safetensors.torch import save_file

        save_file({"images": x}, str(path))


@pytest.mark.parametrize(
    ("form", "name"),
    [("npy", "x.npy"), ("pt dict", "x.pt"), ("pt tensor", "x.pt"), ("safetensors", "x.safetensors")],
)
def test_the_suggestion_for_batches_of_a_file_runs_when_pasted(form: str, name: str, tmp_path: Path) -> None:
    x = images()
    save(tmp_path / name, x, form)
    model = ("+model=cnn", "+actions=linearize")
    with pytest.raises(ConfigError) as refused:
        run_job(composed(*model, "+input=file", f"input.path={tmp_path / name}", "+input.batches=10"), tmp_path / "a")
    message = str(refused.value)
    assert message.startswith("input.batches: a file input is one batch;") and "kind random" not in message
    pasted = re.search(r": (\+input=dataset .*)$", message)[1].split()  # type: ignore[index]
    report = run_job(composed(*model, *pasted, "input.batch_size=8"), tmp_path / "b")
    assert report["batches"] == 3 and report["data"]["examples"] == ROWS
    assert report["input"][0]["shape"] == [8, 1, 28, 28]  # batch 0: the file's first rows


def test_a_png_points_to_an_image_folder(tmp_path: Path) -> None:
    from PIL import Image

    Image.fromarray(np.zeros((28, 28), dtype=np.uint8)).save(tmp_path / "one.png")
    with pytest.raises(ConfigError, match=r"give a folder of class sub-folders of \.png files: \+input=dataset"):
        run_job(
            composed("+model=cnn", "+input=file", f"input.path={tmp_path / 'one.png'}", "+input.batches=3"),
            tmp_path / "a",
        )
