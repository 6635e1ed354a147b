"""Errors users see: each says where (``actions.NAME.KEY``), what was given and what would work."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence

EXIT_OK = 0
EXIT_INTERNAL = 1  # an unexpected failure: a bug of ours, reported with its traceback
EXIT_BAD_INPUT = 2  # a SurgeryError: bad config, input or arguments, one line on stderr

# "actions.a.std: ..." or "input.batches: ...": the key a message starts with
_WHERE = re.compile(r"^([A-Za-z_<][\w<>\[\].*-]*(?:\.[\w<>\[\].*-]+)*): ")


class SurgeryError(Exception):
    """Base of every error `surgery` raises on purpose; the CLI exits 2 on these.

    ``where`` is the config key the message starts with (``actions.a.std``), ``options`` what would have
    worked where the raiser knows it; both also let callers react without parsing the text.
    """

    def __init__(self, message: str = "", *, where: str | None = None, options: Sequence[str] = ()) -> None:
        super().__init__(message)
        match = _WHERE.match(message) if where is None else None
        self.where: str | None = match.group(1) if match else where
        self.options: tuple[str, ...] = tuple(options)


class ConfigError(SurgeryError):
    """A config value is unknown, mistyped, missing or does not fit the model."""


class NoMatchError(ConfigError):
    """A selector matched no module (or no parameter) while `strict` is on."""


class ActionError(SurgeryError):
    """An action failed while being applied or while one of its hooks ran."""


class SweepError(SurgeryError):
    """Bad input to ``python -m surgery.sweep``: one message, exit 2."""


class ReplayError(SurgeryError):
    """Bad input to ``python -m surgery.replay``: one message, exit 2."""


def did_you_mean(given: str, options: Iterable[str], n: int = 3) -> str:
    """Return ' Did you mean X?' for the closest options, or '' when nothing is close."""
    close = difflib.get_close_matches(given, list(options), n=n, cutoff=0.5)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


class CompiledModelWarning(UserWarning):
    """Surgery on a ``torch.compile``-d model: torch ignores hooks changed after its first call."""
