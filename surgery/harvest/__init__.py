"""Activation datasets: a text corpus through a (surgered) model, every site's activations written as shards.

``python -m surgery +model=hf model.path=DIR +input=text_dataset input.path=CORPUS mode=harvest
harvest.sites=[transformer.h.*]`` writes ``activations/`` into the run directory; read it back with
:func:`surgery.activations.open`. From Python::

    from surgery.harvest import harvest_corpus
    outcome = harvest_corpus(model, tokenizer, "corpus.jsonl", "acts", sites=["transformer.h.*"], context=128)

Files and layout: :mod:`surgery.harvest.shards`; corpus reading and packing: :mod:`surgery.harvest.corpus`;
the loop (resume, ranks, writer thread): :mod:`surgery.harvest.run`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.errors import ConfigError
from surgery.harvest.config import HarvestSettings, TextDatasetInput
from surgery.harvest.corpus import TextCorpus, end_of_text, packed_rows
from surgery.harvest.run import HarvestRun, Outcome, harvest
from surgery.harvest.shards import json_fingerprint, state_fingerprint

__all__ = ["HarvestSettings", "TextDatasetInput", "HarvestRun", "Outcome", "harvest", "harvest_corpus"]


def harvest_corpus(
    model: nn.Module,
    tokenizer: Any,
    path: str | Path,
    directory: str | Path,
    sites: Sequence[str],
    *,
    column: str = "text",
    split: str | None = None,
    context: int = 128,
    limit_tokens: int | None = None,
    batch_size: int = 8,
    exclude: Sequence[str] = ("bos", "pad", "eos"),
    dtype: str | None = None,
    shard_mb: float = 128,
    actions: dict[str, Any] | None = None,
    seed: int = 0,
    strict: bool = True,
    safe: bool = False,
    ranks: tuple[int, int] = (0, 1),
    stop_requested: Callable[[], bool] | None = None,
    progress: bool = True,
) -> Outcome:
    """Harvest ``sites`` of ``model`` (with ``actions`` applied) over the corpus at ``path`` into ``directory``.

    Resumes an earlier, interrupted harvest into the same directory; refuses one of another model, corpus
    or config. Returns the manifest written (``Outcome.manifest``).
    """
    from surgery.core.schema import validate

    given = {"path": str(path), "column": column, "split": split, "context": context, "limit_tokens": limit_tokens,
             "batch_size": batch_size}  # fmt: skip
    corpus_input = validate(TextDatasetInput, given, "input")
    settings = validate(HarvestSettings, {"sites": list(sites), "exclude": list(exclude), "dtype": dtype,
                                          "shard_mb": shard_mb}, "harvest")  # fmt: skip
    check_context(model, context)
    corpus = TextCorpus.open(corpus_input)
    eos = end_of_text(tokenizer, model)  # the tokenizer's, else the model config's (the shipped induction model)
    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in settings.exclude}
    special["eos"] = eos if "eos" in special else None
    excluded = sorted({i for i in special.values() if isinstance(i, int)})
    vocab = sorted(tokenizer.get_vocab().items()) if hasattr(tokenizer, "get_vocab") else repr(tokenizer)
    config = {"sites": settings.sites, "exclude": settings.exclude, "dtype": settings.dtype, "shard_mb": shard_mb,
              "batch_size": batch_size, "context": context, "actions": actions or {}, "seed": seed}  # fmt: skip
    prints = {
        "model": state_fingerprint(model),
        "corpus": json_fingerprint({"corpus": corpus.describe(), "tokenizer": vocab}),
        "config": json_fingerprint(config),
    }
    about = {"corpus": corpus.describe(), "exclude": settings.exclude, "limit_tokens": limit_tokens,
             "model": {"class": f"{type(model).__module__}.{type(model).__qualname__}"}}  # fmt: skip
    rows = packed_rows(tokenizer, corpus.documents(), context, limit_tokens, eos=eos)
    run = HarvestRun(
        model, rows, Path(directory), list(settings.sites), context, dict(actions or {}), excluded,
        getattr(torch, settings.dtype) if settings.dtype else None, settings.shard_mb, batch_size,
        None if limit_tokens is None else limit_tokens // context, prints, about, seed, strict, safe, ranks,
        stop_requested, progress, _estimate(corpus) if limit_tokens is None else None,
    )  # fmt: skip
    return harvest(run)


def _estimate(corpus: TextCorpus) -> Callable[[int], int]:
    """Tokens in the whole corpus, about: the tokens so far scaled by the corpus's size over the text read so far."""
    size = corpus.size

    def estimate(tokens: int) -> int:
        return int(tokens * size / corpus.read) if corpus.read else 0

    return estimate


def check_context(model: nn.Module, context: int) -> None:
    """Refuse rows longer than the model's positions (``max_position_embeddings``, ``n_positions``)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        positions = getattr(config, key, None)
        if isinstance(positions, int) and positions > 0:
            if context > positions:
                raise ConfigError(
                    f"input.context: {context} tokens per row, but the model has {positions} positions ({key});"
                    f" use input.context={positions} or less"
                )
            return
