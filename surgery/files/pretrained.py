"""Hugging Face ``save_pretrained`` directories, checked before transformers reads them (SPEC §19).

transformers opens a directory's files itself: ``config.json``, the weights, the tokenizer and image
processor files. Before it does, :func:`checked_directory` reads ``config.json`` through the gate (a
regular file, capped, strict JSON), refuses under ``safe=true`` a file of the directory that is a link
leading out of it, and sizes the model its numbers describe against ``limits.memory_gb`` from
arithmetic alone, so a config declaring a billion layers is refused in milliseconds, before anything is
built. :func:`from_pretrained` then calls the library with its load report silenced (a refusal is one
line, never a 36-line table).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from surgery.core.limits import active, check_memory
from surgery.errors import ConfigError
from surgery.files.gate import listing, read_json_object

CONFIG = "config.json"
MAX_ENTRIES = 10_000  # files in a model directory (a sharded 70B model has a few hundred)
# Where each number lives in the configs of the families surgery knows (text_config: multimodal models).
WIDTH = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")
DEPTH = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")
FFN = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim")
VOCAB = ("vocab_size",)
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
NUMBER_MAX = 2**40  # no dimension or count of a real model comes near this


def checked_directory(directory: Path, key: str) -> dict[str, Any]:
    """``directory``'s ``config.json`` (read through the gate), once its files and its model's size pass."""
    names = listing(directory, key)
    if len(names) > MAX_ENTRIES:
        raise ConfigError(f"{key}: {str(directory)!r} holds {len(names)} entries, more than a model directory's")
    if active().paths_inside:
        top = os.path.realpath(directory)
        for name in names:
            real = os.path.realpath(Path(directory, name))
            if os.path.islink(Path(directory, name)) and not real.startswith(top + os.sep):
                raise ConfigError(
                    f"{key}: {str(Path(directory, name))!r} is a link leading outside {str(directory)!r}, refused"
                    " because safe=true (copy the files in, e.g. cp -rL, or drop safe=true if you trust it)"
                )
    config = read_json_object(Path(directory, CONFIG), key)
    check_memory(model_bytes(config, key), key, f"the model {CONFIG} describes")
    return config


def model_bytes(config: Mapping[str, Any], key: str) -> int:
    """About how many bytes the weights of the model ``config`` describes take, from its numbers alone."""
    text = config.get("text_config")
    numbers = {**config, **text} if isinstance(text, Mapping) else dict(config)
    width = _number(numbers, WIDTH, key, 0)
    depth = _number(numbers, DEPTH, key, 0)
    ffn = _number(numbers, FFN, key, 4 * width)
    vocab = _number(numbers, VOCAB, key, 0)
    dtype = numbers.get("torch_dtype") or numbers.get("dtype")
    per = DTYPE_BYTES.get(dtype, 4) if isinstance(dtype, str) else 4
    return (vocab * width + depth * (4 * width * width + 3 * width * ffn)) * per


def _number(config: Mapping[str, Any], names: tuple[str, ...], key: str, default: int) -> int:
    """The first of ``names`` present in ``config``: a whole number in range (a hostile config's value checked)."""
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= NUMBER_MAX:
            raise ConfigError(f"{key}: {CONFIG} has {name}={str(value)[:40]!r}; a whole number up to 2**40 is needed")
        return value
    return default


@contextlib.contextmanager
def quiet_library() -> Iterator[None]:
    """transformers' own logging and prints held back while it loads (its reports become our one line)."""
    import transformers

    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        transformers.utils.logging.set_verbosity(verbosity)


def from_pretrained(loader: Any, directory: Path, **options: Any) -> Any:
    """``loader.from_pretrained(directory, local_files_only=True, **options)`` on a directory already checked.

    Never with code from the directory (``trust_remote_code=False``: an ``auto_map`` naming a ``.py`` file is
    refused by the library) and never a pickle beyond ``torch.load(weights_only=True)`` (transformers' default,
    pinned here).
    """
    with quiet_library():
        return loader.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False, **options)
