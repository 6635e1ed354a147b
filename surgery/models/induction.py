"""A small Llama trained to do induction: after ``A B ... A`` it predicts ``B``.

The shipped directory ``weights/induction_lm/`` (config.json, model.safetensors, tokenizer.json) is
written by scripts/train_induction_lm.py: 2 blocks ``model.layers.0..1`` of 4 heads, width 64, rotary
positions, trained on ``<bos> p s s`` where ``p`` is 0 to 8 random words and ``s`` 4 to 12 more, all
distinct, of ``w0``..``w63``. On fresh sequences it predicts the repeated half with over 95 % accuracy and
the rest near chance, by the textbook circuit: a previous-token head in block 0 (head 3) and induction heads
in block 1, which a study can find (``+experiment=induction_patching``, ``induction_circuit``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

WEIGHTS = Path(__file__).resolve().parent / "weights" / "induction_lm"  # scripts/train_induction_lm.py writes it
WORDS = 64  # the words w0..w63 are token ids 0..63
BOS, PAD, UNK = "<bos>", "<pad>", "<unk>"  # ids 64, 65, 66; every encoded text starts with <bos>
LENGTHS = (4, 12)  # the shortest and longest repeated sequence in training
PREFIX = (0, 8)  # the fewest and most random words before it


def induction_lm(path: str | None = None, attn_implementation: str = "eager", dtype: str | None = None) -> nn.Module:
    """The trained induction Llama from the package (or ``path``), offline, in eval mode; its tokenizer is there too.

    >>> model = induction_lm()
    >>> tok = surgery.lm.text.load_tokenizer(model_path=surgery.models.induction.WEIGHTS)
    """
    from surgery.lm.load import load_pretrained

    return load_pretrained(WEIGHTS if path is None else path, attn_implementation=attn_implementation, dtype=dtype)


def repeated_sequences(
    batch: int, generator: torch.Generator, lengths: tuple[int, int] = LENGTHS, prefix: tuple[int, int] = PREFIX
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids ``<bos> p s s <pad>...``, their attention mask, and where each row's first ``s`` starts.

    Each row draws the length of ``p`` from ``prefix`` and of ``s`` from ``lengths`` (inclusive), all its words
    distinct, so every token of the second copy has exactly one earlier occurrence to copy from and the copy
    can start anywhere: the model has to find it by content. Ids are ``[batch, 1 + prefix[1] + 2 * lengths[1]]``.

    >>> ids, mask, starts = repeated_sequences(8, torch.Generator().manual_seed(0))
    """
    low, high = lengths
    ids = torch.full((batch, 1 + prefix[1] + 2 * high), WORDS + 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:, 0] = WORDS
    sizes = torch.randint(low, high + 1, (batch,), generator=generator)
    before = torch.randint(prefix[0], prefix[1] + 1, (batch,), generator=generator)
    for row, (size, pre) in enumerate(zip(sizes.tolist(), before.tolist(), strict=True)):
        words = torch.randperm(WORDS, generator=generator)[: pre + size]
        ids[row, 1 : 1 + pre + 2 * size] = torch.cat([words, words[pre:]])
        mask[row, : 1 + pre + 2 * size] = 1
    return ids, mask, 1 + before
