"""Model checkpoints: a state_dict file (or a ``save_pretrained`` directory) loaded strictly into a model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from surgery.errors import ConfigError
from surgery.files.gate import config_path
from surgery.files.tensors import read_tensors

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
SAVE_PRETRAINED_FILES = ("model.safetensors", "pytorch_model.bin")


def _weights_in(directory: Path) -> Path:
    """The weights file of a ``save_pretrained`` directory (one shard only)."""
    for name in SAVE_PRETRAINED_FILES:
        if (directory / name).is_file():
            return directory / name
    sharded = " (its weights are sharded)" if any(directory.glob("*.index.json")) else ""
    raise ConfigError(
        f"model.checkpoint: {str(directory)!r} is a directory without {' or '.join(SAVE_PRETRAINED_FILES)}{sharded};"
        " give a weights file, or load a save_pretrained directory whole with +model=hf model.path=DIR"
    )


def load_checkpoint(model: torch.nn.Module, path: str | Path, load: Callable[..., Any] | None = None) -> None:
    """Load a state_dict file strictly into ``model``; missing or unexpected keys are an error.

    ``path`` may be a ``save_pretrained`` directory (its model.safetensors is read). A key the file lacks
    is fine when its tensor is tied to one the file has (``save_pretrained`` omits GPT-2's ``lm_head.weight``).
    ``load`` replaces ``model.load_state_dict`` (a surgery's, so that its ``on_load`` hooks run and remove undoes it).
    """
    path = config_path(path, "model.checkpoint")
    if path.is_dir():
        path = _weights_in(path)
    if path.suffix.lower() not in CHECKPOINT_SUFFIXES:
        raise ConfigError(f"model.checkpoint: {str(path)!r} is not one of {', '.join(CHECKPOINT_SUFFIXES)}")
    state = read_tensors(path, "model.checkpoint")
    own = model.state_dict()
    misfits = [
        f"{key} is {list(state[key].shape)} in the file, {list(own[key].shape)} in the model"
        for key in own
        if key in state and tuple(own[key].shape) != tuple(state[key].shape)
    ]
    if misfits:
        more = f" (+{len(misfits) - 3} more)" if len(misfits) > 3 else ""
        raise ConfigError(f"model.checkpoint: {str(path)!r} does not fit the model: {'; '.join(misfits[:3])}{more}")
    result = (load or model.load_state_dict)(state, strict=False)
    tensors = model.state_dict(keep_vars=True)
    loaded = {(t.data_ptr(), t.shape) for key, t in tensors.items() if key in state}
    missing = [key for key in result.missing_keys if (tensors[key].data_ptr(), tensors[key].shape) not in loaded]
    problems = []
    if missing:  # a tied key (the same tensor as a loaded one) was loaded through its twin
        problems.append(f"missing keys: {', '.join(missing[:8])}")
    if result.unexpected_keys:
        problems.append(f"unexpected keys: {', '.join(result.unexpected_keys[:8])}")
    if problems:
        raise ConfigError(f"model.checkpoint: {str(path)!r} does not fit the model ({'; '.join(problems)})")
