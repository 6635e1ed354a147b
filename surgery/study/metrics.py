"""Per-example metrics of a study: one value per example, never averaged before the statistics.

Each metric is a plain function of the logits (TransformerLens's patching metrics have the same
shape): ``metric(logits, labels, reference) -> Tensor[batch]`` in float64, where ``labels`` are a text
batch's token ids with -100 at padding (or a classifier's class labels) and ``reference`` the
unmodified model's logits on the same batch. Text logits are ``[batch, length, vocab]``; the
position scored is the last real one of each row unless the metric's ``pos`` names another
(an int, negative from the end); ``[batch, classes]`` logits have one position.

| metric | per example |
|---|---|
| ``logit_diff: {correct, wrong}`` | ``logit[correct] - logit[wrong]`` |
| ``prob: {token}`` | softmax probability of ``token`` |
| ``logit: {token}`` | the logit of ``token`` |
| ``rank: {token}`` | how many tokens have a larger logit (0 = top) |
| ``loss`` | cross-entropy: text, the mean next-token loss over the row's real tokens; classes, against the label |
| ``kl`` | KL(unmodified ‖ surgered) at the scored position |
| ``accuracy`` | 1.0 when the argmax is the label (classes) |
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from surgery.errors import ConfigError
from surgery.lm.metrics import last_positions, single_token
from surgery.lm.text import IGNORE

Fn = Callable[[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]
TOKEN_KEYS = {"logit_diff": ("correct", "wrong"), "prob": ("token",), "logit": ("token",), "rank": ("token",)}
PLAIN = ("loss", "kl", "accuracy")
NAMES = (*TOKEN_KEYS, *PLAIN)


@dataclass(frozen=True)
class PerExample:
    """A per-example metric bound to its options: ``fn(logits, labels, reference) -> Tensor[batch]``."""

    name: str
    fn: Fn
    needs_reference: bool = False
    needs_labels: bool = False

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor | None = None, reference: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The metric's value for every example of the batch, in float64."""
        return self.fn(logits, labels, reference)


def scored(logits: torch.Tensor, labels: torch.Tensor | None, pos: int | None) -> torch.Tensor:
    """The ``[batch, vocab]`` logits at each row's scored position, in float64."""
    if logits.dim() == 2:  # not detached: an attribution differentiates the metric
        return logits.double()
    if logits.dim() != 3:
        raise ConfigError(f"study.metrics: logits [batch, vocab] or [batch, length, vocab]; got {list(logits.shape)}")
    if pos is None:  # the positions picked first, then widened: the same numbers, a vocab row per example converted
        if _last_everywhere(logits, labels):
            return logits[:, -1].double()  # a slice: the same numbers as the gather below, a cheaper backward
        rows = torch.arange(logits.shape[0], device=logits.device)
        return logits[rows, last_positions(logits, labels)].double()
    if not -logits.shape[1] <= pos < logits.shape[1]:
        raise ConfigError(f"study.metrics: pos {pos} is outside the input's {logits.shape[1]} positions")
    return logits[:, pos].double()


def _last_everywhere(logits: torch.Tensor, labels: torch.Tensor | None) -> bool:
    """Whether every row's scored position is the last one (no labels, or each row's last label real), where
    that is known without waiting on a device: a host tensor, or no labels to read."""
    global _LAST_SEEN
    if labels is None or labels.dim() != 2 or labels.shape != logits.shape[:2]:
        return True
    if labels.device.type != "cpu":
        return False
    seen = _LAST_SEEN
    if seen is not None and seen[0]() is labels and seen[1] == labels._version:  # a study scores one batch's
        return seen[2]  # labels once per cell: the answer is the same until they change
    answer = bool((labels[:, -1] != IGNORE).all())
    _LAST_SEEN = (weakref.ref(labels), labels._version, answer)
    return answer


_LAST_SEEN: tuple[weakref.ref[torch.Tensor], int, bool] | None = None  # the labels last asked about, and the answer


def _logit_diff(correct: int, wrong: int, pos: int | None, logits: Any, labels: Any, reference: Any) -> torch.Tensor:
    z = scored(logits, labels, pos)
    return z[:, correct] - z[:, wrong]


def _prob(token: int, pos: int | None, logits: Any, labels: Any, reference: Any) -> torch.Tensor:
    return torch.softmax(scored(logits, labels, pos), dim=-1)[:, token]


def _logit(token: int, pos: int | None, logits: Any, labels: Any, reference: Any) -> torch.Tensor:
    return scored(logits, labels, pos)[:, token]


def _rank(token: int, pos: int | None, logits: Any, labels: Any, reference: Any) -> torch.Tensor:
    z = scored(logits, labels, pos)
    return (z > z[:, token : token + 1]).sum(dim=-1).double()


