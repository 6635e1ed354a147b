"""``ActivationDataset``: a harvested activation dataset as a ``torch.utils.data.Dataset``, memory-mapped.

The shard files are memory-mapped (their safetensors header read, the data viewed in place), so opening
a dataset of any size reads only ``manifest.json``, and an item reads just its own bytes. Shuffling is
the DataLoader's (``shuffle=True``); each worker maps the files itself.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from surgery.errors import ConfigError
from surgery.files import gate
from surgery.files.maps import map_safetensors

__all__ = ["ActivationDataset", "open"]

MANIFEST = "manifest.json"  # the names surgery/harvest/shards.py writes (tests/test_harvest.py checks they agree)
TOKENS = "token_ids"
KEY = "activations"  # what a refusal names: the dataset directory given to open()


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
        self.directory, self.by = gate.config_path(directory, KEY), by
        if not (self.directory / MANIFEST).is_file():
            raise ConfigError(
                f"{KEY}: {str(self.directory)!r} has no {MANIFEST}; give the activations/ folder of a harvest"
            )
        path = gate.member(self.directory, MANIFEST, KEY, "the manifest")
        self.manifest: dict[str, Any] = gate.read_json_object(path, KEY)
        if self.manifest.get("complete") is not True:
            raise ConfigError(
                f"{KEY}: {str(self.directory)!r} holds an unfinished harvest; rerun its command in the same run"
                " directory to finish it"
            )
        self.sites, self.context, shards = _checked(self.manifest, path)
        self._files = {
            (site, number): gate.member(self.directory, f"{site}/shard-{number:05d}.safetensors", KEY, "a shard")
            for site in (*self.sites, TOKENS)
            for number in range(len(shards))
        }
        self._shards = shards
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
            found = self._maps[(site, shard)] = self._mapped(site, shard)
        return found

    def _mapped(self, site: str, shard: int) -> dict[str, torch.Tensor]:
        """A shard's tensors, mapped, their shapes checked against the manifest (a damaged file is refused here)."""
        path = self._files[(site, shard)]
        tensors = map_safetensors(path, KEY)
        rows, kept = self._shards[shard]["rows"], self._shards[shard]["kept"]
        wanted = {"input_ids": [rows, self.context], "kept": [kept]} if site == TOKENS else {
            "activations": [rows, self.context, *self.manifest["sites"][site]["shape"]]
        }  # fmt: skip
        for name, shape in wanted.items():
            if name not in tensors or list(tensors[name].shape) != shape:
                found = list(tensors[name].shape) if name in tensors else "no such tensor"
                raise ConfigError(
                    f"{KEY}: {str(path)!r} holds {name!r} of shape {found}, but the manifest says {shape}; the"
                    " dataset is damaged or not a harvest's"
                )
        if site == TOKENS and kept:
            positions = tensors["kept"]
            if positions.is_floating_point() or int(positions.min()) < 0 or int(positions.max()) >= rows * self.context:
                raise ConfigError(
                    f"{KEY}: {str(path)!r} lists kept positions outside its {rows} x {self.context} tokens; the dataset"
                    " is damaged"
                )
        return tensors

    def __repr__(self) -> str:
        return f"ActivationDataset({str(self.directory)!r}, by={self.by!r}, items={len(self)}, sites={self.sites})"


def _checked(manifest: dict[str, Any], path: Path) -> tuple[list[str], int, list[dict[str, int]]]:
    """The manifest's sites, context and shards, every name and number checked before any is used."""
    sites, shards = manifest.get("sites"), manifest.get("shards")
    where = f"{KEY}: {str(path)!r}"
    if not isinstance(sites, dict) or not sites:
        raise ConfigError(f"{where} has sites {_short(sites)}; a harvest's manifest maps each module to its shape")
    for site, about in sites.items():
        if site == TOKENS:
            raise ConfigError(f"{where} names the site {site!r}, which is not a module name; refused")
        shape = about.get("shape") if isinstance(about, dict) else None
        if not isinstance(shape, list) or len(shape) > 6:
            raise ConfigError(f"{where} gives site {site!r} the shape {_short(shape)}; a list of sizes is read")
        for size in shape:
            gate.whole(size, f"{KEY}: {site!r} shape in {str(path)!r}", 1, 2**31)
    context = gate.whole(manifest.get("context"), f"{where} context", 1, 2**31)
    if not isinstance(shards, list):
        raise ConfigError(f"{where} has shards {_short(shards)}; a list of {{rows, kept}} is read")
    for number, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise ConfigError(f"{where} shard {number} is {_short(shard)}, not {{rows, kept}}")
        rows = gate.whole(shard.get("rows"), f"{where} shard {number} rows", 0, 2**40)
        gate.whole(shard.get("kept"), f"{where} shard {number} kept", 0, rows * context)
    return list(sites), context, shards


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
