"""Rows of a Hugging Face ``datasets`` directory (``save_to_disk``), read without trusting what it names.

The directory's JSON names the Arrow files to map (``state.json``) and its splits
(``dataset_dict.json``); an Image column holds bytes or a path. Before ``datasets`` opens
anything, each named file is checked with :func:`surgery.files.paths.inside` (a URL never,
outside the directory not under ``safe=true``), and Image columns are decoded here rather than by
``datasets`` (which would fetch a URL and decode any size): path checked, header size capped,
a batch's decoded bytes checked against ``limits.memory_gb``. Columns of other decoded types
(Audio, Video, Pdf, ...) are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from surgery.core.limits import check_memory
from surgery.errors import ConfigError
from surgery.files.gate import read_bytes
from surgery.files.images import decode_image, open_image_bytes
from surgery.files.libraries import load_datasets_dir
from surgery.files.paths import inside, must_be_file, read_json_object


def check_directory(path: Path, split: bool = False) -> None:
    """Every split and Arrow file the directory's JSON names is a local regular file that may be read."""
    for info in ("dataset_dict.json", "dataset_info.json", "state.json"):  # the JSON itself first
        if (path / info).exists() or (path / info).is_symlink():
            must_be_file(inside(info, path, "input.path", f"the datasets directory {str(path)!r}"), "input.path")
    dict_file = path / "dataset_dict.json"
    if dict_file.exists() and not split:  # a split is one data set: its own dataset_dict.json is never read
        for name in read_json_object(dict_file, "input.path").get("splits", []):
            check_directory(inside(str(name), path, "input.path", f"{str(dict_file)!r}"), split=True)
        return
    state_file = path / "state.json"
    if state_file.exists():
        for entry in read_json_object(state_file, "input.path").get("_data_files", []):
            name = entry.get("filename", "") if isinstance(entry, dict) else entry
            must_be_file(inside(str(name), path, "input.path", f"{str(state_file)!r}"), "input.path")


class HFRows(Dataset):
    """Rows of a Hugging Face ``datasets`` directory written by ``save_to_disk`` (memory-mapped Arrow)."""

    def __init__(
        self,
        path: Path,
        x_key: str,
        y_key: str | None,
        split: str,
        process: Callable[[Any], torch.Tensor] | None = None,
    ) -> None:
        try:
            from datasets import DatasetDict, Image
        except ImportError:
            raise ConfigError("input.path: a datasets directory needs `pip install datasets`") from None
        from surgery.data.sources import check_keys

        check_directory(path)
        data = load_datasets_dir(path, "input.path")
        if isinstance(data, DatasetDict):
            if split not in data:
                raise ConfigError(f"input.split: {str(path)!r} has splits {', '.join(data)}, not {split!r}")
            data = data[split]
        check_keys(path, list(data.column_names), x_key, y_key)
        self.path, self.x_key, self.y_key = path, x_key, y_key
        self.process = process  # PIL image → [C, H, W] for an Image column x_key (a vision model's processor)
        self.keys = [x_key] + ([y_key] if y_key else [])
        self.images: dict[str, str | None] = {}  # Image columns (decoded here) → the mode they ask for
        for which, key in zip(("x_key", "y_key"), self.keys):
            feature = data.features[key]
            if isinstance(feature, Image):
                self.images[key] = feature.mode
                data = data.cast_column(key, Image(decode=False))
            elif _decoded(feature):
                raise ConfigError(
                    f"input.{which}: column {key!r} of {str(path)!r} holds {_decoded(feature)} values, which datasets"
                    " would decode (and may fetch); a data set input reads arrays, numbers and plain Image columns"
                )
        arrays = [k for k in self.keys if k not in self.images]
        self.row_bytes = data.select_columns(arrays).data.nbytes / max(len(data), 1) if arrays else 0.0  # mean
        self.data = data.with_format("torch", columns=arrays) if arrays else None
        self.raw = data.select_columns(list(self.images)) if self.images else None

    def __len__(self) -> int:
        return len(self.data if self.data is not None else self.raw)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        columns: dict[str, list[torch.Tensor]] = {}
        if self.data is not None:
            check_memory(2 * len(indices) * self.row_bytes, "input.batch_size", f"{len(indices)} rows of {self.path}")
            rows = self.data[indices]
            columns.update({k: list(torch.as_tensor(rows[k])) for k in rows})
        if self.raw is not None:
            raw = self.raw[indices]
            columns.update({k: self._images(k, raw[k], indices) for k in self.images})
        return list(zip(*(columns[k] for k in self.keys), strict=True))

    def _images(self, key: str, cells: list[Any], indices: list[int]) -> list[torch.Tensor]:
        """A batch of one Image column: every path checked and every header read before anything is decoded."""
        opened, total = [], 0
        for cell, i in zip(cells, indices, strict=True):
            where = f"row {i} of column {key!r} in {str(self.path)!r}"
            image, nbytes = open_image_bytes(self._bytes(cell, where), "input.path", where)
            mode = self.images[key]
            opened.append((image.convert(mode) if mode and image.mode != mode else image, where))  # type: ignore[attr-defined]
            total += nbytes * (len(mode) if mode else 1)
        check_memory(2 * total, "input.batch_size", f"{len(indices)} images decoded and stacked")
        if self.process is not None and key == self.x_key:
            tensors = [self.process(image) for image, _ in opened]
        else:
            tensors = [decode_image(image, "input.path", where) for image, where in opened]
        for tensor, (_, where) in zip(tensors, opened, strict=True):
            if tensor.shape != tensors[0].shape:
                raise ConfigError(
                    f"input.path: images of mixed sizes: {where} is {list(tensor.shape)}, the batch's first is"
                    f" {list(tensors[0].shape)}; resize them to one size"
                )
        return tensors

    def _bytes(self, cell: Any, where: str) -> bytes:
        """An Image cell's bytes: its own, or its file's (a checked path taken from the data directory)."""
        if not isinstance(cell, dict) or (cell.get("bytes") is None and not cell.get("path")):
            raise ConfigError(f"input.path: {where} holds no image")
        if cell.get("bytes") is not None:
            return bytes(cell["bytes"])
        file = inside(str(cell["path"]), self.path, "input.path", where)
        if not file.is_file():
            raise ConfigError(f"input.path: {where} names {cell['path']!r}, which is not a file")
        check_memory(file.stat().st_size, "input.path", f"the image file {str(file)!r}")
        return read_bytes(file, "input.path", cap=None)


def _decoded(feature: Any) -> str | None:
    """The name of a feature type ``datasets`` decodes (from bytes or a path), anywhere inside ``feature``."""
    if isinstance(feature, dict):
        return next((found for f in feature.values() if (found := _decoded(f))), None)
    if isinstance(feature, (list, tuple)):
        return next((found for f in feature if (found := _decoded(f))), None)
    if hasattr(feature, "decode"):
        return type(feature).__name__
    inner = getattr(feature, "feature", None)
    return _decoded(inner) if inner is not None else None
