"""Model inputs from the input config: seeded random tensors or a local file, plus a loss target."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from surgery.actions.base import generator_for
from surgery.core.limits import check_count, check_memory
from surgery.data.loader import DatasetInput
from surgery.errors import ConfigError
from surgery.files.gate import config_path
from surgery.files.tensors import read_input_file

# What each input key means, and which keys each input kind takes: validation and docs/config.md read both.
KEY_MEANINGS = {
    "kind": "random (default) | tokens | digit | file | dataset | text",
    "shape": "the input's shape [batch, ...]; one positional input",
    "shapes": "several positional inputs, one shape each (replaces shape)",
    "seed": "null: the run seed; another value gives another input for the same model",
    "batches": "how many batches to run (default 1), each drawn afresh from the seed",
    "target": "class index for loss=cross_entropy|kl_div when the input has no labels",
    "vocab": "token ids are drawn from [0, vocab)",
    "digit": "which digit to draw, 0..9 (default 3)",
    "path": "the file; relative paths are taken from the directory you started in",
    "key": ".safetensors / .pt dict: which tensor (default: the only one, or the first)",
    "prompt": "one prompt",
    "prompts": "several prompts (replaces prompt), padded on the left into one batch",
    "tokenizer": "null: the model's directory (model.path); or a tokenizer directory or tokenizer.json",
    "decoder_prompt": "encoder-decoder models (T5): the decoder's prompt after its start token (null: the start token)",
}
INPUT_KINDS: dict[str, tuple[str, ...]] = {
    "random": ("kind", "shape", "shapes", "seed", "batches", "target"),
    "tokens": ("kind", "shape", "shapes", "vocab", "seed", "batches", "target"),
    "digit": ("kind", "digit", "shape", "seed", "batches", "target"),
    "file": ("kind", "path", "key", "shape", "target"),
    "dataset": tuple(f.name for f in dataclasses.fields(DatasetInput)),  # meanings: DatasetInput's comments
    "text": ("kind", "prompt", "prompts", "tokenizer", "decoder_prompt", "shape", "shapes", "target"),
}
# The tensor kinds (all but dataset and text) share one check, so a key another of them takes is never refused.
INPUT_KEYS = tuple(dict.fromkeys(k for kind in ("random", "tokens", "digit", "file") for k in INPUT_KINDS[kind]))


def batch_count(spec: Mapping[str, Any]) -> int:
    """How many batches the run has (``input.batches``, default 1)."""
    batches = spec.get("batches")
    if batches is None:
        return 1
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:  # 0 is refused, never read as 1
        raise ConfigError(f"input.batches: must be a positive int (1 or more), got {batches!r}")
    if batches > 1 and (spec.get("kind") or "random") == "file":
        raise ConfigError(f"input.batches: a file input is one batch; {as_dataset(spec)}")
    check_count(batches, "input.batches", "batches")
    return batches


def as_dataset(spec: Mapping[str, Any]) -> str:
    """How to run a file's examples in batches instead: the same file read as a data set, ready to paste."""
    path = Path(str(spec.get("path")))
    suffix = path.suffix.lower()
    if suffix == ".png":
        return "for many images, give a folder of class sub-folders of .png files: +input=dataset input.path=DIR"
    extra = ""
    if suffix != ".npy":  # an .npy is one array; a .pt/.safetensors names its arrays: the one the file input reads
        key = spec.get("key") or _first_key(path)
        extra = f" input.x_key={key} input.y_key=null"
    return (
        f"to run its examples in batches (input.batch_size rows each), read it as a data set instead of"
        f" +input=file and drop input.batches: +input=dataset input.path={path}{extra}"
    )


def _first_key(path: Path) -> str:
    """The tensor a file input reads from ``path`` when no key is given (its first), or NAME if unreadable."""
    try:
        from surgery.files.tensors import read_tensors

        return next(iter(read_tensors(path, "input.path")))
    except (ConfigError, StopIteration):
        return "NAME"


def make_inputs(
    spec: Mapping[str, Any], seed: int, dtype: torch.dtype, device: torch.device, batch: int = 0
) -> tuple[torch.Tensor, ...]:
    """Positional model inputs described by ``spec`` (kind random, tokens, digit or file) for one batch."""
    key = "input.shapes" if spec.get("shapes") is not None else "input.shape"
    try:
        return _make_inputs(spec, seed, dtype, device, batch)
    except MemoryError:
        raise ConfigError(f"{key}: the input does not fit in memory here; check the sizes") from None
    except RuntimeError as e:  # without limits.memory_gb the allocator is what refuses: say so in one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "allocate" not in reason and "overflow" not in reason.lower():
            raise
        raise ConfigError(f"{key}: the input cannot be made here ({reason}); check the sizes") from None


