"""``from: {file, key}`` on ``init`` and ``add_parameter``/``add_buffer``'s ``init``: a tensor read from a file.

The file (.safetensors, or a weights-only .pt/.pth) is read once at plan time into owned, aligned copies
(``surgery.files.tensors.read_tensors``); the key's shape and dtype are checked against the tensor it fills
before anything is touched. ``key`` may hold ``{name}`` (the module's name) and defaults to the filled
tensor's full name (``MODULE.NAME``), the keys ``Surgery.save_added`` and ``state_dict`` write.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from surgery.core.plan_cache import depends_on_more
from surgery.errors import ConfigError, did_you_mean
from surgery.files.gate import config_path
from surgery.files.tensors import read_tensors


class FileSource:
    """The tensors of one ``from: {file, key}``, read once; ``tensor(full_name, module_name)`` picks one."""

    def __init__(self, source: dict, where: str) -> None:
        depends_on_more(f"{where}.file")  # the file may change between plans
        self.where = where
        self.file = str(source["file"])
        self.key = source.get("key")
        self.tensors = read_tensors(config_path(self.file, f"{where}.file"), f"{where}.file")

    def tensor(self, full_name: str, module_name: str) -> torch.Tensor:
        """The tensor for the filled tensor ``full_name`` of module ``module_name``, or a ConfigError naming the key."""
        key = full_name if self.key is None else self.key.replace("{name}", module_name)
        found = self.tensors.get(key)
        if found is None:
            keys = sorted(self.tensors)
            shown = ", ".join(keys[:8]) + (f", … ({len(keys)} keys)" if len(keys) > 8 else "")
            default = " (the default key: the filled tensor's full name)" if self.key is None else ""
            raise ConfigError(
                f"{self.where}.key: {key!r}{default} is not in {self.file!r}.{did_you_mean(key, keys)} Its keys:"
                f" {shown or 'none'}"
            )
        return found

    def check(self, tensor: torch.Tensor, key_of: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Refuse a file tensor whose shape or dtype is not the one it fills (``key_of`` names the filled tensor)."""
        if tuple(tensor.shape) != tuple(shape):
            raise ConfigError(
                f"{self.where}: {key_of} in {self.file!r} has shape {list(tensor.shape)}, but the tensor it fills is"
                f" {list(shape)}"
            )
        if tensor.dtype != dtype:
            raise ConfigError(
                f"{self.where}: {key_of} in {self.file!r} is {str(tensor.dtype).removeprefix('torch.')}, but the tensor"
                f" it fills is {str(dtype).removeprefix('torch.')}; convert the file (no silent cast)"
            )


def copier(source: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A fill function writing ``source`` into a tensor in place (the model never shares the plan's copy)."""

    def fill(tensor: torch.Tensor) -> None:
        tensor.copy_(source)

    return fill
