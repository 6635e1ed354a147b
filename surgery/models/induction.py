"""A small GPT-2 trained to do induction: after ``A B ... A`` it predicts ``B``.

The shipped directory ``weights/induction_lm/`` (config.json, model.safetensors, tokenizer.json) is
written by scripts/train_induction_lm.py: 2 blocks ``transformer.h.0..1`` of 4 heads, width 64, trained
on ``<bos> s s`` where ``s`` is 4 to 12 distinct words of ``w0``..``w63``. On fresh sequences it predicts
the repeated half with over 95 % accuracy and the first half near chance, so the mechanism that copies is
one a study can find (``+experiment=induction_patching``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

WEIGHTS = Path(__file__).resolve().parent / "weights" / "induction_lm"  # scripts/train_induction_lm.py writes it
WORDS = 64  # the words w0..w63 are token ids 0..63
BOS, PAD, UNK = "<bos>", "<pad>", "<unk>"  # ids 64, 65, 66; every encoded text starts with <bos>
LENGTHS = (4, 12)  # the shortest and longest repeated sequence in training


def induction_lm(path: str | None = None, attn_implementation: str = "eager", dtype: str | None = None) -> nn.Module:
    """The trained induction GPT-2 from the package (or ``path``), offline, in eval mode; its tokenizer is there too.

    >>> model = induction_lm()
    >>> tok = surgery.lm.text.load_tokenizer(model_path=surgery.models.induction.WEIGHTS)
    """
    from surgery.lm.load import load_pretrained

    return load_pretrained(WEIGHTS if path is None else path, attn_implementation=attn_implementation, dtype=dtype)


def repeated_sequences(
    batch: int, generator: torch.Generator, lengths: tuple[int, int] = LENGTHS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``<bos> s s <pad>...`` and their attention mask, ``[batch, 1 + 2 * longest]``.

    Each row's ``s`` has a length drawn from ``lengths`` (inclusive) and distinct words, so inside one copy
    no token repeats and every token of the second copy has exactly one earlier occurrence to copy from.

    >>> ids, mask = repeated_sequences(8, torch.Generator().manual_seed(0))
    """
    low, high = lengths
    ids = torch.full((batch, 1 + 2 * high), WORDS + 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:, 0] = WORDS
    sizes = torch.randint(low, high + 1, (batch,), generator=generator)
    for row, size in enumerate(sizes.tolist()):
        words = torch.randperm(WORDS, generator=generator)[:size]
        ids[row, 1 : 1 + 2 * size] = torch.cat([words, words])
        mask[row, : 1 + 2 * size] = 1
    return ids, mask
