"""The offline handwritten digit: MNIST-like, deterministic, and each digit tells itself apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from surgery.app.digit import render_digit
from surgery.app.inputs import make_inputs


@pytest.mark.parametrize("digit", range(10))
def test_shape_range_and_ink(digit: int) -> None:
    image = render_digit(digit)
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert image.min() >= 0 and image.max() <= 1 and image.max() > 0.99  # full-strength strokes on black
    ink = (image > 0.5).float().mean().item()
    assert 0.05 < ink < 0.35, ink  # a drawn digit, neither a speck nor a blob


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_centred_and_about_20_of_28_pixels_tall(seed: int) -> None:
    for digit in range(10):
        image = render_digit(digit, seed=seed)[0]
        rows = torch.nonzero((image > 0.5).any(1)).flatten()
        assert 17 <= rows[-1] - rows[0] + 1 <= 23, (digit, rows)
        ys, xs = torch.meshgrid(torch.arange(28.0), torch.arange(28.0), indexing="ij")
        centre = torch.stack([(ys * image).sum(), (xs * image).sum()]) / image.sum()
        assert torch.allclose(centre, torch.tensor([13.5, 13.5]), atol=1.5), (digit, centre)


def test_the_same_seed_gives_the_same_image_and_another_seed_another_hand() -> None:
    assert torch.equal(render_digit(3, seed=5), render_digit(3, seed=5))
    assert not torch.equal(render_digit(3, seed=5), render_digit(3, seed=6))
    assert torch.equal(render_digit(3, seed=-4), render_digit(3, seed=-4))


def test_digits_differ_from_each_other() -> None:
    images = [render_digit(d) for d in range(10)]
    for i in range(10):
        for j in range(i + 1, 10):
            assert (images[i] - images[j]).abs().mean() > 0.05, (i, j)


def test_other_hands_are_nearest_to_their_own_digit() -> None:
    """A stand-in for "recognisable": a new hand's digit is closest to that digit's average shape."""

    def blur(x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x, 5, stride=1, padding=2).flatten()

    means = torch.stack(
        [torch.stack([blur(render_digit(d, seed=s)) for s in range(1000, 1010)]).mean(0) for d in range(10)]
    )
    right = sum(
        (means - blur(render_digit(digit, seed=seed))).pow(2).sum(1).argmin().item() == digit
        for seed in range(10)
        for digit in range(10)
    )
    assert right >= 98, right  # 100 images; a narrow 8 can fall nearer the 3s in pixel space


def test_other_sizes_and_pens() -> None:
    assert render_digit(8, size=64).shape == (1, 64, 64)
    thin, thick = render_digit(1, thickness=1.5), render_digit(1, thickness=4.0)
    assert thick.sum() > thin.sum()


@pytest.mark.parametrize("bad", [10, -1, 3.0, True, "3"])
def test_a_bad_digit_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="digit must be an int 0..9"):
        render_digit(bad)  # type: ignore[arg-type]


def test_a_bad_size_or_pen_is_refused() -> None:
    with pytest.raises(ValueError, match="size must be at least 8"):
        render_digit(3, size=4)
    with pytest.raises(ValueError, match="thickness must be a positive"):
        render_digit(3, thickness=0)


def test_the_digit_input_kind_repeats_the_image_over_the_batch() -> None:
    spec = {"kind": "digit", "digit": 3, "shape": [2, 1, 28, 28]}
    (x,) = make_inputs(spec, 0, torch.float32, torch.device("cpu"))
    assert x.shape == (2, 1, 28, 28)
    assert torch.equal(x[0], render_digit(3, size=28, seed=0)) and torch.equal(x[1], x[0])
