"""Handwritten-style digits drawn offline from a few strokes: an MNIST-like input with no data set.

Each digit is a list of strokes (polylines and elliptic arcs) in a unit box, y pointing down.
A seeded random slant, scale and wobble make it look hand-drawn; a soft pen rasterises it
by the distance of every pixel centre to the nearest stroke segment.

>>> render_digit(3).shape
torch.Size([1, 28, 28])
"""

from __future__ import annotations

import math

import numpy as np
import torch

from surgery.core.limits import check_memory

Points = list[tuple[float, float]]

GLYPH_HEIGHT = 18 / 28  # the pen line; with the pen's width the ink is ~20 px tall, as in MNIST
GLYPH_WIDTH = 0.62  # of the glyph's height
MAX_SEGMENTS = 100  # a bound on the pen segments of one digit (the busiest has 78)


def _arc(cx: float, cy: float, rx: float, ry: float, start: float, end: float, n: int = 32) -> Points:
    """Points along an ellipse from angle ``start`` to ``end`` (degrees; 0 = right, 90 = down)."""
    angles = [math.radians(start + (end - start) * i / (n - 1)) for i in range(n)]
    return [(cx + rx * math.cos(a), cy + ry * math.sin(a)) for a in angles]


def _strokes(digit: int) -> list[Points]:
    """The pen strokes of one digit in the unit box: x right in [0, 1], y down in [0, 1]."""
    if digit == 0:
        return [_arc(0.5, 0.5, 0.42, 0.5, -90, 270, 48)]
    if digit == 1:
        return [[(0.3, 0.22), (0.58, 0.0), (0.52, 1.0)]]
    if digit == 2:
        return [_arc(0.5, 0.3, 0.4, 0.3, -165, 25) + [(0.05, 1.0), (0.95, 0.98)]]
    if digit == 3:
        top = _arc(0.48, 0.26, 0.38, 0.26, -155, 95)
        bottom = _arc(0.48, 0.74, 0.44, 0.26, -95, 160)
        return [top + bottom]
    if digit == 4:
        return [[(0.55, 0.0), (0.05, 0.68), (0.95, 0.68)], [(0.72, 0.25), (0.72, 1.0)]]
    if digit == 5:
        return [[(0.9, 0.0), (0.25, 0.0), (0.18, 0.46)] + _arc(0.5, 0.7, 0.42, 0.3, -130, 150)]
    if digit == 6:
        stem = _arc(0.78, 0.72, 0.62, 0.72, -100, -180, 20)
        return [stem + _arc(0.5, 0.72, 0.36, 0.28, 180, 540, 40)]
    if digit == 7:
        return [[(0.05, 0.02), (0.95, 0.0), (0.35, 1.0)]]
    if digit == 8:
        return [_arc(0.5, 0.25, 0.32, 0.25, 90, 450, 40), _arc(0.5, 0.74, 0.4, 0.26, -90, 270, 40)]
    if digit == 9:
        return [_arc(0.5, 0.3, 0.4, 0.3, 0, 360, 40) + [(0.9, 0.3), (0.72, 1.0)]]
    raise ValueError(f"digit must be an int 0..9, got {digit!r}")


def render_digit(digit: int, size: int = 28, thickness: float = 2.4, seed: int = 0) -> torch.Tensor:
    """A ``[1, size, size]`` float image in [0, 1] of ``digit``: white strokes on black, ~20/28 of the height.

    ``thickness`` is the pen width in pixels at ``size=28`` (it scales with ``size``). The same
    ``(digit, size, thickness, seed)`` always gives the same image; another seed, another hand.
    """
    if isinstance(digit, bool) or not isinstance(digit, int) or not 0 <= digit <= 9:
        raise ValueError(f"digit must be an int 0..9, got {digit!r}")
    if size < 8:
        raise ValueError(f"size must be at least 8 pixels, got {size}")
    if not thickness > 0:
        raise ValueError(f"thickness must be a positive pen width in pixels, got {thickness}")
    # every pixel's distance to every segment (about 100), in float64, a few arrays at once
    check_memory(size * size * MAX_SEGMENTS * 2 * 8 * 3, "input.shape", f"drawing a {size}×{size} digit")
    # numpy, not torch: a few hundred tiny array ops, which torch's thread pool only slows down
    rng = np.random.default_rng([int(seed) % 2**64, digit])
    height = GLYPH_HEIGHT * size * rng.uniform(0.92, 1.04)
    width = GLYPH_WIDTH * height * rng.uniform(0.85, 1.1)
    slant = rng.uniform(-0.1, 0.3)  # x shifts by slant × (distance above the glyph's middle)
    angle = math.radians(rng.uniform(-6, 6))
    pen = thickness * size / 28 * rng.uniform(0.85, 1.15)
    rotate = np.array([[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]])

    segments = []
    for points in _strokes(digit):
        p = (np.array(points) - 0.5) * [width, height]
        p[:, 0] -= slant * p[:, 1]
        p = p @ rotate + 0.02 * height * _smooth_noise(len(points), rng)
        segments.append(np.stack([p[:-1], p[1:]], 1))
    ends = np.concatenate(segments)  # [S, 2 ends, 2 coords]

    # centre by mass (stroke length), as MNIST centres its digits
    lengths = np.linalg.norm(ends[:, 1] - ends[:, 0], axis=1)
    centre = (ends.mean(1) * lengths[:, None]).sum(0) / max(lengths.sum(), 1e-9)
    ends = ends - centre + (size - 1) / 2

    distance = _distance_to_segments(size, ends)
    ink = np.clip((pen / 2 + 0.6 - distance) / 1.2, 0, 1)  # a pen with a ~1 px soft edge
    return torch.from_numpy(ink.astype(np.float32)).reshape(1, size, size)


def _smooth_noise(n: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, 2]`` low-frequency noise in [-1, 1]: a hand's slow wobble along a stroke."""
    knots = rng.uniform(-1, 1, (4, 2))
    t = np.linspace(0, 3, n)
    low = np.minimum(np.floor(t).astype(int), 2)
    frac = (t - low)[:, None]
    return knots[low] * (1 - frac) + knots[low + 1] * frac


def _distance_to_segments(size: int, ends: np.ndarray) -> np.ndarray:
    """Distance of every pixel centre to the nearest segment, ``[size * size]``."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    pixels = np.stack([xx.ravel(), yy.ravel()], 1)[:, None, :]  # [P, 1, 2]
    a, ab = ends[None, :, 0], (ends[:, 1] - ends[:, 0])[None]  # [1, S, 2]
    t = np.clip(((pixels - a) * ab).sum(-1) / np.maximum((ab * ab).sum(-1), 1e-12), 0, 1)
    return np.linalg.norm(pixels - (a + t[..., None] * ab), axis=-1).min(axis=1)
