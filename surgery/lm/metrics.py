"""Language-model metrics in the metric registry: ``perplexity`` and ``logit_diff``.

How they get token ids and masks: a metric's batch function sees ``(logits, labels, reference)``,
so a text batch is scored with ``labels = TextBatch.labels`` as its ``y`` -- the prompt's token
ids with -100 at padding (Hugging Face's ``labels`` convention, unshifted). From that one tensor

- ``perplexity`` takes the next-token targets (``labels[:, 1:]`` against ``logits[:, :-1]``) and skips
  -100, so padding never counts; its batch gives (sum of NLL, tokens) and the registry's ``finish``
  (``math.exp``) turns the mean NLL over every scored token of every batch into a perplexity;
- ``logit_diff`` finds each prompt's last real position (the last label that is not -100; without
  labels, position -1, which left padding makes the last real token).

``logit_diff`` also needs the two answer tokens, which are options, not data: ``logit_diff(tokenizer,
correct, wrong)`` returns a Metric bound to their ids (each text must be exactly one token), which
``Scores`` takes in place of a name. Its value per prompt is ``logits[pos, correct] - logits[pos, wrong]``,
the mean over prompts is reported. The bare registered name refuses to run and says what it needs.

``agreement`` and ``kl`` work on text logits too (every position counts, padding included); ``accuracy``,
``top5`` and ``loss`` compare each position with its own token, not the next one: use ``perplexity``.
Import this module to register the metrics (``import surgery.lm.metrics``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from surgery.data.metrics import METRICS, Metric, metric
from surgery.errors import ConfigError
from surgery.lm.text import IGNORE

DEFAULT_TEXT = ("perplexity", "agreement", "kl")  # metrics for a text input when none are named
LOGIT_DIFF_DOC = "mean over prompts of logit[correct] - logit[wrong] at the last position"


@metric("perplexity", "exp of the mean next-token cross-entropy over the prompt tokens", labels=True, finish=math.exp)
def _perplexity(logits: torch.Tensor, labels: torch.Tensor | None, reference: torch.Tensor) -> tuple[float, int]:
    if labels is None or labels.dim() != 2 or logits.dim() != 3 or labels.shape != logits.shape[:2]:
        got = None if labels is None else list(labels.shape)
        raise ConfigError(
            f"metrics.perplexity: needs logits [batch, length, vocab] and labels [batch, length] (the prompt's token"
            f" ids, -100 at padding); got logits {list(logits.shape)} and labels {got}"
        )
    # a token counts when it and the position predicting it are real: the first real token after left
    # padding is predicted from a pad position, so it is skipped like the pads themselves
    targets = labels[:, 1:].masked_fill(labels[:, :-1] == IGNORE, IGNORE).reshape(-1)
    z = logits.detach()[:, :-1].reshape(-1, logits.shape[-1]).double()
    nll = F.cross_entropy(z, targets, ignore_index=IGNORE, reduction="sum")
    return float(nll), int((targets != IGNORE).sum())


@metric("logit_diff", LOGIT_DIFF_DOC, labels=False)
def _unbound_logit_diff(
    logits: torch.Tensor, labels: torch.Tensor | None, reference: torch.Tensor
) -> tuple[float, int]:
    raise ConfigError('metrics.logit_diff: needs its two answers, e.g. logit_diff: {correct: " Paris", wrong: " Rome"}')


def last_positions(logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Each row's last real position: the last label that is not -100, else the last position."""
    length = logits.shape[1]
    if labels is None or labels.dim() != 2 or labels.shape != logits.shape[:2]:
        return torch.full((logits.shape[0],), length - 1, dtype=torch.long, device=logits.device)
    index = torch.arange(length, device=labels.device).expand_as(labels)
    return torch.where(labels != IGNORE, index, -1).amax(dim=1).clamp(min=0)


def _logit_diff(
    correct: int, wrong: int, logits: torch.Tensor, labels: torch.Tensor | None, reference: torch.Tensor
) -> tuple[float, int]:
    if logits.dim() == 2:  # one position per example: [batch, vocab]
        z = logits.detach().double()
    else:
        rows = torch.arange(logits.shape[0], device=logits.device)
        z = logits.detach()[rows, last_positions(logits, labels)].double()
    return float((z[:, correct] - z[:, wrong]).sum()), int(z.shape[0])


def single_token(tokenizer: Any, text: Any, where: str) -> int:
    """The one token id of ``text``; a text of no or several tokens is refused."""
    if not isinstance(text, str) or not text:
        raise ConfigError(f'{where}: a text that is one token, e.g. " Paris"; got {text!r}')
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and ids == [unknown] and text.strip() != getattr(tokenizer, "unk_token", None):
        raise ConfigError(f"{where}: {text!r} is not in the tokenizer's vocabulary (it encodes to the unknown token)")
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids) if ids else []
        raise ConfigError(
            f"{where}: {text!r} is {len(ids)} tokens {pieces} with this tokenizer; logit_diff compares single"
            ' tokens, so give one token (often with its leading space, e.g. " Paris")'
        )
    return int(ids[0])


def logit_diff(tokenizer: Any, correct: Any, wrong: Any, where: str = "metrics.logit_diff") -> Metric:
    """The ``logit_diff`` metric bound to the ids of ``correct`` and ``wrong`` (each exactly one token).

    >>> Scores(["perplexity", logit_diff(tok, " Paris", " Rome")])
    """
    ids = single_token(tokenizer, correct, f"{where}.correct"), single_token(tokenizer, wrong, f"{where}.wrong")
    return Metric("logit_diff", LOGIT_DIFF_DOC, False, partial(_logit_diff, *ids))


def text_metrics(spec: Any, tokenizer: Any, where: str = "metrics") -> list[str | Metric]:
    """What ``Scores`` takes for a metrics config on text: names, ``{logit_diff: {correct, wrong}}`` bound.

    ``spec``: a list of names and one-key dicts, or a dict name → options (null for none); None: DEFAULT_TEXT.
    """
    if spec is None:
        return list(DEFAULT_TEXT)
    items: list[tuple[str, Any, str]] = []
    if isinstance(spec, Mapping):
        items = [(str(k), v, f"{where}.{k}") for k, v in spec.items()]
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        for i, entry in enumerate(spec):
            if isinstance(entry, Mapping) and len(entry) == 1:
                name, options = next(iter(entry.items()))
                items.append((str(name), options, f"{where}[{i}].{name}"))
            else:
                items.append((str(entry), None, f"{where}[{i}]"))
    else:
        raise ConfigError(f"{where}: a list of metric names, e.g. [perplexity, agreement]; got {spec!r}")
    chosen: list[str | Metric] = []
    for name, options, at in items:
        METRICS.get(name, at)
        if name == "logit_diff":
            if not isinstance(options, Mapping) or set(options) != {"correct", "wrong"}:
                raise ConfigError(
                    f'{at}: needs {{correct: TEXT, wrong: TEXT}}, e.g. {{correct: " Paris", wrong: " Rome"}}'
                )
            chosen.append(logit_diff(tokenizer, options["correct"], options["wrong"], at))
        elif options:
            raise ConfigError(f"{at}: {name!r} takes no options; got {options!r}")
        else:
            chosen.append(name)
    return chosen
