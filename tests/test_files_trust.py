"""Files from others (issue 25): a red-team table of bombs, huge images, paths leading out of their
directory, disk budgets and ``max_bytes`` under generation.

Each case builds its attack in ``tmp_path`` (small on disk, huge as declared), runs the reader under
the limits safe mode enforces (or smaller ones, so that a bomb of 64 MB stands in for one of 4 GB),
and asserts a one-line refusal that names the key, reached within seconds and before anything was
decompressed or decoded (the decoders are replaced by ones that fail the test if called).
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from surgery.core.limits import SAFE_DEFAULTS, Limits, enforced
from surgery.data.loader import data_loader, dataset_input
from surgery.errors import ConfigError
from surgery.files.checkpoints import load_checkpoint
from surgery.files.tensors import read_input_file, read_tensors
from surgery.files.write import write_atomic, write_json, write_tensors

REPO = Path(__file__).resolve().parents[1]
SMALL = Limits(memory_gb=0.03, disk_gb=0.03, count=10_000, paths_inside=True)  # 32 MB: a 64 MB bomb stands for 4 GB
SECONDS = 10.0  # every refusal comes within this, on a loaded 2-core machine
BOMB_FLOATS = 2**24  # 64 MB of float32 zeros: about 65 KB deflated


# ---------------------------------------------------------------- builders


def png_bytes(width: int, height: int, colour: int = 0, rows: int = 1) -> bytes:
    """A PNG whose header declares ``width``×``height`` (8-bit, ``colour`` type) but which holds ``rows`` rows only."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    channels = {0: 1, 2: 3, 6: 4}[colour]
    header = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    pixels = zlib.compress(b"".join(b"\x00" + bytes(width * channels) for _ in range(rows)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def real_png(pixels: np.ndarray) -> bytes:
    """A whole 8-bit greyscale PNG of ``pixels``."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def deflated_copy(data: bytes, path: Path) -> Path:
    """The zip in ``data`` written again with every entry deflated (how a 4 GB .pt becomes a few MB)."""
    import io

    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return path


def torch_bytes(obj: Any) -> bytes:
    import io

    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def lying_zip(path: Path, declared: int, entries: int = 3) -> Path:
    """A torch-like zip whose central directory declares ``declared`` bytes for each of ``entries`` tiny entries."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for i in range(entries):
            archive.writestr(f"archive/data/{i}", b"\x00" * 16)
    data = bytearray(path.read_bytes())
    at = 0
    while (at := data.find(b"PK\x01\x02", at)) >= 0:  # each central directory entry: uncompressed size at +24
        data[at + 24 : at + 28] = struct.pack("<I", declared)
        at += 4
    path.write_bytes(bytes(data))
    return path


def npy_declaring(path: Path, shape: tuple[int, ...]) -> Path:
    """An .npy whose header declares ``shape`` float32 but which holds 16 bytes of data."""
    header = {"descr": "<f4", "fortran_order": False, "shape": shape}
    with path.open("wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(bytes(16))
    return path


def safetensors_declaring(path: Path, shape: list[int]) -> Path:
    """A .safetensors whose header declares ``shape`` float32 but which holds 16 bytes of data."""
    n = int(np.prod(shape)) * 4
    header = json.dumps({"x": {"dtype": "F32", "shape": shape, "data_offsets": [0, n]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    return path


def image_cells(root: Path, cells: list[dict[str, Any]]) -> Path:
    """A ``datasets`` directory with an Image column ``x`` holding ``cells`` ({bytes, path}) as given, labels ``y``.

    ``save_to_disk`` of an Image column reads every path (and fetches a URL); written as a plain struct
    and relabelled Image in dataset_info.json, the directory holds what a tampered one would.
    """
    import datasets

    features = datasets.Features(
        {"x": {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}, "y": datasets.Value("int64")}
    )
    table = {"x": cells, "y": list(range(len(cells)))}
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(root))
    info = json.loads((root / "dataset_info.json").read_text())
    info["features"]["x"] = {"_type": "Image"}
    (root / "dataset_info.json").write_text(json.dumps(info))
    return root


def numbers_dataset(root: Path, rows: int = 4) -> Path:
    import datasets

    datasets.Dataset.from_dict(
        {"x": np.arange(rows * 3).reshape(rows, 3).tolist(), "y": list(range(rows))}
    ).save_to_disk(str(root))
    return root


def load(path: Path, batch_size: int = 64, **keys: Any) -> list[Any]:
    """Every batch of ``input.kind: dataset`` at ``path``."""
    return list(data_loader(dataset_input({"path": str(path), "batch_size": batch_size, **keys})))


# ---------------------------------------------------------------- the red-team table


@dataclass(frozen=True)
class Case:
    """An attack built in a directory; ``run`` reads it and must be refused with ``message`` under ``limits``."""

    name: str
    build: Callable[[Path], Callable[[], Any]]
    message: str  # a regex the one-line refusal matches from its start (the key first)
    limits: Limits = SAFE_DEFAULTS


def _bomb_pt(d: Path, floats: int = BOMB_FLOATS) -> Path:
    return deflated_copy(torch_bytes({"x": torch.zeros(floats), "y": torch.zeros(4)}), d / "bomb.pt")


def _bomb_npz(d: Path, floats: int = BOMB_FLOATS) -> Path:
    np.savez_compressed(d / "bomb.npz", x=np.zeros(floats, np.float32), y=np.zeros(4, np.int64))
    return d / "bomb.npz"


def _outside_png(d: Path) -> Path:
    (d / "outside").mkdir(exist_ok=True)
    (d / "outside" / "secret.png").write_bytes(real_png(np.full((4, 4), 7)))
    return d / "outside" / "secret.png"


def _image_folder(d: Path, n: int = 2) -> Path:
    root = d / "images"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(n):
            (root / label / f"{i}.png").write_bytes(real_png(np.full((4, 4), i)))
    return root


def _symlinked_image(d: Path) -> Callable[[], Any]:
    root = _image_folder(d)
    (root / "a" / "2.png").symlink_to(_outside_png(d))
    return lambda: load(root)


def _symlinked_class(d: Path) -> Callable[[], Any]:
    root = _image_folder(d)
    _outside_png(d)
    (root / "c").symlink_to(d / "outside", target_is_directory=True)
    return lambda: load(root)


def _state_json_naming(d: Path, absolute: bool) -> Callable[[], Any]:
    """A datasets directory whose state.json names its Arrow file outside it (by ``../`` or an absolute path)."""
    root = numbers_dataset(d / "ds")
    state = json.loads((root / "state.json").read_text())
    arrow = root / state["_data_files"][0]["filename"]
    arrow.rename(d / "elsewhere.arrow")
    state["_data_files"][0]["filename"] = str(d / "elsewhere.arrow") if absolute else "../elsewhere.arrow"
    (root / "state.json").write_text(json.dumps(state))
    return lambda: load(root)


def _state_json_escape(d: Path) -> Callable[[], Any]:
    return _state_json_naming(d, absolute=False)


def _state_json_absolute(d: Path) -> Callable[[], Any]:
    return _state_json_naming(d, absolute=True)


def _arrow_symlink(d: Path) -> Callable[[], Any]:
    root = numbers_dataset(d / "ds")
    name = json.loads((root / "state.json").read_text())["_data_files"][0]["filename"]
    (root / name).rename(d / "elsewhere.arrow")
    (root / name).symlink_to(d / "elsewhere.arrow")
    return lambda: load(root)


def _split_escape(d: Path) -> Callable[[], Any]:
    import datasets

    numbers_dataset(d / "elsewhere")
    (d / "dd").mkdir()
    datasets.DatasetDict({"test": datasets.load_from_disk(str(d / "elsewhere"))}).save_to_disk(str(d / "dd"))
    (d / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["test", "../elsewhere"]}))
    return lambda: load(d / "dd")


def _hf_cell(cell: dict[str, Any]) -> Callable[[Path], Callable[[], Any]]:
    def build(d: Path) -> Callable[[], Any]:
        _outside_png(d)
        root = image_cells(d / "ds", [cell | {"path": str(cell["path"]).replace("TMP", str(d))}])
        return lambda: load(root)

    return build


def _hf_big_batch(d: Path) -> Callable[[], Any]:
    big = png_bytes(4096, 4096)  # 16 MB decoded each, 150 bytes on disk
    root = image_cells(d / "ds", [{"bytes": big, "path": None} for _ in range(64)])
    return lambda: load(root)


def _folder_big_batch(d: Path) -> Callable[[], Any]:
    root = d / "images"
    (root / "a").mkdir(parents=True)
    for i in range(64):
        (root / "a" / f"{i:02d}.png").write_bytes(png_bytes(4096, 4096, colour=6))  # 256 MB of floats each
    return lambda: load(root)


def _nested_images(d: Path) -> Callable[[], Any]:
    """A column of lists of images: ``datasets`` would decode (and fetch) each; only a plain Image column is read."""
    import datasets

    cell = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    features = datasets.Features({"x": datasets.List(cell), "y": datasets.Value("int64")})
    table = {"x": [[{"bytes": None, "path": "http://example.invalid/a.png"}]], "y": [0]}
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(d / "ds"))
    info = json.loads((d / "ds" / "dataset_info.json").read_text())
    info["features"]["x"] = {"feature": {"_type": "Image"}, "_type": "List"}
    (d / "ds" / "dataset_info.json").write_text(json.dumps(info))
    return lambda: load(d / "ds")


def _hf_not_a_file(d: Path) -> Callable[[], Any]:
    (d / "ds_dir").mkdir()
    root = image_cells(d / "ds", [{"bytes": None, "path": "sub"}])
    (root / "sub").mkdir()
    return lambda: load(root)


def _hf_rows_big(d: Path) -> Callable[[], Any]:
    """16 rows of 2 MB: a batch of 16 (formatted and collated, 64 MB) is refused before it is read."""
    import datasets

    x = np.zeros((16, 2**19), np.float32)
    datasets.Dataset.from_dict({"x": x, "y": np.arange(16)}).save_to_disk(str(d / "ds"))
    return lambda: load(d / "ds", batch_size=16)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _fifo_image(d: Path) -> Callable[[], Any]:
    root = _image_folder(d)
    _fifo(root / "a" / "2.png")
    return lambda: load(root)


def _dev_zero_image(d: Path) -> Callable[[], Any]:
    root = _image_folder(d)
    (root / "a" / "2.png").symlink_to("/dev/zero")
    return lambda: load(root)


def _fifo_arrow(d: Path) -> Callable[[], Any]:
    root = numbers_dataset(d / "ds")
    name = json.loads((root / "state.json").read_text())["_data_files"][0]["filename"]
    (root / name).unlink()
    _fifo(root / name)
    return lambda: load(root)


def _fifo_info(d: Path) -> Callable[[], Any]:
    root = numbers_dataset(d / "ds")
    (root / "dataset_info.json").unlink()
    _fifo(root / "dataset_info.json")
    return lambda: load(root)


def _big_state(d: Path) -> Callable[[], Any]:
    root = numbers_dataset(d / "ds")
    state = json.loads((root / "state.json").read_text())
    (root / "state.json").write_text(json.dumps({**state, "padding": "x" * 2**21}))
    return lambda: load(root)


def _split_itself(d: Path) -> Callable[[], Any]:
    (d / "dd").mkdir()
    (d / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": [""]}))
    return lambda: load(d / "dd", split="test")


def _legacy(d: Path) -> Path:
    torch.save({"x": torch.zeros(4)}, d / "legacy.pt", _use_new_zipfile_serialization=False)
    return d / "legacy.pt"


def _npz_lying(d: Path) -> Path:
    import io

    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False, "shape": (10**9,)})
    with zipfile.ZipFile(d / "lie.npz", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x.npy", member.getvalue() + bytes(16))
        archive.writestr("y.npy", member.getvalue() + bytes(16))
    return d / "lie.npz"


def _npy_big(d: Path) -> Path:
    np.save(d / "big.npy", np.zeros(BOMB_FLOATS, np.float32))
    return d / "big.npy"


def _safetensors_big(d: Path) -> Path:
    save_file({"x": torch.zeros(BOMB_FLOATS // 4, 4), "y": torch.zeros(1)}, str(d / "big.safetensors"))
    return d / "big.safetensors"


def _safetensors_rows(d: Path) -> Path:
    """16 rows of 1 MB: the batch of 16 (decoded and collated, 32 MB) is refused, the file's header is not."""
    save_file({"x": torch.zeros(16, 2**18), "y": torch.zeros(16)}, str(d / "rows.safetensors"))
    return d / "rows.safetensors"


def _header_too_long(d: Path) -> Path:
    (d / "long.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    return d / "long.safetensors"


def _png_file(d: Path, width: int, height: int) -> Path:
    (d / "big.png").write_bytes(png_bytes(width, height, colour=0))
    return d / "big.png"


def made(make: Callable[[Path], Path], read: Callable[[Path], Any]) -> Callable[[Path], Callable[[], Any]]:
    """A case's build: ``make`` the file now (outside the timed refusal), ``read`` it when run."""

    def build(d: Path) -> Callable[[], Any]:
        path = make(d)
        return lambda: read(path)

    return build


def as_input(path: Path) -> Any:
    return read_input_file(path, None)


def patch_source(path: Path) -> Any:
    from surgery.actions.sources import load_patch

    return load_patch({"file": str(path), "key": "x"}, "actions.p.from")


def checkpoint(path: Path) -> Any:
    return read_tensors(path, "model.checkpoint")


def image_bytes_load(d: Path, data: bytes) -> Callable[[], Any]:
    root = image_cells(d / "ds", [{"bytes": data, "path": None}])
    return lambda: load(root)


def load_digits(shape: list[int]) -> Any:
    pytest.importorskip("sklearn")
    return list(data_loader(dataset_input({"source": "digits", "shape": shape})))


def draw_digit(shape: list[int]) -> Any:
    from surgery.app.inputs import make_inputs

    return make_inputs({"kind": "digit", "shape": shape}, 0, torch.float32, torch.device("cpu"))


CASES = [
    # ---- decompression bombs: declared sizes checked before reading
    Case("pt bomb as checkpoint", made(_bomb_pt, checkpoint),
         r"model\.checkpoint: would need 0\.0625 GB \(the tensors .*bomb\.pt' declares, 0\.06\d* MB on disk\)", SMALL),
    Case("pt bomb as input", made(_bomb_pt, as_input),
         r"input\.path: would need 0\.0625 GB .*more than limits\.memory_gb=0\.03; if that is meant, raise it", SMALL),
    Case("pt bomb as data set", made(_bomb_pt, load), r"input\.path: would need 0\.0625 GB", SMALL),
    Case("pt declaring 3x3.9 GB", made(lambda d: lying_zip(d / "lie.pt", 3_900_000_000), checkpoint),
         r"model\.checkpoint: would need 10\.9 GB .*limits\.memory_gb=8; if that is meant, raise it: "
         r"limits\.memory_gb=11"),
    Case("pt legacy format", made(_legacy, checkpoint),
         r"model\.checkpoint: .*legacy\.pt' is not a zip-format torch file"),
    Case("pt bomb of 160 MB within the memory budget", made(lambda d: _bomb_pt(d, 40 * 2**20), checkpoint),
         r"model\.checkpoint: .*bomb\.pt' inflates 0\.1\d* MB of compressed data to 160 MB \(1,0\d\d×, a decomp"),
    Case("npz bomb of 160 MB within the memory budget", made(lambda d: _bomb_npz(d, 40 * 2**20), load),
         r"input\.path: .*bomb\.npz' inflates 0\.1\d* MB of compressed data to 160 MB"),
    Case("npz bomb as data set", made(_bomb_npz, load),
         r"input\.path: would need 0\.0625 GB \(the arrays .*bomb\.npz' declares", SMALL),
    Case("npz member lying header", made(_npz_lying, load),
         r"input\.path: 'x' in .*lie\.npz' declares a \[1000000000\] float32 array \(3\.73 GB\) in a member of"),
    Case("npy lying header", made(lambda d: npy_declaring(d / "lie.npy", (10**9,)), as_input),
         r"input\.path: .*lie\.npy' declares a \[1000000000\] float32 array \(3\.73 GB\) in a file of .*truncated"),
    Case("npy over the budget", made(_npy_big, as_input),
         r"input\.path: would need 0\.0625 GB \(the array .*big\.npy' declares, 64 MB on disk\)", SMALL),
    Case("safetensors lying header", made(lambda d: safetensors_declaring(d / "l.safetensors", [10**9]), checkpoint),
         r"model\.checkpoint: .*l\.safetensors' declares 3\.73 GB of tensors in a file of .*truncated"),
    Case("safetensors over the budget", made(_safetensors_big, as_input),
         r"input\.path: would need 0\.0625 GB \(the tensors .*big\.safetensors' declares", SMALL),
    Case("patch source over the budget", made(_safetensors_big, patch_source),
         r"actions\.p\.from\.file: would need 0\.0625 GB \('x' of .*big\.safetensors'\)", SMALL),
    Case("safetensors rows batch", made(_safetensors_rows, lambda p: load(p, batch_size=16)),
         r"input\.batch_size: would need 0\.0313 GB \(rows 0\.\.15 of .*rows\.safetensors'\)", SMALL),
    Case("safetensors header length", made(_header_too_long, checkpoint),
         r"model\.checkpoint: cannot read .*long\.safetensors' as \.safetensors \(its header length is not valid\)"),
    # ---- images: the caps from the header, in every reader, and a batch's decoded bytes
    Case("12000x12000 PNG in a datasets Image column",
         lambda d: image_bytes_load(d, png_bytes(12000, 12000)),
         r"input\.path: row 0 of column 'x' in .*ds' declares a 12000×12000 image; an image input may have at most"),
    Case("20000x1 PNG in a datasets Image column",
         lambda d: image_bytes_load(d, png_bytes(20000, 1)),
         r"input\.path: row 0 of column 'x' .* declares a 20000×1 image"),
    Case("64 large PNGs in a datasets batch", _hf_big_batch,
         r"input\.batch_size: would need 2 GB \(64 images decoded and stacked\), more than limits\.memory_gb=1",
         Limits(memory_gb=1, paths_inside=True)),
    Case("64 large PNGs in an image folder batch", _folder_big_batch,
         r"input\.batch_size: would need 32 GB \(64 images decoded and stacked\), more than limits\.memory_gb=8"),
    Case("one large PNG over the budget", made(lambda d: _png_file(d, 4096, 4096), as_input),
         r"input\.path: would need 0\.0625 GB \(decoding .*big\.png'\)", SMALL),
    Case("digits resized huge", lambda d: lambda: load_digits([1, 3, 4096, 4096]),
         r"input\.shape: would need 1\.01e\+03 GB \(1797 digits resized to \[3, 4096, 4096\]\)"),
    Case("digits with many channels", lambda d: lambda: load_digits([1, 10**6, 8, 8]),
         r"input\.shape: would need 1\.29e\+03 GB \(1797 digits resized to \[1000000, 8, 8\]\)"),
    Case("a drawn digit of 20000 pixels a side", lambda d: lambda: draw_digit([1, 1, 20000, 20000]),
         r"input\.shape: would need 1\.79e\+03 GB \(drawing a 20000×20000 digit\)"),
    # ---- paths a data directory names stay inside it (under safe mode), and URLs never
    Case("http image", _hf_cell({"bytes": None, "path": "http://example.invalid/a.png"}),
         r"input\.path: row 0 of column 'x' in .*ds' names 'http://example\.invalid/a\.png', a URL; surgery reads"),
    Case("https image without safe mode", _hf_cell({"bytes": None, "path": "https://example.invalid/a.png"}),
         r"input\.path: row 0 .* names 'https://example\.invalid/a\.png', a URL", Limits()),
    Case("file:// image", _hf_cell({"bytes": None, "path": "file:///etc/hostname"}), r"input\.path: .* a URL"),
    Case("s3:// image", _hf_cell({"bytes": None, "path": "s3://bucket/a.png"}), r"input\.path: .* a URL", Limits()),
    Case("absolute image path outside", _hf_cell({"bytes": None, "path": "TMP/outside/secret.png"}),
         r"input\.path: row 0 of column 'x' in .*ds' names '.*outside/secret\.png', outside .*ds'; under safe=true"),
    Case("relative image path escaping", _hf_cell({"bytes": None, "path": "../outside/secret.png"}),
         r"input\.path: row 0 .* names '\.\./outside/secret\.png', outside .*; under safe=true every path"),
    Case("image path /etc/passwd", _hf_cell({"bytes": None, "path": "/etc/passwd"}),
         r"input\.path: row 0 .* names '/etc/passwd', outside"),
    Case("image cell that is a directory", _hf_not_a_file, r"input\.path: row 0 .* names 'sub', which is not a file"),
    Case("state.json naming ../", _state_json_escape,
         r"input\.path: .*state\.json' names '\.\./elsewhere\.arrow', outside .*ds'; under safe=true"),
    Case("state.json naming an absolute file", _state_json_absolute,
         r"input\.path: .*state\.json' names '.*elsewhere\.arrow', outside"),
    Case("arrow file symlinked out", _arrow_symlink,
         r"input\.path: .*state\.json' names 'data-00000-of-00001\.arrow' \(a symlink to .*elsewhere\.arrow'\)"),
    Case("dataset_dict.json split escaping", _split_escape,
         r"input\.path: .*dataset_dict\.json' names '\.\./elsewhere', outside"),
    Case("symlinked image in a class folder", _symlinked_image,
         r"input\.path: the image folder .*images' names 'a/2\.png' \(a symlink to .*secret\.png'\), outside"),
    Case("symlinked class folder", _symlinked_class,
         r"input\.path: the image folder .*images' names 'c' \(a symlink to .*outside'\), outside"),
    Case("a nested Image column", _nested_images,
         r"input\.x_key: column 'x' of .*ds' holds Image values, which datasets would decode \(and may fetch\)"),
    Case("a datasets batch over the budget", _hf_rows_big,
         r"input\.batch_size: would need 0\.06\d* GB \(16 rows of .*ds\)", SMALL),
    # ---- pipes and devices are never opened (reading one blocks or never ends)
    Case("a pipe among the images", _fifo_image, r"input\.path: .*images/a/2\.png' is not a regular file"),
    Case("an image symlinked to /dev/zero", _dev_zero_image, r"input\.path: .*/dev/zero' is not a regular file",
         Limits()),
    Case("a pipe as the data set file", made(lambda d: _fifo(d / "data.npz"), load),
         r"input\.path: .*data\.npz' is not a regular file"),
    Case("a pipe as an Arrow file", _fifo_arrow, r"input\.path: .*data-00000-of-00001\.arrow' is not a regular file"),
    Case("a pipe as dataset_info.json", _fifo_info, r"input\.path: .*dataset_info\.json' is not a regular file"),
    Case("state.json of 2 MB over the budget", _big_state,
         r"input\.path: would need 0\.06\d* GB \(parsing .*state\.json'\)", SMALL),
    Case("a split naming its own directory", _split_itself, r"input\.path: cannot read .*dd' as a datasets directory"),
    # ---- disk: every write charged before the file appears
    Case("report.json past the disk budget", lambda d: lambda: write_json(d / "run" / "report.json", [0] * 10**5),
         r"report\.json: the run would write 0\.000\d+ GB, more than limits\.disk_gb=1e-05",
         Limits(disk_gb=0.00001)),
    Case("captures past the disk budget",
         lambda d: lambda: write_tensors(d / "run" / "captures.safetensors", {"a": torch.zeros(2**20)}),
         r"captures\.safetensors: the run would write 0\.0039\d* GB, more than limits\.disk_gb=0\.001",
         Limits(disk_gb=0.001)),
    Case("a plot past the disk budget",
         lambda d: lambda: write_atomic(d / "run" / "plot.png", lambda p: p.write_bytes(bytes(2**20))),
         r"plot\.png: the run would write 0\.000977 GB, more than limits\.disk_gb=0\.0001", Limits(disk_gb=0.0001)),
]  # fmt: skip


@pytest.fixture
def nothing_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decoder and decompressor fails the test if reached: refusals must come from what files declare."""
    import datasets
    import matplotlib.image
    from PIL import ImageFile

    def reached(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a file was decoded or decompressed before the refusal")

    monkeypatch.setattr(torch, "load", reached)
    monkeypatch.setattr(np, "load", reached)
    monkeypatch.setattr(matplotlib.image, "imread", reached)
    monkeypatch.setattr(ImageFile.ImageFile, "load", reached)
    monkeypatch.setattr(torch.nn.functional, "interpolate", reached)
    monkeypatch.setattr(datasets.Image, "decode_example", reached)  # datasets never decodes (or fetches) an image


def _too_long(signum: int, frame: Any) -> None:
    raise AssertionError("the reader blocked for 60 s")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_files_from_others_are_refused_before_they_cost(case: Case, tmp_path: Path, nothing_decoded: None) -> None:
    pytest.importorskip("datasets")
    run = case.build(tmp_path)
    signal.signal(signal.SIGALRM, _too_long)
    signal.alarm(60)  # a reader that blocks (a pipe) fails the test rather than hanging it
    clock = time.perf_counter()
    try:
        with enforced(case.limits), pytest.raises(ConfigError) as caught:
            run()
    finally:
        signal.alarm(0)
    assert time.perf_counter() - clock < SECONDS
    message = str(caught.value)
    assert "\n" not in message
    assert re.match(case.message, message), message
    assert not list(tmp_path.rglob("*.tmp"))
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").iterdir())  # no file, whole or half


# ---------------------------------------------------------------- what is not refused


def test_paths_outside_are_read_without_safe_mode(tmp_path: Path) -> None:
    """Your own data directory may point elsewhere (symlinked folders, absolute image paths); a URL never."""
    pytest.importorskip("datasets")
    secret = _outside_png(tmp_path)
    root = image_cells(
        tmp_path / "ds", [{"bytes": None, "path": str(secret)}, {"bytes": None, "path": "../outside/secret.png"}]
    )
    ((x, y),) = load(root)
    assert torch.equal(x, torch.full((2, 1, 4, 4), 7, dtype=torch.uint8)) and y.tolist() == [0, 1]
    (tmp_path / "s").mkdir()
    _symlinked_class(tmp_path / "s")
    ((x, _),) = load(tmp_path / "s" / "images")
    assert x.shape[0] == 5  # 4 images of its own and one through the symlinked folder


def test_an_image_column_reads_as_datasets_own_torch_format(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (5, 6)) for _ in range(3)]
    cells = [{"bytes": real_png(p), "path": None} for p in images[:2]]
    root = image_cells(tmp_path / "ds", [*cells, {"bytes": None, "path": "c.png"}])
    (root / "c.png").write_bytes(real_png(images[2]))
    with enforced(SAFE_DEFAULTS):
        (x, y), *_ = load(root, batch_size=3)
    theirs = datasets.load_from_disk(str(root)).with_format("torch")  # reads a relative path from the cwd: not c.png
    assert x.dtype == torch.uint8 and torch.equal(x[:2], torch.stack([theirs[0]["x"], theirs[1]["x"]]))
    assert torch.equal(x[:, 0], torch.from_numpy(np.stack(images)).to(torch.uint8)) and y.tolist() == [0, 1, 2]


def test_legitimate_files_load_bit_identically_under_safe_limits(tmp_path: Path) -> None:
    x, y = torch.randn(6, 5), torch.arange(6)
    save_file({"x": x, "y": y}, str(tmp_path / "d.safetensors"))
    deflated_copy(torch_bytes({"x": x, "y": y}), tmp_path / "d.pt")  # small and deflated: fine
    np.savez_compressed(tmp_path / "d.npz", x=x.numpy(), y=y.numpy())
    np.save(tmp_path / "x.npy", x.numpy())
    with enforced(SAFE_DEFAULTS):
        for name in ("d.safetensors", "d.pt", "d.npz"):
            ((bx, by),) = load(tmp_path / name)
            assert torch.equal(bx, x) and torch.equal(by, y), name
        assert torch.equal(read_input_file(tmp_path / "x.npy", None), x)
        assert torch.equal(read_tensors(tmp_path / "d.pt", "model.checkpoint")["x"], x)
        model = torch.nn.Linear(5, 6)
        save_file({"weight": x, "bias": y.float()}, str(tmp_path / "m.safetensors"))
        load_checkpoint(model, tmp_path / "m.safetensors")
        assert torch.equal(model.weight, x) and torch.equal(model.bias, y.float())


def test_a_run_counts_what_it_wrote_across_files(tmp_path: Path) -> None:
    with enforced(Limits(disk_gb=2.5 * 2**20 / 2**30)):  # 2.5 MB for the whole run
        write_tensors(tmp_path / "a.safetensors", {"t": torch.zeros(2**18)})  # 1 MB
        write_tensors(tmp_path / "b.safetensors", {"t": torch.zeros(2**18)})  # 2 MB
        with pytest.raises(ConfigError, match=r"^actions\.c\.to: the run would write 0\.0029\d* GB"):
            write_tensors(tmp_path / "c.safetensors", {"t": torch.zeros(2**18)}, "actions.c.to")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors"]
    write_tensors(tmp_path / "c.safetensors", {"t": torch.zeros(2**18)})  # outside enforced(): unbounded


def test_to_disk_captures_stop_at_the_disk_budget(tmp_path: Path) -> None:
    from surgery.app.job import run_job
    from tests.test_cli import composed

    cfg = composed("+model=mlp", "+actions=capture", "+actions.capture.to=disk", "+input.batches=200",
                   "limits.disk_gb=0.0001")  # fmt: skip
    clock = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        run_job(cfg, tmp_path)
    assert time.perf_counter() - clock < 30
    assert re.match(r"actions\.capture\.to: the run would write 0\.000\d+ GB, more than limits\.disk_gb=0\.0001;",
                    str(caught.value))  # fmt: skip
    shards = [p.name for p in (tmp_path / "captures").iterdir()]
    assert shards == ["batch-00000.safetensors"]  # 200 shards like the first would pass the budget: stop after it
    assert not list(tmp_path.rglob("*.tmp")) and not (tmp_path / "report.json").exists()


def test_max_bytes_holds_under_generation(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from surgery.lm.generate import generate_both
    from surgery.lm.text import encode_prompts
    from tests.lm_helpers import tiny_gpt2, word_tokenizer

    tok = word_tokenizer(["the cat sat on the mat", "a dog ran"])
    model = tiny_gpt2(len(tok), tok.eos_token_id)
    batch = encode_prompts(tok, prompt="the cat sat on the")
    capture = {"kind": "capture", "select": "transformer.h.0", "max_bytes": 2000}  # the prompt pass is 640 bytes
    with pytest.raises(ConfigError) as caught:
        generate_both(model, {"c": capture}, batch, max_new_tokens=40)
    assert str(caught.value) == (
        "actions.c.max_bytes: under mode=generate the capture holds more than max_bytes=2000 (every new token is"
        " another call); lower generate.max_new_tokens, use reduce: mean|stats or keep: last, or select fewer modules"
    )
    from surgery.core.restore import hooks_on

    assert hooks_on(model) == 0
    out = generate_both(model, {"c": {**capture, "max_bytes": 10**6}}, batch, max_new_tokens=8)
    assert len(out.captures["c"]["transformer.h.0"].calls) == 8


# ---------------------------------------------------------------- through the CLI: exit 2, one line


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "surgery", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)  # fmt: skip


def outside_run_dirs(root: Path, made: set[Path]) -> list[Path]:
    """Files in ``root`` that are neither what the test made nor under Hydra's outputs/."""
    return [p for p in root.rglob("*") if p.is_file() and p not in made and "outputs" not in p.relative_to(root).parts]


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (lambda d: str(_bomb_npz(d)), ("limits.memory_gb=0.03",), r"error: input\.path: would need 0\.0625 GB"),
        (
            lambda d: str(image_cells(d / "ds", [{"bytes": None, "path": "http://example.invalid/x.png"}])),
            (),
            r"error: input\.path: row 0 of column 'x' in .* names 'http://example\.invalid/x\.png', a URL",
        ),
        (
            lambda d: str(image_cells(d / "ds", [{"bytes": None, "path": "/etc/passwd"}])),
            (),
            r"error: input\.path: row 0 of column 'x' in .* names '/etc/passwd', outside",
        ),
    ],
    ids=["npz bomb", "http image", "absolute path"],
)
def test_cli_refuses_with_exit_2_and_one_line(make: Callable[[Path], str], args: tuple[str, ...], message: str,
                                              tmp_path: Path) -> None:  # fmt: skip
    pytest.importorskip("datasets")
    path = make(tmp_path)
    made = {p for p in tmp_path.rglob("*")}
    result = cli("+model=mlp", "+input=dataset", f"input.path={path}", "safe=true", "metrics=[]", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and re.match(message, result.stderr), result.stderr
    assert outside_run_dirs(tmp_path, made) == []


def test_cli_to_disk_stops_at_its_disk_budget(tmp_path: Path) -> None:
    result = cli("+model=mlp", "+actions=capture", "+actions.capture.to=disk", "+input.batches=500",
                 "limits.disk_gb=0.00005", "hydra.run.dir=run", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert re.fullmatch(
        r"error: actions\.capture\.to: the run would write 0\.00\d+ GB, more than limits\.disk_gb=5e-05; if that"
        r" is meant, raise it: limits\.disk_gb=1\n",
        result.stderr,
    ), result.stderr
    assert not list(tmp_path.rglob("*.tmp"))
    assert [p.name for p in (tmp_path / "run" / "captures").iterdir()] == ["batch-00000.safetensors"]
    assert [p for p in tmp_path.rglob("*") if p.is_file() and p.relative_to(tmp_path).parts[0] != "run"] == []
