"""Lines for people: the plan, the summary, the ``log`` action's shapes, on stdout and in the run's log.

Under the command line Hydra has configured logging (its job log: console and ``surgery.log``), so
lines go to the ``surgery`` logger; called as a library, nothing is configured and they are printed.
"""

from __future__ import annotations

import logging

LOG = logging.getLogger("surgery")
_state = {"logging": False}


def use_logging(on: bool) -> None:
    """Send lines to the ``surgery`` logger (on) or print them (off); the CLI turns it on once Hydra set logging up."""
    _state["logging"] = on and LOG.isEnabledFor(logging.INFO) and LOG.hasHandlers()


def say(text: object) -> None:
    """One message for people: logged at INFO when logging is on, else printed to stdout."""
    if _state["logging"]:
        LOG.info("%s", text)
    else:
        print(text, flush=True)
