"""Where the shipped configs live: ``surgery/conf`` in a wheel, ``../conf`` in a checkout."""

from __future__ import annotations

from functools import cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # surgery/


@cache
def config_dir() -> Path:
    """The absolute config directory, for Hydra and for loading actions by name (where the package is: it
    does not move while it runs)."""
    installed = PACKAGE_DIR / "conf"
    return installed if installed.is_dir() else PACKAGE_DIR.parent / "conf"


def group_options(group: str) -> list[str]:
    """The option names of a config group (file stems of ``conf/GROUP/*.yaml``)."""
    from surgery.files.gate import listing

    return sorted(name.removesuffix(".yaml") for name in listing(config_dir() / group, group) if name.endswith(".yaml"))
