"""``input.kind: dataset``: its keys, checked, and the DataLoader that streams it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from surgery.data.sources import SPLITS, digits, limited, local
from surgery.errors import ConfigError
from surgery.files.gate import config_path

SOURCES = ("digits",)


@dataclass
class DatasetInput:
    """The keys of ``input.kind: dataset`` (SPEC §7)."""

    kind: str = "dataset"
    source: str | None = None  # digits: scikit-learn's bundled 8x8 digits, resized to the model's input size
    path: str | None = None  # or a local data set: image folder, .npz/.pt/.safetensors file, datasets directory
    x_key: str = "x"  # the inputs' array or column in a file or datasets directory
    y_key: str | None = "y"  # the labels' array or column; null for unlabelled data
    split: str = "test"  # train | test | all: digits' fixed split, or a split of a datasets directory
    batch_size: int = 64  # examples per batch
    limit: int | None = None  # at most this many examples (the first ones)
    shape: Sequence[int] | None = None  # the model's input shape [batch, ...] (from the model config)
    target: Any = None  # ignored: labels come from the data set
    batches: Any = None  # ignored: a data set's size decides the number of batches

    def __post_init__(self) -> None:
        if (self.source is None) == (self.path is None):
            raise ConfigError(
                "input.source: give exactly one of input.source=digits or input.path=DIR_OR_FILE"
                f" (got source={self.source!r}, path={self.path!r})"
            )
        if self.source is not None and self.source not in SOURCES:
            known = ", ".join(SOURCES)
            raise ConfigError(f"input.source: {self.source!r} is not a built-in data set; built-in: {known}")
        if self.split not in SPLITS:
            raise ConfigError(f"input.split: {self.split!r} is not one of {', '.join(SPLITS)}")
        for key in ("batch_size", "limit"):
            value = getattr(self, key)
            if value is None and key == "limit":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"input.{key}: a positive int (1 or more), got {value!r}")


def dataset_input(spec: Mapping[str, Any]) -> DatasetInput:
    """The checked dataset keys of an input config; an unknown key names the keys there are."""
    keys = [f.name for f in dataclasses.fields(DatasetInput)]
    for key in spec:
        if key not in keys:
            raise ConfigError(f"input.{key}: unknown key for kind dataset; keys: {', '.join(keys)}", options=keys)
    return DatasetInput(**dict(spec))


def open_dataset(config: DatasetInput, process: Callable[[Any], torch.Tensor] | None = None) -> Dataset:
    """The data set ``config`` names, limited to ``limit`` examples; ``process``: a PIL image → ``[C, H, W]``."""
    if config.source == "digits":
        if not config.shape:
            raise ConfigError("input.shape: digits are resized to the model's input; give input.shape=[B, C, H, W]")
        data: Dataset = digits(config.split, list(config.shape)[1:])
    else:
        data = local(config_path(str(config.path), "input.path"), config.x_key, config.y_key, config.split, process)
    if len(data) == 0:  # type: ignore[arg-type]
        raise ConfigError(f"input.path: {config.path!r} holds no examples")
    return limited(data, config.limit)


def data_loader(config: DatasetInput, process: Callable[[Any], torch.Tensor] | None = None) -> DataLoader:
    """A DataLoader over the data set in order (no shuffling: runs are reproducible), in the main process."""
    dataset = open_dataset(config, process)
    sampler: DistributedSampler | None = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():  # torchrun: this rank's share
        sampler = DistributedSampler(dataset, shuffle=False)  # pads with repeats so every rank has as many
    return DataLoader(dataset, batch_size=config.batch_size, shuffle=False, sampler=sampler, num_workers=0)
