"""The batches a run feeds the model: seeded tensors or a file, a data set, or text prompts.

``make_batches`` returns batch 0 at once (the plan's probe forward and the comparison use it) and
iterates every batch, batch 0 first, as positional inputs, keyword inputs and labels (None when the
input has none). A data set is read through its DataLoader in one pass, so memory stays flat
whatever its size; text prompts are one batch of ``input_ids`` and ``attention_mask``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from surgery.app.inputs import INPUT_KINDS, batch_count, make_inputs
from surgery.errors import ConfigError
from surgery.files.gate import config_path


class Batch(NamedTuple):
    """One batch: ``model(*args, **kwargs)``; ``labels`` for metrics and the loss, or None."""

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, torch.Tensor]
    labels: torch.Tensor | None


@dataclass
class Batches:
    """Batch 0, how many batches and examples there are, and the iterator over all of them."""

    first: Batch
    count: int
    labelled: bool
    examples: int
    source: str  # for the report: "random", "digits (test)", a path, "text"
    text: Any = None  # the TextBatch of a text input (prompts, lengths), else None
    tokenizer: Any = None  # the tokenizer of a text input, else None
    _iterator: Iterator[Batch] = field(repr=False, default_factory=lambda: iter(()))

    def __iter__(self) -> Iterator[Batch]:
        return self._iterator

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Batch 0's input tensors, positional then keyword: fingerprinted and described in the report."""
        return (*self.first.args, *self.first.kwargs.values())


EXCLUSIVE = (("prompt", "prompts"), ("prompts", "prompt"), ("shape", "shapes"), ("shapes", "shape"))


def input_spec(
    model_input: Mapping[str, Any], given: Mapping[str, Any], model: nn.Module | None = None
) -> dict[str, Any]:
    """The model config's input defaults overridden by the run's ``input``.

    When the run picks another kind (``+input=random`` on a model whose default is a data set), only
    the defaults every kind shares (``shape``, ``shapes``, ``target``) are kept. A vision ``model`` whose
    config defaults to text (``+model=hf``) defaults to an image-shaped input instead (surgery.vision).
    """
    given = {k: v for k, v in given.items() if v != "???"}  # a required key left unset: as if not given
    if model is not None and model_input.get("kind") == "text" and not given.get("kind"):
        from surgery.vision.images import image_input, is_vision_model

        if is_vision_model(model):
            model_input = image_input(model)
    model_kind = model_input.get("kind") or "random"
    kind = given.get("kind") or model_kind
    if kind == model_kind:
        defaults = dict(model_input)
        for one, other in EXCLUSIVE:  # the run's prompts replace the model's default prompt, shapes its shape
            if given.get(one) is not None:
                defaults.pop(other, None)
        return {**defaults, **given}
    shared = {k: v for k, v in model_input.items() if k in ("shape", "shapes", "target")}
    return {**shared, **given}


def make_batches(
    spec: Mapping[str, Any], seed: int, dtype: torch.dtype, device: torch.device, model: nn.Module | None = None,
    model_path: Any = None, where: str = "input",
) -> Batches:  # fmt: skip
    """The run's batches from its input spec (kinds random, tokens, digit, file, dataset, text)."""
    kind = spec.get("kind") or "random"
    if kind == "dataset":
        return _dataset_batches(spec, dtype, device, model_path)
    if kind == "text":
        return _text_batches(spec, device, model, model_path, where)
    if kind == "file" and str(spec.get("path")).lower().endswith(".png"):
        from surgery.vision.images import image_processor

        processor = image_processor(model_path)
        if processor is not None:  # a vision model's own preprocessing, not raw [0, 1] pixels
            return _processed_file(spec, processor, dtype, device)
    count = batch_count(spec)
    first = Batch(make_inputs(spec, seed, dtype, device), {}, None)

    def every() -> Iterator[Batch]:
        yield first
        for batch in range(1, count):
            yield Batch(make_inputs(spec, seed, dtype, device, batch), {}, None)

    examples = count * (int(first.args[0].shape[0]) if first.args and first.args[0].dim() else 1)
    return Batches(first, count, False, examples, str(kind), _iterator=every())


