"""The files of an activation dataset: shards per module, the token ids of every row, and ``manifest.json``.

Layout under ``DIR`` (the run directory's ``activations/``)::

    manifest.json                          tokens, rows, context, sites, shapes, dtype, fingerprints
    MODULE/shard-NNNNN.safetensors         "activations" [rows, context, *shape]
    token_ids/shard-NNNNN.safetensors      "input_ids" int32 [rows, context], "kept" int32 [kept tokens]

Shard ``k`` holds rows ``k * rows_per_shard`` onward, the same rows for every module. ``kept`` lists the
positions (``row * context + position``) whose token is not excluded (``harvest.exclude``). Each file is
written atomically and the token-id file last, so a shard is finished exactly when its token-id file exists.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from surgery.errors import ConfigError
from surgery.files import gate
from surgery.files.maps import map_safetensors

MANIFEST = "manifest.json"
TOKENS = "token_ids"  # the folder of the rows' token ids (no module may be named so)
FORMAT = "surgery.activations/1"


def shard_name(number: int) -> str:
    """``shard-NNNNN.safetensors``."""
    return f"shard-{number:05d}.safetensors"


def shard_path(directory: Path, site: str, number: int) -> Path:
    """Where module ``site``'s shard ``number`` lives (``site=TOKENS``: the rows' token ids)."""
    return directory / site / shard_name(number)


def finished(directory: Path, sites: Iterable[str], number: int) -> bool:
    """Whether shard ``number`` is written for every site (its token-id file, written last, exists)."""
    return shard_path(directory, TOKENS, number).is_file() and all(
        shard_path(directory, s, number).is_file() for s in sites
    )


def kept_positions(ids: torch.Tensor, excluded: list[int]) -> torch.Tensor:
    """Flat positions ``row * context + pos`` (int32) whose token is not one of ``excluded``."""
    if not excluded:
        return torch.arange(ids.numel(), dtype=torch.int32)
    keep = ~torch.isin(ids, torch.tensor(excluded, dtype=ids.dtype))
    return keep.reshape(-1).nonzero().reshape(-1).to(torch.int32)


def token_file(ids: torch.Tensor, excluded: list[int]) -> dict[str, torch.Tensor]:
    """The tensors of a token-id shard."""
    return {"input_ids": ids.to(torch.int32).contiguous(), "kept": kept_positions(ids, excluded)}


def stored_ids(directory: Path, number: int) -> torch.Tensor:
    """The token ids (int64) a finished shard was harvested from."""
    path = gate.member(directory, f"{TOKENS}/{shard_name(number)}", "hydra.run.dir", "a shard")
    tensors = map_safetensors(path, "hydra.run.dir")
    if "input_ids" not in tensors:
        raise ConfigError(f"hydra.run.dir: {str(path)!r} holds no input_ids; choose another hydra.run.dir")
    return tensors["input_ids"].to(torch.int64)


def state_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the model's state (names, dtypes, shapes, bytes): which weights were harvested."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def json_fingerprint(value: Any) -> str:
    """sha256 of a JSON value (keys sorted)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest in ``directory``, or None when there is none."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    data = gate.read_json_object(gate.member(directory, MANIFEST, "hydra.run.dir", "the manifest"), "hydra.run.dir")
    if data.get("format") != FORMAT:
        raise ConfigError(f"hydra.run.dir: {str(path)!r} is not an activation dataset's manifest")
    return data


def check_resumable(directory: Path, prints: dict[str, str]) -> dict[str, Any] | None:
    """The manifest of an earlier harvest into ``directory`` when it is this one; refused when it is another."""
    found = read_manifest(directory)
    if found is None:
        return None
    for what, value in prints.items():
        prints_found = found.get("fingerprints")
        if not isinstance(prints_found, dict) or prints_found.get(what) != value:
            raise ConfigError(
                f"hydra.run.dir: {directory} holds a harvest of another {what}; rerun the same command there to"
                " resume it, or choose another hydra.run.dir"
            )
    return found
