"""Data sets a run can read: scikit-learn's bundled digits, and local files or folders.

Every source is a ``torch.utils.data.Dataset`` of ``(x, y)`` pairs read lazily where the format
allows it (image folders, .safetensors, ``datasets`` directories), so a DataLoader streams them
batch by batch and memory stays flat as the data set grows. ``.npz`` and ``.pt`` files are read
whole (neither format can be read a slice at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

from surgery.core.tensors import owned
from surgery.errors import ConfigError

SPLITS = ("train", "test", "all")
SPLIT_SEED = 0  # the digits split is fixed: the same test set in every run, whatever the run's seed
TEST_SHARE = 0.2
IMAGE_SUFFIXES = (".png",)


def digits(split: str, image_shape: Sequence[int]) -> TensorDataset:
    """scikit-learn's 1797 bundled 8×8 digits as [C, H, W] floats in [0, 1] resized to ``image_shape``; labels 0-9.

    The train/test split is a fixed permutation (seed ``SPLIT_SEED``): 359 test and 1438 train examples.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("input.source: digits needs scikit-learn; pip install scikit-learn") from None
    data = load_digits()
    x = torch.from_numpy(data.images).float().div_(16.0)[:, None]  # [N, 1, 8, 8]; pixel values are 0..16
    y = torch.from_numpy(data.target).long()
    if len(image_shape) != 3:
        raise ConfigError(
            f"input.source: digits are images; the model's input shape must be [batch, channels, height, width],"
            f" got {[None, *image_shape]}"
        )
    channels, height, width = (int(s) for s in image_shape)
    if (height, width) != (8, 8):
        x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
    x = x.expand(-1, channels, -1, -1).contiguous()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(y) * TEST_SHARE)
    chosen = {"test": order[:n_test], "train": order[n_test:], "all": torch.arange(len(y))}[split]
    return TensorDataset(x[chosen], y[chosen])


class ImageFolder(Dataset):
    """A folder of class sub-folders of PNG images; labels are the sorted sub-folder names' positions."""

    def __init__(self, root: Path) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        if not classes:
            raise ConfigError(f"input.path: {str(root)!r} has no class sub-folders (e.g. {root}/0/a.png, {root}/1/...)")
        self.classes = classes
        self.files = [
            (f, label)
            for label, name in enumerate(classes)
            for f in sorted((root / name).iterdir())
            if f.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not self.files:
            raise ConfigError(f"input.path: {str(root)!r} holds no .png images in its class sub-folders")
        self.shape = tuple(self._image(0).shape)

    def _image(self, i: int) -> torch.Tensor:
        from surgery.app.io import read_png

        image = read_png(self.files[i][0], "input.path")
        return image[None] if image.dim() == 2 else image

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self._image(i)
        if tuple(image.shape) != self.shape:
            raise ConfigError(
                f"input.path: images of mixed sizes: {str(self.files[i][0])!r} is {list(image.shape)}, the first"
                f" image is {list(self.shape)}; resize them to one size"
            )
        return image, torch.tensor(self.files[i][1])


class SafetensorsRows(Dataset):
    """Rows of two arrays of a .safetensors file, read a batch at a time (never the whole file)."""

    def __init__(self, path: Path, x_key: str, y_key: str | None) -> None:
        from safetensors import safe_open

        self.path, self.x_key, self.y_key = str(path), x_key, y_key
        with safe_open(self.path, framework="pt") as f:
            keys = list(f.keys())  # noqa: SIM118 - not a dict
            check_keys(path, keys, x_key, y_key)
            self.length = f.get_slice(x_key).get_shape()[0]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        from safetensors import safe_open

        lo, hi = min(indices), max(indices) + 1
        with safe_open(self.path, framework="pt") as f:
            xs = owned(f.get_slice(self.x_key)[lo:hi])
            ys = owned(f.get_slice(self.y_key)[lo:hi]) if self.y_key else None
        return [(xs[i - lo], ys[i - lo]) if ys is not None else (xs[i - lo],) for i in indices]


class HFRows(Dataset):
    """Rows of a Hugging Face ``datasets`` directory written by ``save_to_disk`` (memory-mapped Arrow)."""

    def __init__(self, path: Path, x_key: str, y_key: str | None, split: str) -> None:
        try:
            from datasets import DatasetDict, load_from_disk
        except ImportError:
            raise ConfigError("input.path: a datasets directory needs `pip install datasets`") from None
        data = load_from_disk(str(path))
        if isinstance(data, DatasetDict):
            if split not in data:
                raise ConfigError(f"input.split: {str(path)!r} has splits {', '.join(data)}, not {split!r}")
            data = data[split]
        check_keys(path, list(data.column_names), x_key, y_key)
        self.data = data.with_format("torch", columns=[x_key] + ([y_key] if y_key else []))
        self.x_key, self.y_key = x_key, y_key

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        rows = self.data[indices]
        xs = torch.as_tensor(rows[self.x_key])
        if self.y_key is None:
            return [(x,) for x in xs]
        ys = torch.as_tensor(rows[self.y_key])
        return list(zip(xs, ys, strict=True))


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
        import numpy as np

        try:
            with np.load(path, allow_pickle=False) as arrays:
                check_keys(path, list(arrays.files), x_key, y_key)
                tensors = {k: owned(torch.from_numpy(arrays[k])) for k in (x_key, y_key) if k is not None}
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"input.path: cannot read {str(path)!r} as .npz ({e})") from None
    else:
        from surgery.app.io import read_tensors

        tensors = read_tensors(path, "input.path")
        check_keys(path, list(tensors), x_key, y_key)
    x = tensors[x_key]
    if y_key is None:
        return TensorDataset(x)
    y = tensors[y_key]
    if len(y) != len(x):
        raise ConfigError(f"input.y_key: {y_key!r} has {len(y)} rows but {x_key!r} has {len(x)}")
    return TensorDataset(x, y)


def local(path: Path, x_key: str, y_key: str | None, split: str) -> Dataset:
    """A local data set by what ``path`` is: a ``datasets`` directory, an image folder, or a file."""
    if not path.exists():
        raise ConfigError(f"input.path: {str(path)!r} does not exist")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return HFRows(path, x_key, y_key, split)
        return ImageFolder(path)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return SafetensorsRows(path, x_key, y_key)
    if suffix in (".npz", ".pt", ".pth"):
        return whole_file(path, x_key, y_key)
    raise ConfigError(
        f"input.path: {str(path)!r} is not a data set; give a folder of class sub-folders of .png images, an .npz,"
        " .pt or .safetensors file with arrays x_key and y_key, or a `datasets` directory written by save_to_disk"
    )


def limited(data: Dataset, limit: int | None) -> Dataset:
    """The first ``limit`` examples (all when None)."""
    if limit is None or limit >= len(data):  # type: ignore[arg-type]
        return data
    return Subset(data, range(limit))


def describe(data: Any) -> str:
    """A short name of a data set for reports."""
    return f"{type(data).__name__}({len(data)})"
