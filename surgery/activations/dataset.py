"""``ActivationDataset``: a harvested activation dataset as a ``torch.utils.data.Dataset``, memory-mapped.

The shard files are memory-mapped (their safetensors header read, the data viewed in place), so opening
a dataset of any size reads only ``manifest.json``, and an item reads just its own bytes. Shuffling is
the DataLoader's (``shuffle=True``); each worker maps the files itself.
"""

from __future__ import annotations

import bisect
import json
import mmap
import struct
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from surgery.errors import ConfigError

__all__ = ["ActivationDataset", "open"]

MANIFEST = "manifest.json"  # the names surgery/harvest/shards.py writes (tests/test_harvest.py checks they agree)
TOKENS = "token_ids"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32}  # fmt: skip
HEADER_MAX = 100 * 2**20  # a safetensors header larger than this is not one of ours


def open(directory: str | Path, by: str = "token") -> ActivationDataset:  # noqa: A001 - the name the SPEC gives
    """The activation dataset in ``directory``: by ``"token"`` (each kept token) or by ``"row"`` (each packed row)."""
    return ActivationDataset(directory, by)


class ActivationDataset(Dataset):
    """Items of a harvested activation dataset; ``sites`` are the module names, ``manifest`` the manifest's dict.

    ``by="token"``: one item per kept token (``harvest.exclude`` left out), ``{MODULE: [*shape], "token": id}``.
    ``by="row"``: one item per row, ``{"input_ids": [context], MODULE: [context, *shape]}`` (every position).
    """

    def __init__(self, directory: str | Path, by: str = "token") -> None:
        if by not in ("token", "row"):
            raise ConfigError(f"by: {by!r} is not one of token, row")
        self.directory, self.by = Path(directory), by
        path = self.directory / MANIFEST
        if not path.is_file():
            raise ConfigError(f"{str(self.directory)!r} has no {MANIFEST}; give the activations/ folder of a harvest")
        self.manifest: dict[str, Any] = json.loads(path.read_text())
        if not self.manifest.get("complete"):
            raise ConfigError(
                f"{str(self.directory)!r} holds an unfinished harvest; rerun its command in the same run directory"
                " to finish it"
            )
        self.sites: list[str] = list(self.manifest["sites"])
        self.context: int = int(self.manifest["context"])
        shards = self.manifest["shards"]
        counts = [s["kept"] for s in shards] if by == "token" else [s["rows"] for s in shards]
        self._starts = [0]
        for count in counts:
            self._starts.append(self._starts[-1] + count)
        self._maps: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int | list[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """One item; or, given a list (or 1-d tensor) of indices, those items batched: each value stacked on dim 0.

        The batched form is the fast path: ``DataLoader(data, batch_size=None,
        sampler=BatchSampler(RandomSampler(data), 256, drop_last=False))`` hands it whole batches.
        """
        if isinstance(index, (list, tuple, torch.Tensor)):
            return self.batch(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        index %= len(self)
        shard = bisect.bisect_right(self._starts, index) - 1
        offset = index - self._starts[shard]
        tokens = self._tensors(TOKENS, shard)
        if self.by == "row":
            item = {"input_ids": tokens["input_ids"][offset].to(torch.int64)}
            for site in self.sites:
                item[site] = self._tensors(site, shard)["activations"][offset].clone()
            return item
        row, position = divmod(int(tokens["kept"][offset]), self.context)
        item = {site: self._tensors(site, shard)["activations"][row, position].clone() for site in self.sites}
        item["token"] = tokens["input_ids"][row, position].to(torch.int64)
        return item

    def batch(self, indices: list[int] | tuple[int, ...] | torch.Tensor) -> dict[str, torch.Tensor]:
        """Items ``indices`` as one batch (each value stacked on dim 0), one gather per shard and site."""
        wanted = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if len(wanted) and not bool(((wanted >= -len(self)) & (wanted < len(self))).all()):
            raise IndexError(f"an index is out of range for {len(self)} items")
        wanted = wanted % max(len(self), 1)
        shards = torch.bucketize(wanted, torch.as_tensor(self._starts, dtype=torch.int64), right=True) - 1
        names = ["input_ids", *self.sites] if self.by == "row" else [*self.sites, "token"]
        values: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        order: list[torch.Tensor] = []
        for shard in shards.unique().tolist():
            chosen = (shards == shard).nonzero().reshape(-1)
            tokens = self._tensors(TOKENS, shard)
            offsets = wanted[chosen] - self._starts[shard]
            if self.by == "row":
                values["input_ids"].append(tokens["input_ids"][offsets].to(torch.int64))
                for site in self.sites:
                    values[site].append(self._tensors(site, shard)["activations"][offsets])
            else:
                flat = tokens["kept"][offsets].to(torch.int64)
                rows, positions = flat // self.context, flat % self.context
                for site in self.sites:
                    values[site].append(self._tensors(site, shard)["activations"][rows, positions])
                values["token"].append(tokens["input_ids"][rows, positions].to(torch.int64))
            order.append(chosen)
        if not order:
            return {name: torch.empty(0) for name in names}
        if len(order) == 1:  # every index in one shard: already in the order asked
            return {name: parts[0] for name, parts in values.items()}
        back = torch.empty(len(wanted), dtype=torch.int64)
        back[torch.cat(order)] = torch.arange(len(wanted))
        return {name: torch.cat(parts)[back] for name, parts in values.items()}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """Many items at once (what a DataLoader with ``batch_size`` asks for), gathered as one :meth:`batch`."""
        if len(indices) < 2 or self.by == "row":  # a row is large: a view of it copied once beats a gather
            return [self[i] for i in indices]
        joined = self.batch(indices)
        columns = [value.unbind(0) for value in joined.values()]
        return [dict(zip(joined, item, strict=True)) for item in zip(*columns, strict=True)]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"] = {}  # a DataLoader worker maps the files itself
        return state

    def _tensors(self, site: str, shard: int) -> dict[str, torch.Tensor]:
        found = self._maps.get((site, shard))
        if found is None:
            found = self._maps[(site, shard)] = mapped(self.directory / site / f"shard-{shard:05d}.safetensors")
        return found

    def __repr__(self) -> str:
        return f"ActivationDataset({str(self.directory)!r}, by={self.by!r}, items={len(self)}, sites={self.sites})"


def mapped(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views into a private memory map of it (nothing read until used)."""
    with path.open("rb") as file:
        size = path.stat().st_size
        (length,) = struct.unpack("<Q", file.read(8))
        if not 0 < length <= min(HEADER_MAX, size - 8):
            raise ConfigError(f"{str(path)!r} is not a safetensors file")
        header = json.loads(file.read(length))
        memory = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + length
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = (end - begin) // dtype.itemsize
        if count == 0:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(memory, dtype=dtype, count=count, offset=start + begin)
        tensors[name] = flat.view(entry["shape"])
    return tensors
