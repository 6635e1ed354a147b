"""Data sets a run can read: scikit-learn's bundled digits (read without importing it), and local files or folders.

Every source is a ``torch.utils.data.Dataset`` of ``(x, y)`` pairs read lazily where the format
allows it (image folders, .safetensors, ``datasets`` directories), so a DataLoader streams them
batch by batch and memory stays flat as the data set grows. ``.npz`` and ``.pt`` files are read
whole (neither format can be read a slice at a time). The files are others': what they declare is
checked before it is read (``surgery/files``), a batch's decoded size is checked against
``limits.memory_gb``, and under ``safe=true`` no path in a data directory leads outside it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

from surgery.core.limits import check_memory
from surgery.core.tensors import owned
from surgery.errors import ConfigError
from surgery.files.gate import listing
from surgery.files.images import open_png, png_decoded_bytes, read_png
from surgery.files.libraries import gzip_text, safetensors_reader
from surgery.files.paths import inside, must_be_file
from surgery.files.tensors import (
    SAFETENSORS_DTYPE_BYTES,
    npz_names,
    read_npy,
    read_npz,
    read_tensors,
    safetensors_bytes,
)

SPLITS = ("train", "test", "all")
SPLIT_SEED = 0  # the digits split is fixed: the same test set in every run, whatever the run's seed
TEST_SHARE = 0.2
IMAGE_SUFFIXES = (".png",)


DIGITS_FILE = ("datasets", "data", "digits.csv.gz")  # inside the sklearn package; 1797 rows of 64 pixels + label


def bundled_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits as ``[1797, 1, 8, 8]`` floats in [0, 1] and int64 labels, read from its file.

    The package is located (``find_spec``) but not imported: importing scikit-learn loads SciPy and
    takes longer than the rest of a run. Without the file where it is expected (another layout), the
    data come from ``sklearn.datasets.load_digits()``; both give the same tensors.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ConfigError("input.source: digits needs scikit-learn; pip install scikit-learn")
    for folder in spec.submodule_search_locations or []:
        path = Path(folder).joinpath(*DIGITS_FILE)
        if path.is_file():
            import numpy as np  # already loaded by torch

            with gzip_text(path, "input.source") as f:
                rows = torch.from_numpy(np.loadtxt(f, delimiter=","))  # what load_digits runs on the same file
            return rows[:, :-1].float().div_(16.0).reshape(-1, 1, 8, 8), rows[:, -1].long()
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.from_numpy(data.images).float().div_(16.0)[:, None]  # pixel values are 0..16
    return x, torch.from_numpy(data.target).long()


def digits(split: str, image_shape: Sequence[int]) -> TensorDataset:
    """scikit-learn's 1797 bundled 8×8 digits as [C, H, W] floats in [0, 1] resized to ``image_shape``; labels 0-9.

    The train/test split is a fixed permutation (seed ``SPLIT_SEED``): 359 test and 1438 train examples.
    """
    x, y = bundled_digits()
    if len(image_shape) != 3:
        raise ConfigError(
            f"input.source: digits are images; the model's input shape must be [batch, channels, height, width],"
            f" got {[None, *image_shape]}"
        )
    channels, height, width = (int(s) for s in image_shape)
    # interpolated, expanded to the channels and indexed by the split: about three copies at the asked size
    check_memory(3 * len(y) * channels * height * width * 4, "input.shape", f"{len(y)} digits resized to {image_shape}")
    if (height, width) != (8, 8):
        x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
    x = x.expand(-1, channels, -1, -1).contiguous()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(y) * TEST_SHARE)
    chosen = {"test": order[:n_test], "train": order[n_test:], "all": torch.arange(len(y))}[split]
    return TensorDataset(x[chosen], y[chosen])


class ImageFolder(Dataset):
    """A folder of class sub-folders of PNG images; labels are the sorted sub-folder names' positions.

    Under ``safe=true`` a class sub-folder or image that is a symlink out of ``root`` is refused.
    """

    def __init__(self, root: Path, process: Callable[[Any], torch.Tensor] | None = None) -> None:
        self.process = process  # PIL image → [C, H, W], e.g. a vision model's processor (surgery.vision); None: [0, 1]
        classes = [name for name in listing(root, "input.path") if (root / name).is_dir()]
        if not classes:
            raise ConfigError(f"input.path: {str(root)!r} has no class sub-folders (e.g. {root}/0/a.png, {root}/1/...)")
        self.classes = classes
        where = f"the image folder {str(root)!r}"
        self.files = [
            (inside(Path(name, file), root, "input.path", where), label)
            for label, name in enumerate(classes)
            for file in listing(inside(name, root, "input.path", where), "input.path")
            if Path(file).suffix.lower() in IMAGE_SUFFIXES
        ]
        if not self.files:
            raise ConfigError(f"input.path: {str(root)!r} holds no .png images in its class sub-folders")
        for file, _ in self.files:
            must_be_file(file, "input.path")
        self.shape: tuple[int, ...] | None = None  # the first image read's; decoded with its batch, never before

    def _image(self, i: int) -> torch.Tensor:
        if self.process is not None:
            return self.process(open_png(self.files[i][0], "input.path"))
        image = read_png(self.files[i][0], "input.path")
        return image[None] if image.dim() == 2 else image

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self._image(i)
        self.shape = self.shape or tuple(image.shape)
        if tuple(image.shape) != self.shape:
            raise ConfigError(
                f"input.path: images of mixed sizes: {str(self.files[i][0])!r} is {list(image.shape)}, the first"
                f" image is {list(self.shape)}; resize them to one size"
            )
        return image, torch.tensor(self.files[i][1])

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A batch, its decoded size (from the PNG headers) checked before any image is decoded."""
        decoded = sum(png_decoded_bytes(self.files[i][0], "input.path") for i in indices)
        check_memory(2 * decoded, "input.batch_size", f"{len(indices)} images decoded and stacked")
        return [self[i] for i in indices]


