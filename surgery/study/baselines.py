"""Named baselines for ``study.normalize`` (SPEC §20): what 0 and 1 mean on the normalized scale.

``normalize: true`` is ``(cell − zero) / (one − zero)`` per example with ``zero: unmodified`` and
``one: source``; ``normalize: mean`` the same on the means over examples (as TransformerLens
normalizes a patching metric); ``{zero: B, one: B}`` names either end, where a baseline ``B`` is
``unmodified``, ``source``, or a list of the study's action names applied alone. Causal tracing, with
a noise action corrupting the main run and a restore patch per cell, is ``{zero: [noise], one:
unmodified}``: the unmodified run and the source are both clean, so the default would divide by 0.

Examples whose ``one`` equals their ``zero`` have no scale: they are counted and reported, and left
out of the mean; a study where every example has none is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from surgery.errors import ConfigError
from surgery.study.grid import placeholders

NAMED = ("unmodified", "source")
OVER = ("example", "mean")


@dataclass(frozen=True)
class Normalization:
    """Which baselines are 0 and 1, and whether the scale is per example or on the means."""

    zero: str | tuple[str, ...]
    one: str | tuple[str, ...]
    over: str = "example"

    def baselines(self) -> list[tuple[str, ...]]:
        """The action lists among the two ends (each run once per batch, alone)."""
        return [end for end in (self.zero, self.one) if isinstance(end, tuple)]

    def describe(self) -> dict[str, Any]:
        """As report.json shows it."""
        show = lambda end: end if isinstance(end, str) else list(end)  # noqa: E731
        return {"zero": show(self.zero), "one": show(self.one), "over": self.over}


def parse_normalize(value: Any, actions: Mapping[str, Any], sourced: bool) -> Normalization | None:
    """``study.normalize`` as a Normalization (None: off), every name checked before anything runs."""
    if value is None or value is False:
        return None
    if value is True:
        found = Normalization("unmodified", "source")
    elif value == "mean":
        found = Normalization("unmodified", "source", "mean")
    elif isinstance(value, Mapping):
        extra = sorted(set(map(str, value)) - {"zero", "one", "over"})
        if extra:
            raise ConfigError(f"study.normalize.{extra[0]}: unknown key; normalize takes zero, one and over")
        over = value.get("over", "example")
        if over not in OVER:
            raise ConfigError(f"study.normalize.over: {over!r} is not one of {', '.join(OVER)}")
        ends = [
            _end(value.get(k, d), f"study.normalize.{k}", actions) for k, d in (("zero", NAMED[0]), ("one", NAMED[1]))
        ]
        found = Normalization(ends[0], ends[1], over)
    else:
        raise ConfigError(
            f"study.normalize: true, false, mean or {{zero: BASELINE, one: BASELINE}} (a baseline is unmodified,"
            f" source, or a list of this study's action names), got {value!r}"
        )
    if found.zero == found.one:
        raise ConfigError(f"study.normalize: zero and one are the same baseline ({found.describe()['zero']})")
    if "source" in (found.zero, found.one) and not sourced:
        raise ConfigError("study.normalize: the source baseline needs a source input (+source=...)")
    return found


def _end(value: Any, at: str, actions: Mapping[str, Any]) -> str | tuple[str, ...]:
    if value in NAMED:
        return str(value)
    names = [value] if isinstance(value, str) and value in actions else value
    if not isinstance(names, list | tuple) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"{at}: unmodified, source, or a list of this study's action names (e.g. [noise]); got {value!r}"
        )
    for name in names:
        if name not in actions:
            raise ConfigError(f"{at}: {name!r} is not an action of this study (actions: {', '.join(actions)})")
        used = placeholders({name: actions[name]}, "actions")
        if used:
            raise ConfigError(
                f"{at}: {name!r} changes with the grid ({{{next(iter(used))}}}), so it is no single baseline; name"
                " actions without placeholders"
            )
    return tuple(names)


def label(end: str | tuple[str, ...] | list[str]) -> str:
    """The baseline's name in results: ``unmodified``, ``source`` or ``noise+other``."""
    return end if isinstance(end, str) else "+".join(end)


def normalized(
    values: torch.Tensor, zero: torch.Tensor, one: torch.Tensor, over: str, metric: str
) -> tuple[torch.Tensor, int]:
    """``values`` ``[cells, examples]`` on the 0–1 scale, and how many examples had no scale (left NaN).

    ``over="mean"``: every value is scaled by the means' difference, so the normalized mean is
    ``(mean(cell) − mean(zero)) / (mean(one) − mean(zero))``, TransformerLens's normalization.
    """
    if over == "mean":
        low, high = zero.nanmean(), one.nanmean()
        if not torch.isfinite(high - low) or high == low:
            raise ConfigError(
                f"study.normalize: the {metric} means of the two baselines are equal ({float(low):.6g}), so nothing"
                " can be normalized; choose other baselines (study.normalize.zero / .one)"
            )
        return (values - low) / (high - low), 0
    scale = one - zero
    flat = scale == 0
    if bool(flat.all()):
        raise ConfigError(
            f"study.normalize: every example has the same {metric} in both baselines, so none can be normalized"
            " (in causal tracing the unmodified run and the source are both clean: normalize: {zero: [noise],"
            " one: unmodified})"
        )
    return torch.where(flat, torch.nan, (values - zero) / scale), int(flat.sum())
