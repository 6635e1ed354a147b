"""Files read in: every reader returns owned, aligned tensors; a PNG is size-checked before decoding."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from surgery.actions.ops import load_patch
from surgery.core.tensors import ALIGNMENT, is_owned, owned
from surgery.errors import ConfigError
from surgery.files.images import MAX_PNG_PIXELS
from surgery.files.tensors import read_input_file, read_tensors


def png_bytes(width: int, height: int, rows: list[bytes]) -> bytes:
    """An 8-bit greyscale PNG declaring ``width``×``height``, with ``rows`` (unfiltered) as its pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # bit depth 8, greyscale, no interlace
    pixels = zlib.compress(b"".join(b"\x00" + row for row in rows))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def assert_owned(t: torch.Tensor) -> None:
    """Owns its storage (no view into a file's buffer) and starts on a 64-byte boundary."""
    assert t.is_contiguous()
    assert t.data_ptr() % 64 == 0, f"data_ptr % 64 == {t.data_ptr() % 64}"
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert t.storage_offset() == 0


def misaligned_file(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file whose second tensor starts 12 bytes after the first: never on a 64-byte boundary."""
    tensors = {"a": torch.arange(3, dtype=torch.float32), "b": torch.randn(4, 5)}
    save_file(tensors, str(path))
    return tensors


def test_a_tensor_straight_from_safetensors_is_misaligned_and_owned_fixes_it(tmp_path: Path) -> None:
    misaligned_file(tmp_path / "t.safetensors")
    raw = load_file(str(tmp_path / "t.safetensors"))["b"]
    assert raw.data_ptr() % ALIGNMENT != 0 and not is_owned(raw)  # what the readers must never hand on
    copy = owned(raw)
    assert_owned(copy)
    assert is_owned(copy) and torch.equal(copy, raw)


def test_checkpoint_readers_return_owned_aligned_tensors(tmp_path: Path) -> None:
    tensors = misaligned_file(tmp_path / "t.safetensors")
    torch.save({"state_dict": tensors}, tmp_path / "t.pt")
    torch.save(tensors["b"][1:], tmp_path / "view.pt")  # a view saved with its whole storage
    for name in ("t.safetensors", "t.pt"):
        read = read_tensors(tmp_path / name, "model.checkpoint")
        assert read.keys() == tensors.keys()
        for key, value in read.items():
            assert_owned(value)
            assert torch.equal(value, tensors[key])
    view = read_tensors(tmp_path / "view.pt", "model.checkpoint")["tensor"]
    assert_owned(view)
    assert torch.equal(view, tensors["b"][1:])


def test_input_readers_return_owned_aligned_tensors(tmp_path: Path) -> None:
    tensors = misaligned_file(tmp_path / "x.safetensors")
    torch.save(tensors["b"], tmp_path / "x.pt")
    np.save(tmp_path / "x.npy", tensors["b"].numpy())
    (tmp_path / "x.png").write_bytes(png_bytes(5, 3, [bytes([0, 51, 102, 153, 255])] * 3))
    for name, key in (("x.safetensors", "b"), ("x.pt", None), ("x.npy", None)):
        value = read_input_file(tmp_path / name, key)
        assert_owned(value)
        assert torch.equal(value, tensors["b"])
    image = read_input_file(tmp_path / "x.png", None)
    assert_owned(image)
    assert torch.equal(image, torch.tensor([0, 51, 102, 153, 255], dtype=torch.float32).div(255).expand(3, 5))


def test_patch_source_is_owned_and_aligned(tmp_path: Path) -> None:
    tensors = misaligned_file(tmp_path / "captures.safetensors")
    source = load_patch({"file": str(tmp_path / "captures.safetensors"), "key": "b"}, "actions.p.from")
    assert_owned(source)
    assert torch.equal(source, tensors["b"])


def test_png_bomb_is_refused_from_its_header_without_decoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 157 bytes declaring 20000×20000: decoding it takes seconds and 1.6 GB of floats
    (tmp_path / "bomb.png").write_bytes(png_bytes(20000, 20000, [bytes(20000)] * 4))
    import matplotlib.image

    def no_decoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("the PNG was decoded")

    monkeypatch.setattr(matplotlib.image, "imread", no_decoding)
    with pytest.raises(ConfigError) as caught:
        read_input_file(tmp_path / "bomb.png", None)
    assert str(caught.value) == (
        f"input.path: {str(tmp_path / 'bomb.png')!r} declares a 20000×20000 image; a PNG input may have at most"
        f" 16384 pixels a side and {MAX_PNG_PIXELS} pixels (4096×4096) in all. Resize it first"
    )


@pytest.mark.parametrize(("width", "height"), [(16385, 1), (1, 16385), (4097, 4096), (0, 5)])
def test_png_past_either_cap_or_empty_is_refused(tmp_path: Path, width: int, height: int) -> None:
    (tmp_path / "x.png").write_bytes(png_bytes(width, height, [bytes(width)]))
    with pytest.raises(ConfigError, match=f"declares a {width}×{height} image"):
        read_input_file(tmp_path / "x.png", None)


def test_png_at_the_caps_passes_the_header_check(tmp_path: Path) -> None:
    from surgery.files.images import png_size

    (tmp_path / "x.png").write_bytes(png_bytes(16384, 1024, [bytes(16384)]))
    assert png_size(tmp_path / "x.png", "input.path") == (16384, 1024)  # 16M pixels: the cap exactly
