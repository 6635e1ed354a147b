"""A study's statistics over examples: the NaN-aware mean and seeded bootstrap intervals (normalizing: baselines.py).

Values are ``[*grid sizes, examples]`` tensors in float64; every statistic reduces the last dim.
"""

from __future__ import annotations

import torch

from surgery.errors import ConfigError

N_BOOT = 1000


def mean(values: torch.Tensor) -> torch.Tensor:
    """The mean over examples, leaving out NaN (examples a normalization could not scale)."""
    return values.nanmean(dim=-1)


def bootstrap(
    values: torch.Tensor, ci: float, n_boot: int = N_BOOT, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The percentile bootstrap interval of the mean over examples, for every cell at once.

    Every cell is resampled with the same draws of examples (seeded by ``seed``), so intervals of
    two cells compare like with like. Returns ``(low, high)`` shaped like the grid.
    """
    if not 0 < ci < 1:
        raise ConfigError(f"study.ci: a level between 0 and 1, e.g. 0.95; got {ci!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or not 1 <= n_boot <= 100_000:
        raise ConfigError(f"study.n_boot: a number of resamples from 1 to 100000; got {n_boot!r}")
    examples = values.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(examples, (n_boot, examples), generator=generator)
    flat = values.reshape(-1, examples).cpu()
    means = torch.stack([flat[:, draw].nanmean(dim=-1) for draw in draws], dim=-1)  # [cells, n_boot]
    tail = (1 - ci) / 2
    levels = torch.tensor([tail, 1 - tail], dtype=means.dtype)
    low, high = torch.nanquantile(means, levels, dim=-1)
    return low.reshape(values.shape[:-1]), high.reshape(values.shape[:-1])
