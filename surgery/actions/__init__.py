"""Action kinds, one file per family; each registers itself in ``KINDS`` when imported here."""

from surgery.actions import capture, forward, grads, init, lora, modules, params, state  # noqa: F401 - registers kinds
from surgery.actions.base import KINDS

__all__ = ["KINDS"]