def _processed_file(spec: Mapping[str, Any], processor: Any, dtype: torch.dtype, device: torch.device) -> Batches:
    """A PNG through the model directory's image processor: one batch of ``pixel_values``."""

    from surgery.app.inputs import INPUT_KEYS, fit_shape
    from surgery.files.paths import must_be_file
    from surgery.vision.images import processed_image

    unknown = sorted(set(spec) - set(INPUT_KEYS))
    if unknown:
        raise ConfigError(f"input.{unknown[0]}: unknown key; input keys are {', '.join(INPUT_KEYS)}")
    batch_count(spec)  # more than one batch of a file is refused, with the data-set way to say it
    path = config_path(str(spec["path"]), "input.path")
    must_be_file(path, "input.path")
    pixels = processed_image(processor, path)
    shapes = spec.get("shapes") or ([spec["shape"]] if spec.get("shape") is not None else [])
    if shapes:
        pixels = fit_shape(pixels, list(shapes[0]), str(path))
    first = Batch((pixels.to(device=device, dtype=dtype),), {}, None)
    return Batches(
        first, 1, False, int(pixels.shape[0]), f"{path} ({type(processor).__name__})", _iterator=iter([first])
    )


def _dataset_batches(spec: Mapping[str, Any], dtype: torch.dtype, device: torch.device, model_path: Any) -> Batches:
    from surgery.data.loader import data_loader, dataset_input
    from surgery.vision.images import image_processor, process_image

    if spec.get("batches") is not None:
        raise ConfigError("input.batches: a data set's size sets the number of batches; use input.limit=N instead")
    config = dataset_input({k: v for k, v in spec.items() if k != "batches"})
    processor = image_processor(model_path) if config.path is not None else None
    process = None if processor is None else (lambda image: process_image(processor, image)[0])  # [C, H, W] each
    loader = data_loader(config, process)
    rows = iter(loader)

    def batch_of(row: Any) -> Batch:
        x, y = (row[0], row[1]) if len(row) == 2 and config.y_key is not None else (row[0], None)
        args = (x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype),)
        return Batch(args, {}, None if y is None else y.to(device))

    first = batch_of(next(rows))

    def every() -> Iterator[Batch]:
        yield first
        for row in rows:
            yield batch_of(row)

    examples = len(loader.dataset)  # type: ignore[arg-type]
    where = f"{config.source} ({config.split})" if config.source else str(config.path)
    return Batches(first, len(loader), first.labels is not None, examples, where, _iterator=every())


TEXT_KEYS = INPUT_KINDS["text"]


def _text_batches(
    spec: Mapping[str, Any], device: torch.device, model: nn.Module | None, model_path: Any, where: str
) -> Batches:
    """Prompts as one batch of keyword inputs; labels are the token ids (-100 at padding) for LM metrics."""
    from surgery.lm.seq2seq import is_encoder_decoder, with_decoder_prompt
    from surgery.lm.text import check_vocabulary, encode_prompts, load_tokenizer

    unknown = sorted(set(spec) - set(TEXT_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key for kind text; keys: {', '.join(TEXT_KEYS)}")
    if model_path is None:  # a model loaded by a function (+model=induction_lm): the directory it was read from
        model_path = getattr(model, "name_or_path", None) or None
    tokenizer = load_tokenizer(spec.get("tokenizer"), model_path=model_path, where=f"{where}.tokenizer")
    text = encode_prompts(tokenizer, spec.get("prompt"), spec.get("prompts"), where=where)
    if model is not None:
        check_vocabulary(tokenizer, model, text)
    decoder_prompt = spec.get("decoder_prompt")
    if decoder_prompt is not None or (model is not None and is_encoder_decoder(model)):  # T5: the decoder's start
        text = with_decoder_prompt(text, model, tokenizer, decoder_prompt, f"{where}.decoder_prompt")  # type: ignore[arg-type]
    text = text.to(device)
    first = Batch((), text.kwargs(), text.labels)
    return Batches(first, 1, False, len(text.prompts), "text", text, tokenizer, iter([first]))
