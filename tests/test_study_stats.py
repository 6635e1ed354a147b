"""Study statistics against the same numbers written by hand: normalization, NaN-aware means, the bootstrap."""

from __future__ import annotations

import pytest
import torch

from surgery.errors import ConfigError
from surgery.study.baselines import normalized
from surgery.study.stats import bootstrap, mean


def test_normalized_is_zero_at_the_unmodified_value_one_at_the_source_nan_without_scale() -> None:
    unmodified, source = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 0.0, 3.0])
    got, flat = normalized(torch.tensor([[1.0, 0.0, 5.0], [3.0, 1.0, 3.0]]), unmodified, source, "example", "m")
    assert flat == 1
    assert torch.equal(got[:, :2], torch.tensor([[0.0, 1.0], [1.0, 0.5]]))
    assert got[:, 2].isnan().all()
    assert torch.equal(mean(got), torch.tensor([0.5, 0.75]))


def test_bootstrap_equals_a_hand_loop_with_the_same_seeded_draws() -> None:
    values = torch.randn(2, 3, 17, dtype=torch.float64)
    low, high = bootstrap(values, 0.9, n_boot=200, seed=7)
    g = torch.Generator().manual_seed(7)
    draws = torch.randint(17, (200, 17), generator=g)
    for i in range(2):
        for j in range(3):
            means = torch.stack([values[i, j, d].mean() for d in draws])
            want = torch.quantile(means, torch.tensor([0.05, 0.95], dtype=torch.float64))
            assert torch.allclose(torch.stack([low[i, j], high[i, j]]), want, rtol=1e-12, atol=1e-15)
    again = bootstrap(values, 0.9, n_boot=200, seed=7)
    assert torch.equal(again[0], low) and torch.equal(again[1], high)
    assert (low <= mean(values)).all() and (mean(values) <= high).all()


@pytest.mark.parametrize(("ci", "n_boot", "key"), [(1.5, 10, "study.ci"), (0.9, 0, "study.n_boot"), (0, 5, "study.ci")])
def test_bad_levels_and_resample_counts_are_refused(ci: float, n_boot: int, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: "):
        bootstrap(torch.zeros(3), ci, n_boot)
