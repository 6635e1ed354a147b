"""Files in and out: checkpoints and input tensors in (never unpickling), atomic writes out."""

from __future__ import annotations

import json
import os
import re
import struct
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from surgery.core.tensors import owned
from surgery.errors import ConfigError

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
INPUT_SUFFIXES = (".pt", ".pth", ".npy", ".safetensors", ".png")


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write via a temp file in the same directory and rename, so no half file is ever left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp (and safetensors) make 0600; give open()'s usual mode, as Hydra's
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask (reading it means setting it; set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: Path, data: Any) -> None:
    """Atomically write pretty JSON."""
    text = json.dumps(data, indent=2, default=str) + "\n"
    write_atomic(path, lambda p: p.write_text(text))


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Atomically write tensors as safetensors (contiguous CPU copies)."""
    from safetensors.torch import save_file

    flat: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for key, value in tensors.items():
        tensor = value.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in storages:  # safetensors refuses shared memory (block i's output is block i+1's input)
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        flat[key] = tensor
    write_atomic(path, lambda p: save_file(flat, str(p)))


def read_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """Read a dict of tensors from .safetensors or a weights-only .pt/.pth; never unpickles objects."""
    _must_be_file(path, what)
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:  # one tensor at a time: peak is one extra copy
                return {key: owned(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118 - not a dict
        with warnings.catch_warnings():  # torch warns about pickle protocols it then refuses anyway
            warnings.simplefilter("ignore")
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - every read failure becomes one clear message
        first = _read_failure(e)
        raise ConfigError(
            f"{what}: cannot read {str(path)!r} as {suffix or 'a checkpoint'} ({first}). Only tensors are"
            " accepted: .safetensors, or .pt/.pth saved from a state_dict (loaded with weights_only=True)"
        ) from None
    if isinstance(loaded, torch.Tensor):
        return {"tensor": owned(loaded)}
    if isinstance(loaded, dict) and "state_dict" in loaded and isinstance(loaded["state_dict"], dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ConfigError(f"{what}: {str(path)!r} holds a {type(loaded).__name__}, not a tensor or a dict of tensors")
    return {key: owned(value) for key, value in loaded.items()}


def _must_be_file(path: Path, what: str) -> None:
    if path.is_dir():
        raise ConfigError(f"{what}: {str(path)!r} is a directory, not a file")
    if not path.is_file():
        raise ConfigError(f"{what}: file {str(path)!r} does not exist")


def _read_failure(error: Exception) -> str:
    """Why a file could not be read, in one plain line (torch's weights-only reason, no terminal colours)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    marker = "WeightsUnpickler error:"
    if marker in text:  # torch's reason follows this marker, on the same line or the next
        rest = [line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()]
        return f"{marker} {rest[0]}" if rest else marker
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


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


def load_checkpoint(model: torch.nn.Module, path: str | Path) -> None:
    """Load a state_dict file strictly into ``model``; missing or unexpected keys are an error.

    ``path`` may be a ``save_pretrained`` directory (its model.safetensors is read). A key the file lacks
    is fine when its tensor is tied to one the file has (``save_pretrained`` omits GPT-2's ``lm_head.weight``).
    """
    path = Path(path)
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
    result = model.load_state_dict(state, strict=False)
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


def read_input_file(path: Path, key: str | None) -> torch.Tensor:
    """One tensor from .pt/.pth (weights only), .npy, .safetensors or .png (H×W or C×H×W floats), owned and aligned."""
    suffix = path.suffix.lower()
    if suffix not in INPUT_SUFFIXES:
        raise ConfigError(f"input.path: {str(path)!r} is not one of {', '.join(INPUT_SUFFIXES)}")
    _must_be_file(path, "input.path")
    if suffix == ".npy":
        import numpy as np

        try:
            return owned(torch.from_numpy(np.load(path, allow_pickle=False)))  # numpy aligns to 16 bytes only
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"input.path: cannot read {str(path)!r} as .npy ({e})") from None
    if suffix == ".png":
        return read_png(path, "input.path")
    tensors = read_tensors(path, "input.path")
    if key is not None:
        if key not in tensors:
            raise ConfigError(f"input.key: {key!r} is not in {str(path)!r}; keys: {', '.join(tensors)}")
        return tensors[key]
    return next(iter(tensors.values()))


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PNG_SIDE = 16384  # pixels; an input image past either cap is refused before decoding (docs/errors.md)
MAX_PNG_PIXELS = 4096 * 4096


def png_size(path: Path, what: str) -> tuple[int, int]:
    """(width, height) as the PNG header (IHDR) declares them, refused past the caps before any decoding.

    A small file can declare a huge image (a decompression bomb): 389 KB for 20000×20000 took 28 s
    and 3.3 GB to decode. Every PNG reader calls this first.
    """
    with path.open("rb") as f:
        head = f.read(24)  # signature (8), IHDR length (4), b"IHDR" (4), width (4), height (4)
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise ConfigError(f"{what}: cannot read {str(path)!r} as .png (no PNG signature and IHDR header)")
    width, height = struct.unpack(">II", head[16:24])
    if not (0 < width <= MAX_PNG_SIDE and 0 < height <= MAX_PNG_SIDE and width * height <= MAX_PNG_PIXELS):
        raise ConfigError(
            f"{what}: {str(path)!r} declares a {width}×{height} image; a PNG input may have at most"
            f" {MAX_PNG_SIDE} pixels a side and {MAX_PNG_PIXELS} pixels (4096×4096) in all. Resize it first"
        )
    return width, height


def read_png(path: Path, what: str) -> torch.Tensor:
    """A PNG as floats in [0, 1], H×W (grey) or C×H×W, after checking its declared size."""
    import matplotlib.image

    png_size(path, what)
    try:
        image = torch.from_numpy(matplotlib.image.imread(str(path)).copy()).float()
    except Exception as e:  # noqa: BLE001 - PIL raises SyntaxError, OSError, ...
        raise ConfigError(f"{what}: cannot read {str(path)!r} as .png ({_read_failure(e)})") from None
    return owned(image if image.dim() == 2 else image.permute(2, 0, 1))
