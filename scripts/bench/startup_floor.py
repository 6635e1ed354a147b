"""The Hydra floor of a CLI run: ``import torch``, then Hydra composing surgery's config once with the given overrides.

What any Hydra command line over this config pays before doing anything (no checks, no job):

    python -m scripts.bench.startup_floor +model=cnn +actions=linearize
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch  # noqa: F401 - the floor includes it: every job imports torch first
from hydra import compose, initialize_config_dir

CONF = Path(__file__).resolve().parents[2] / "conf"  # the checkout's; importing surgery to find it is not the floor

if __name__ == "__main__":
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        compose("config", overrides=sys.argv[1:], return_hydra_config=True)
