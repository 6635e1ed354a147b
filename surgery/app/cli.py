"""The command line: the only ``@hydra.main``. Thin: compose → run_job → exit code.

Exit codes: 0 success; 2 a bad config or input (one message, no traceback unless
``verbose=true``, nothing written); 1 an unexpected internal failure.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from surgery.core.paths import config_dir, group_options
from surgery.errors import SurgeryError

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1


class InternalFailure(SystemExit):
    """Our own exit 1, told apart from Hydra's exit 1 for a bad override; launchers re-raise it intact."""


def usage() -> str:
    """The short help printed when no model is given."""
    groups = {g: group_options(g) for g in ("model", "actions", "input", "experiment")}
    lines = [
        "surgery: declarative model surgery for PyTorch.",
        "",
        "  python -m surgery +model=MODEL +actions=ACTIONS        run",
        "  python -m surgery +model=MODEL +actions=A mode=plan    what would match, change nothing",
        "  python -m surgery +model=MODEL mode=modules            list module names and types",
        "  python -m surgery +experiment=NAME                     a whole experiment",
        "  python -m surgery --help                               every setting (Hydra)",
        "",
    ]
    for group, options in groups.items():
        lines.append(f"{group + ':':12}{', '.join(options) or '(none)'}")
    lines += ["", "Example: python -m surgery +model=cnn +actions=linearize"]
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def _task(cfg: DictConfig) -> None:
    if cfg.get("model") is None:
        print(usage())
        return
    from hydra.core.hydra_config import HydraConfig

    from surgery.app.job import run_job

    verbose = bool(cfg.get("verbose", False))
    try:
        run_job(cfg, Path(HydraConfig.get().runtime.output_dir))
    except SurgeryError as e:
        if verbose:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except Exception:
        traceback.print_exc()
        print(
            "error: an unexpected internal failure (exit 1); please report it with the traceback above", file=sys.stderr
        )
        raise InternalFailure(EXIT_INTERNAL) from None


def _safe_in(config: DictConfig) -> bool:
    """Whether a composed config asks for safe mode: anything but an explicit false (it is not validated yet)."""
    value = OmegaConf.select(config, "safe", default=False, throw_on_resolution_failure=False)
    return value not in (False, None, 0, "false", "False")


def _guard_hydra_callbacks() -> None:
    """Check ``hydra.callbacks`` against the safe-mode allowlist before Hydra builds them.

    Hydra instantiates its callbacks (``Callbacks(cfg)``, right after composing, before the run
    directory or the task) with no hook of its own, so the check wraps that constructor.
    """
    from hydra._internal.callbacks import Callbacks

    from surgery.core.callables import check_callbacks, refusal

    build = Callbacks.__init__
    if getattr(build, "surgery_guard", False):
        return

    def guarded(self: Callbacks, config: DictConfig | None = None) -> None:
        if config is not None and _safe_in(config):
            try:
                try:
                    callbacks = OmegaConf.to_container(OmegaConf.select(config, "hydra.callbacks"), resolve=True)
                except Exception:  # noqa: BLE001 - what cannot be read cannot be checked
                    raise refusal("hydra.callbacks", OmegaConf.select(config, "hydra.callbacks")) from None
                check_callbacks(callbacks, safe=True)
            except SurgeryError as e:
                print(f"error: {e}", file=sys.stderr)
                sys.exit(EXIT_BAD_INPUT)
        build(self, config)

    guarded.surgery_guard = True  # type: ignore[attr-defined]
    Callbacks.__init__ = guarded  # type: ignore[method-assign]


def main() -> None:
    """Entry point of ``python -m surgery`` and the ``surgery`` console script."""
    if len(sys.argv) == 1:  # no model, no overrides: help without creating a run directory
        print(usage())
        return
    _guard_hydra_callbacks()
    try:
        _task()
    except InternalFailure:
        sys.exit(EXIT_INTERNAL)
    except SystemExit as e:
        # Hydra reports its own composition errors (unknown option, bad override) with exit 1;
        # those are bad input, so they exit 2 like ours.
        if e.code == EXIT_INTERNAL:
            sys.exit(EXIT_BAD_INPUT)
        raise
