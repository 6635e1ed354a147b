"""Which kind of language model a model is, so that next-token metrics are refused where they mean nothing.

``perplexity`` (and a study's ``loss`` on text) score each token from the positions before it: the
contract of a causal LM. A masked LM (BERT) sees both sides of every position, so the same
arithmetic on its logits gives a number that looks like a perplexity and is not one; an
encoder-decoder model's logits are its decoder's, not the prompt's. A model that is not from
transformers cannot be told apart and is taken at its word.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from torch import nn

from surgery.errors import ConfigError

CAUSAL_ONLY = ("perplexity",)  # metrics of the run (surgery.lm.metrics) that read the next token
STUDY_CAUSAL_ONLY = ("loss",)  # a study's per-example loss on text is the next-token loss (surgery.study.metrics)
STUDY_INSTEAD = "kl, logit_diff, prob, logit or rank"
INSTEAD = "agreement, kl, logit_diff: {correct, wrong}, or accuracy/top5/loss (each position against its own token)"


def not_causal(model: nn.Module) -> str | None:
    """Why ``model`` is not a causal language model (one phrase), or None when it is one or cannot be told."""
    hf = sys.modules.get("transformers")  # a model from transformers means transformers is imported already
    if hf is None or not isinstance(model, hf.PreTrainedModel):
        return None
    from transformers.models.auto import modeling_auto as auto

    name = type(model).__name__
    if bool(getattr(model.config, "is_encoder_decoder", False)):
        return f"{name} is an encoder-decoder model (its logits are the decoder's, not the prompt's)"
    if name in set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return None
    if name in set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()):
        return f"{name} is a masked language model (each position sees both sides, so there is no next token)"
    return f"{name} is not a causal language model"


def refuse_causal_metrics(
    model: nn.Module, names: Iterable[Any], where: str = "metrics", causal: tuple[str, ...] = CAUSAL_ONLY,
    instead: str = INSTEAD,
) -> None:  # fmt: skip
    """Refuse next-token metrics (``perplexity``) on a model that is not a causal LM, naming what would work."""
    why = not_causal(model)
    if why is None:
        return
    for entry in names:
        name = entry if isinstance(entry, str) else getattr(entry, "name", None)
        if name in causal:
            raise ConfigError(f"{where}: {name} scores each token from the ones before it, but {why}; use {instead}")