def _make_inputs(
    spec: Mapping[str, Any], seed: int, dtype: torch.dtype, device: torch.device, batch: int = 0
) -> tuple[torch.Tensor, ...]:
    """:func:`make_inputs` without turning the allocator's refusal into a config error."""
    unknown = sorted(set(spec) - set(INPUT_KEYS))
    if unknown:
        raise ConfigError(f"input.{unknown[0]}: unknown key; input keys are {', '.join(INPUT_KEYS)}")
    kind = spec.get("kind") or "random"
    shapes = _shapes(spec)
    _check_input_memory(kind, shapes, dtype, "input.shapes" if spec.get("shapes") is not None else "input.shape")
    if spec.get("seed") is not None:  # a different input for the same model, e.g. for patching
        seed = int(spec["seed"])
    stream = "input" if batch == 0 else f"input/{batch}"  # batch 0 is what a one-batch run sees
    if kind == "random":
        if not shapes:
            raise ConfigError(
                "input.shape: no input shape; give input.shape=[...] or a model config with input defaults"
            )
        gen = generator_for(seed, stream, torch.device("cpu"))
        return tuple(torch.randn(s, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype) for s in shapes)
    if kind == "tokens":
        vocab = spec.get("vocab")
        if not shapes or not isinstance(vocab, int) or vocab < 1:
            raise ConfigError("input.vocab: token inputs need input.shape=[batch, length] and input.vocab=N (N >= 1)")
        gen = generator_for(seed, stream, torch.device("cpu"))
        return tuple(torch.randint(0, vocab, s, generator=gen).to(device) for s in shapes)
    if kind == "file":
        path = spec.get("path")
        if not path or path == "???":
            raise ConfigError("input.path: a file is required, e.g. +input=file input.path=digit.pt")
        tensor = read_input_file(config_path(str(path), "input.path"), spec.get("key"))
        if shapes:
            tensor = fit_shape(tensor, shapes[0], str(path))
        return (tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype),)
    if kind == "digit":
        from surgery.app.digit import render_digit

        digit = spec.get("digit", 3)
        if not isinstance(digit, int) or not 0 <= digit <= 9:
            raise ConfigError(f"input.digit: a digit 0-9, got {digit!r}")
        if not shapes or len(shapes[0]) != 4:
            raise ConfigError("input.shape: a digit is an image input [batch, channels, height, width]")
        n, c, h, w = shapes[0]
        side = max(h, w)
        top, left = (side - h) // 2, (side - w) // 2  # centre crop for a non-square input
        image = render_digit(digit, size=side, seed=seed + batch)[..., top : top + h, left : left + w]
        return (image.expand(n, c, h, w).contiguous().to(device=device, dtype=dtype),)
    raise ConfigError(f"input.kind: {kind!r} is not one of {', '.join(INPUT_KINDS)}")


def _check_input_memory(kind: str, shapes: list[list[int]], dtype: torch.dtype, key: str) -> None:
    """Refuse, before drawing, an input larger than ``limits.memory_gb``: what each kind holds while it is made."""
    if kind not in ("random", "tokens", "digit"):
        return  # a file's size is checked as it is read (surgery/files)
    elements = sum(math.prod(s) for s in shapes)
    made = {"random": 4 + dtype.itemsize, "tokens": 8, "digit": dtype.itemsize}[kind]  # random: float32, then dtype
    check_memory(elements * made, key, f"{elements:,} elements of {kind} input")


def _shapes(spec: Mapping[str, Any]) -> list[list[int]]:
    if spec.get("shapes") is not None:
        shapes = [list(s) for s in spec["shapes"]]
    elif spec.get("shape") is not None:
        shapes = [list(spec["shape"])]
    else:
        return []
    for s in shapes:
        if not all(isinstance(d, int) and d >= 0 for d in s):
            raise ConfigError(f"input.shape: sizes must be non-negative ints, got {s}")
        if any(d >= 2**63 for d in s):  # torch takes 64-bit sizes; more is a TypeError deep inside it
            raise ConfigError(f"input.shape: {s} has a size past 2**63-1, more than any tensor can have")
    return shapes


def fit_shape(tensor: torch.Tensor, shape: list[int], path: str) -> torch.Tensor:
    """Add the batch dim to a single example; refuse a tensor whose example shape differs."""
    example = list(shape[1:])
    if list(tensor.shape) == example:
        return tensor.unsqueeze(0)
    if tensor.dim() == len(example) - 1 and list(tensor.shape) == example[1:]:
        return tensor.unsqueeze(0).unsqueeze(0)  # e.g. an H×W image for a 1×H×W model
    if list(tensor.shape[1:]) != example:
        raise ConfigError(
            f"input.path: {path!r} holds a tensor of shape {list(tensor.shape)}; the model takes"
            f" [batch, {', '.join(map(str, example))}]"
        )
    return tensor


def loss_of(output: torch.Tensor, loss: str, target: Any) -> torch.Tensor:
    """The scalar the backward pass starts from (SPEC run setting ``loss``)."""
    import torch.nn.functional as F

    if loss == "sum":
        return output.sum()
    if loss == "mse":
        return F.mse_loss(output, torch.zeros_like(output))
    if target is None:
        raise ConfigError(f"loss: {loss!r} needs a class index; set input.target=N")
    if isinstance(target, torch.Tensor):  # a data set's labels, one per example
        labels = target.reshape(-1)
        output = output.reshape(labels.shape[0], -1)
        if loss == "cross_entropy":
            return F.cross_entropy(output, labels)
        return F.kl_div(torch.log_softmax(output, -1), F.one_hot(labels, output.shape[-1]).to(output.dtype),
                        reduction="batchmean")  # fmt: skip
    if output.dim() < 2 or not 0 <= int(target) < output.shape[-1]:
        raise ConfigError(f"input.target: class {target} does not fit an output of shape {list(output.shape)}")
    output = output.reshape(-1, output.shape[-1])  # [batch, length, vocab] logits: every position
    labels = torch.full((output.shape[0],), int(target), dtype=torch.long, device=output.device)
    if loss == "cross_entropy":
        return F.cross_entropy(output, labels)
    one_hot = F.one_hot(labels, output.shape[-1]).to(output.dtype)
    return F.kl_div(torch.log_softmax(output, -1), one_hot, reduction="batchmean")
