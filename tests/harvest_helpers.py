"""Builders for the harvest tests: a tiny saved LM with a word-level tokenizer, a corpus in three formats."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.lm_helpers import tiny_gpt2, word_tokenizer

WORDS = "the cat sat on a mat dog ran far away big red small blue house tree".split()


@dataclass(frozen=True)
class Corpus:
    """A saved LM (``lm``), its tokenizer, the documents, and the same corpus as .jsonl, .txt folder, datasets dir."""

    lm: Path
    model: nn.Module
    tokenizer: Any
    documents: list[str]
    jsonl: Path
    txt: Path
    datasets: Path | None


def documents(count: int = 60, seed: int = 0) -> list[str]:
    """Seeded documents of 3-40 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(count)]


def make_corpus(root: Path, count: int = 60, seed: int = 0, datasets: bool = True) -> Corpus:
    """Write the LM and the corpus under ``root``."""
    docs = documents(count, seed)
    tok = word_tokenizer(docs)
    model = tiny_gpt2(len(tok), tok.eos_token_id)
    model.save_pretrained(root / "lm")
    tok.save_pretrained(root / "lm")
    write_jsonl(root / "corpus.jsonl", docs)
    (root / "txt").mkdir()
    for i, doc in enumerate(docs):
        (root / "txt" / f"{i:04d}.txt").write_text(doc)
    folder = None
    if datasets:
        import datasets as hf_datasets

        folder = root / "ds"
        hf_datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))}).save_to_disk(str(folder))
    return Corpus(root / "lm", model, tok, docs, root / "corpus.jsonl", root / "txt", folder)


def write_jsonl(path: Path, docs: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def packed_by_hand(tok: Any, docs: list[str], context: int) -> torch.Tensor:
    """Every document's ids, the end-of-text token between two documents, cut into whole rows."""
    ids: list[int] = []
    for i, doc in enumerate(docs):
        ids += ([tok.eos_token_id] if i else []) + tok(doc, add_special_tokens=False)["input_ids"]
    rows = len(ids) // context
    return torch.tensor(ids[: rows * context]).reshape(rows, context)


def outputs_by_hand(
    model: nn.Module, rows: torch.Tensor, names: list[str], batch: int, add: float | None = None
) -> dict[str, torch.Tensor]:
    """Each module's output over ``rows``, ``batch`` rows a forward, by plain forward hooks (``add``: block 0 + add)."""
    found: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = []
    if add is not None:  # the recipe's hook first: the harvest sees the steered output, as surgery orders them
        handles.append(model.get_submodule("transformer.h.0").register_forward_hook(lambda m, a, out: out + add))
    for n in names:
        keep = found[n].append
        handles.append(model.get_submodule(n).register_forward_hook(lambda m, a, out, keep=keep: keep(out.clone())))
    try:
        with torch.no_grad():
            for start in range(0, rows.shape[0], batch):
                model(input_ids=rows[start : start + batch], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v) for n, v in found.items()}
