"""Encoder-decoder language models (T5, BART): the decoder's prompt, which a forward pass and ``generate`` need.

The prompt goes to the encoder; the decoder starts from its own prompt: the model's decoder start
token, followed by the tokens of ``input.decoder_prompt`` when one is given (encoded without special
tokens, so no end-of-text closes it). Every prompt of a batch shares the decoder prompt, so the
decoder's ids need no padding. ``generate`` continues the decoder prompt, and its new tokens are the
ones after it (the encoder's prompt is never part of a decoder's output).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from surgery.errors import ConfigError
from surgery.lm.text import TextBatch


def is_encoder_decoder(model: nn.Module) -> bool:
    """True for a model whose config says it has an encoder and a decoder (T5, BART, ...)."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def decoder_start(model: nn.Module, where: str = "input.decoder_prompt") -> int:
    """The token the decoder starts from: the generation config's, else the model config's."""
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(config, "decoder_start_token_id", None)
        if isinstance(value, int):
            return value
    raise ConfigError(
        f"{where}: {type(model).__name__} names no decoder_start_token_id in its config; set it in config.json"
        " (T5 starts from its pad token, 0)"
    )


def with_decoder_prompt(
    batch: TextBatch, model: nn.Module, tokenizer: Any = None, decoder_prompt: str | None = None,
    where: str = "input.decoder_prompt",
) -> TextBatch:  # fmt: skip
    """``batch`` with the decoder's ids ``[prompts, 1 + tokens]``: the start token, then ``decoder_prompt``'s tokens.

    >>> batch = with_decoder_prompt(encode_prompts(tok, prompt="translate: the cat"), t5, tok, "die")
    >>> t5(**batch.kwargs())
    """
    if not is_encoder_decoder(model):
        raise ConfigError(
            f"{where}: only encoder-decoder models (T5, BART) take a decoder prompt; {type(model).__name__} is"
            " decoder-only: put all the text in input.prompt"
        )
    ids = [decoder_start(model, where)]
    if decoder_prompt is not None:
        if not isinstance(decoder_prompt, str) or not decoder_prompt.strip():
            raise ConfigError(f"{where}: a text, or null for the decoder start token alone; got {decoder_prompt!r}")
        if tokenizer is None:
            raise ConfigError(f"{where}: a text decoder prompt needs the tokenizer; give input.tokenizer")
        ids += list(tokenizer(decoder_prompt, add_special_tokens=False)["input_ids"])
    decoder = torch.tensor([ids] * len(batch.prompts), dtype=torch.long, device=batch.input_ids.device)
    return dataclasses.replace(batch, decoder_input_ids=decoder)
