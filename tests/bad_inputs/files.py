"""Bad (and good) files the corpus cases read: checkpoints, inputs and captures, written per test."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from surgery.models.cnn import CNN


class Pickled:
    """An arbitrary object: reading it back would need full unpickling, which surgery never does."""


def _cnn_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in CNN().state_dict().items()}


def truncated_safetensors(d: Path) -> None:
    save_file(_cnn_state(), str(d / "ckpt.safetensors"))
    data = (d / "ckpt.safetensors").read_bytes()
    (d / "ckpt.safetensors").write_bytes(data[: len(data) // 2])


def corrupt_pt(d: Path) -> None:
    (d / "ckpt.pt").write_bytes(b"this is not a checkpoint\x00\x01\x02" * 10)


def pickled_object_pt(d: Path) -> None:
    torch.save({"weights": Pickled()}, d / "ckpt.pt")


def plain_pickle_pt(d: Path) -> None:
    (d / "ckpt.pt").write_bytes(pickle.dumps({"block1.conv.weight": [1, 2, 3]}))


def wrong_keys_pt(d: Path) -> None:
    torch.save({"encoder.weight": torch.zeros(2, 2), "encoder.bias": torch.zeros(2)}, d / "ckpt.pt")


def wrong_shapes_safetensors(d: Path) -> None:
    state = _cnn_state()
    state["classifier.1.weight"] = torch.zeros(5, 288)
    state["classifier.1.bias"] = torch.zeros(5)
    save_file(state, str(d / "ckpt.safetensors"))


def list_pt(d: Path) -> None:
    torch.save([torch.zeros(2), torch.ones(2)], d / "ckpt.pt")


def wrong_suffix(d: Path) -> None:
    torch.save(_cnn_state(), d / "ckpt.ckpt")


def checkpoint_dir(d: Path) -> None:
    (d / "ckpt.pt").mkdir()


def wrong_shape_input(d: Path) -> None:
    torch.save(torch.randn(3, 5), d / "digit.pt")


def corrupt_npy(d: Path) -> None:
    (d / "digit.npy").write_bytes(b"\x93NUMPY garbage")


def object_npy(d: Path) -> None:
    np.save(d / "digit.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)


def input_dict(d: Path) -> None:
    save_file({"image": torch.randn(1, 28, 28)}, str(d / "digit.safetensors"))


def text_input(d: Path) -> None:
    (d / "digit.txt").write_text("1 2 3\n")


def corrupt_png(d: Path) -> None:
    (d / "digit.png").write_bytes(b"not a png at all")


def bomb_png(d: Path) -> None:
    """157 bytes declaring a 20000×20000 greyscale image (a decompression bomb)."""
    from tests.test_files import png_bytes

    (d / "digit.png").write_bytes(png_bytes(20000, 20000, [bytes(20000)] * 4))


def captures(d: Path) -> None:
    save_file({"capture_block3/block3/output": torch.randn(2, 32, 3, 3)}, str(d / "captures.safetensors"))


def misshaped_captures(d: Path) -> None:
    save_file({"capture_block3/block3/output": torch.randn(2, 32, 4, 4)}, str(d / "captures.safetensors"))


def corrupt_captures(d: Path) -> None:
    (d / "captures.safetensors").write_bytes(b"\xff" * 64)


WRITERS: dict[str, Callable[[Path], None]] = {
    f.__name__: f
    for f in (
        truncated_safetensors, corrupt_pt, pickled_object_pt, plain_pickle_pt, wrong_keys_pt,
        wrong_shapes_safetensors, list_pt, wrong_suffix, checkpoint_dir, wrong_shape_input, corrupt_npy,
        object_npy, input_dict, text_input, corrupt_png, bomb_png, captures, misshaped_captures, corrupt_captures,
    )
}  # fmt: skip