def _loss(pos: int | None, logits: torch.Tensor, labels: torch.Tensor | None, reference: Any) -> torch.Tensor:
    if labels is None:
        raise ConfigError("study.metrics.loss: needs labels (a data set's, or a text input's token ids)")
    z = logits.double()
    if z.dim() == 2:
        return F.cross_entropy(z, labels.long(), reduction="none")
    targets = labels[:, 1:].masked_fill(labels[:, :-1] == IGNORE, IGNORE)  # as perplexity: real → real only
    nll = F.cross_entropy(z[:, :-1].transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
    counted = (targets != IGNORE).sum(dim=1).clamp(min=1)
    return nll.sum(dim=1) / counted


def _kl(pos: int | None, logits: torch.Tensor, labels: Any, reference: torch.Tensor | None) -> torch.Tensor:
    if reference is None:
        raise ConfigError("study.metrics.kl: compares with the unmodified model, which this study did not run")
    p = torch.log_softmax(scored(reference, labels, pos), dim=-1)
    q = torch.log_softmax(scored(logits, labels, pos), dim=-1)
    return (p.exp() * (p - q)).sum(dim=-1)


def _accuracy(pos: int | None, logits: torch.Tensor, labels: torch.Tensor | None, reference: Any) -> torch.Tensor:
    if labels is None or logits.dim() != 2:
        raise ConfigError("study.metrics.accuracy: needs [batch, classes] logits and class labels")
    return (logits.detach().argmax(dim=-1) == labels).double()


def token_id(tokenizer: Any, token: Any, where: str) -> int:
    """A token argument as an id: an int is the id; a text must be exactly one token of ``tokenizer``."""
    if isinstance(token, int) and not isinstance(token, bool):
        if token < 0:
            raise ConfigError(f"{where}: a token id is at least 0; got {token}")
        return token
    if tokenizer is None:
        raise ConfigError(f"{where}: {token!r} is a text, but there is no tokenizer; give a token id or tokenizer=")
    return single_token(tokenizer, token, where)


def per_example(name: str, options: Any = None, tokenizer: Any = None, where: str = "study.metrics") -> PerExample:
    """The per-example metric ``name`` bound to ``options`` (token texts resolved with ``tokenizer``)."""
    at = f"{where}.{name}"
    if name not in NAMES:
        raise ConfigError(f"{at}: unknown per-example metric. Available: {', '.join(NAMES)}.")
    options = dict(options or {})
    pos = options.pop("pos", None)
    if pos is not None and (isinstance(pos, bool) or not isinstance(pos, int)):
        raise ConfigError(f"{at}.pos: a position (an int, negative from the end); got {pos!r}")
    wanted = TOKEN_KEYS.get(name, ())
    if set(options) != set(wanted):
        need = ", ".join(wanted) if wanted else "nothing but pos"
        raise ConfigError(f"{at}: takes {need}; got {sorted(options) or 'none'}")
    ids = [token_id(tokenizer, options[key], f"{at}.{key}") for key in wanted]
    fns: dict[str, Callable[..., torch.Tensor]] = {
        "logit_diff": _logit_diff, "prob": _prob, "logit": _logit, "rank": _rank,
        "loss": _loss, "kl": _kl, "accuracy": _accuracy,
    }  # fmt: skip
    return PerExample(name, partial(fns[name], *ids, pos), name == "kl", name in ("loss", "accuracy"))


def parse_metrics(spec: Any, tokenizer: Any = None, where: str = "study.metrics") -> list[PerExample]:
    """A metrics list (names and one-key dicts ``{prob: {token: " w44"}}``) as bound per-example metrics."""
    if isinstance(spec, str | Mapping):
        spec = [spec] if isinstance(spec, str) else [{k: v} for k, v in spec.items()]
    if not isinstance(spec, Sequence) or not spec:
        raise ConfigError(f'{where}: a list of metrics, e.g. [{{logit_diff: {{correct: " a", wrong: " b"}}}}]')
    bound: list[PerExample] = []
    for i, entry in enumerate(spec):
        if isinstance(entry, PerExample):
            bound.append(entry)
        elif isinstance(entry, str):
            bound.append(per_example(entry, None, tokenizer, f"{where}[{i}]"))
        elif isinstance(entry, Mapping) and len(entry) == 1:
            name, options = next(iter(entry.items()))
            if options is not None and not isinstance(options, Mapping):
                raise ConfigError(f"{where}[{i}].{name}: options are a mapping; got {options!r}")
            bound.append(per_example(str(name), options, tokenizer, f"{where}[{i}]"))
        else:
            raise ConfigError(f"{where}[{i}]: a metric name or {{NAME: {{options}}}}; got {entry!r}")
    names = [m.name for m in bound]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{where}: {twice[0]} is listed twice; results are keyed by metric name")
    return bound
