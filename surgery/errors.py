"""Errors users see: each says where (``actions.NAME.KEY``), what was given and what would work."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class SurgeryError(Exception):
    """Base of every error `surgery` raises on purpose; the CLI exits 2 on these."""


class ConfigError(SurgeryError):
    """A config value is unknown, mistyped, missing or does not fit the model."""


class NoMatchError(ConfigError):
    """A selector matched no module (or no parameter) while `strict` is on."""


class ActionError(SurgeryError):
    """An action failed while being applied or while one of its hooks ran."""


def did_you_mean(given: str, options: Iterable[str], n: int = 3) -> str:
    """Return ' Did you mean X?' for the closest options, or '' when nothing is close."""
    close = difflib.get_close_matches(given, list(options), n=n, cutoff=0.5)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


class CompiledModelWarning(UserWarning):
    """Surgery on a ``torch.compile``-d model: torch ignores hooks changed after its first call."""
