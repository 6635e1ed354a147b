"""Builders for the language-model tests: a word-level tokenizer, a tiny GPT-2, hand-written generate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from surgery.lm.text import TextBatch


@dataclass(frozen=True)
class SavedLM:
    """The directory save_pretrained wrote, and the model as it was in memory when saved (never changed)."""

    path: Path
    model: nn.Module
    vocab: int


def word_tokenizer(sentences: list[str]) -> Any:
    """A word-level tokenizer trained on ``sentences`` with the tokenizers library, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sentences, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>")


def tiny_gpt2(vocab: int, eos: int, seed: int = 0, **fields: Any) -> nn.Module:
    """A seeded GPT2LMHeadModel with eager attention; ``eos`` is also its bos."""
    torch.manual_seed(seed)
    shape = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, **fields}
    config = transformers.GPT2Config(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, **shape)
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config).eval()


def forward(model: nn.Module, batch: TextBatch, **options: Any) -> Any:
    """A plain forward without the key/value cache (filling the cache changes the logits' last bits)."""
    with torch.no_grad():
        return model(**batch.kwargs(), use_cache=False, **options)


def hand_generate(
    model: nn.Module, batch: TextBatch, tok: Any, new: int, hook: Callable[..., Any] | None = None
) -> Any:
    """``model.generate`` as a user writes it, with ``hook`` registered on block 0's MLP by hand."""
    handle = model.transformer.h[0].mlp.register_forward_hook(hook) if hook is not None else None
    try:
        with torch.no_grad():
            return model.generate(
                **batch.kwargs(), max_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=tok.eos_token_id
            )
    finally:
        if handle is not None:
            handle.remove()


def trimmed(rows: torch.Tensor, start: int, eos: int) -> list[list[int]]:
    """The new tokens of each row, cut after the first end-of-text."""
    out = []
    for row in rows[:, start:].tolist():
        out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out