class SafetensorsRows(Dataset):
    """Rows of two arrays of a .safetensors file, read a batch at a time (never the whole file)."""

    def __init__(self, path: Path, x_key: str, y_key: str | None) -> None:
        self.path, self.x_key, self.y_key = str(path), x_key, y_key
        safetensors_bytes(path, "input.path")  # the header fits the file (a batch is checked when read)
        with safetensors_reader(self.path, "input.path") as f:
            keys = list(f.keys())  # noqa: SIM118 - not a dict
            check_keys(path, keys, x_key, y_key)
            self.length = f.get_slice(x_key).get_shape()[0]
            self.row_bytes = sum(
                _row_bytes(f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in (x_key, y_key) if k
            )

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        lo, hi = min(indices), max(indices) + 1
        check_memory(2 * (hi - lo) * self.row_bytes, "input.batch_size", f"rows {lo}..{hi - 1} of {self.path!r}")
        with safetensors_reader(self.path, "input.path") as f:
            xs = owned(f.get_slice(self.x_key)[lo:hi])
            ys = owned(f.get_slice(self.y_key)[lo:hi]) if self.y_key else None
        return [(xs[i - lo], ys[i - lo]) if ys is not None else (xs[i - lo],) for i in indices]


def _row_bytes(shape: Sequence[int], dtype: str) -> int:
    """The bytes of one row of a safetensors array (its first dim is the row)."""
    per = SAFETENSORS_DTYPE_BYTES.get(dtype.upper(), 8)
    for size in shape[1:]:
        per *= int(size)
    return per


def check_keys(path: Path, keys: Sequence[str], x_key: str, y_key: str | None) -> None:
    """Refuse a file without ``x_key`` or ``y_key``, listing what it has."""
    for which, key in (("x_key", x_key), ("y_key", y_key)):
        if key is not None and key not in keys:
            raise ConfigError(
                f"input.{which}: {key!r} is not in {str(path)!r}; it holds {', '.join(keys)}"
                f" (set input.{which}=NAME{'; or input.y_key=null for unlabelled data' if which == 'y_key' else ''})"
            )


def whole_file(path: Path, x_key: str, y_key: str | None) -> TensorDataset:
    """The two arrays of an .npz or a weights-only .pt file (read whole: neither reads by slices)."""
    if path.suffix.lower() == ".npz":
        check_keys(path, npz_names(path, "input.path"), x_key, y_key)
        tensors = read_npz(path, [k for k in (x_key, y_key) if k is not None], "input.path")
    else:
        tensors = read_tensors(path, "input.path")
        check_keys(path, list(tensors), x_key, y_key)
    x = tensors[x_key]
    if y_key is None:
        return TensorDataset(x)
    y = tensors[y_key]
    if len(y) != len(x):
        raise ConfigError(f"input.y_key: {y_key!r} has {len(y)} rows but {x_key!r} has {len(x)}")
    return TensorDataset(x, y)


def local(
    path: Path, x_key: str, y_key: str | None, split: str, process: Callable[[Any], torch.Tensor] | None = None
) -> Dataset:
    """A local data set by what ``path`` is: a ``datasets`` directory, an image folder, or a file.

    ``process`` (a PIL image → ``[C, H, W]``) replaces the plain decoding of an image folder's files and of a
    ``datasets`` Image column ``x_key``."""
    if not path.exists():
        raise ConfigError(f"input.path: {str(path)!r} does not exist")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            from surgery.data.hf import HFRows

            return HFRows(path, x_key, y_key, split, process)
        return ImageFolder(path, process)
    must_be_file(path, "input.path")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return SafetensorsRows(path, x_key, y_key)
    if suffix in (".npz", ".pt", ".pth"):
        return whole_file(path, x_key, y_key)
    if suffix == ".npy":  # one array of inputs, no labels: x_key and y_key do not apply
        return TensorDataset(read_npy(path, "input.path"))
    raise ConfigError(
        f"input.path: {str(path)!r} is not a data set; give a folder of class sub-folders of .png images, an .npz,"
        " .pt or .safetensors file with arrays x_key and y_key, an .npy array of inputs (unlabelled), or a"
        " `datasets` directory written by save_to_disk"
    )


def limited(data: Dataset, limit: int | None) -> Dataset:
    """The first ``limit`` examples (all when None)."""
    if limit is None or limit >= len(data):  # type: ignore[arg-type]
        return data
    return Subset(data, range(limit))


def describe(data: Any) -> str:
    """A short name of a data set for reports."""
    return f"{type(data).__name__}({len(data)})"
