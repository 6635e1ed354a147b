"""Steering vectors as config (SPEC §20): contrastive means read at a site, added by actions (docs/vectors.md).

Sits on the engine: a vector is read with a ``capture`` action, and ``vector: NAME`` becomes the engine's
``op: add, value: TENSOR`` (``scale`` multiplies it) before planning, so the engine knows nothing of vectors.

>>> v = surgery.vectors.contrast(model, tok, site="@resid_post.1", plus=["I love it"], minus=["I hate it"])
>>> steer = {"kind": "modify_output", "select": "@resid_post.1", "vector": "love", "scale": 4.0}
>>> with surgery.apply(model, surgery.vectors.steering({"steer": steer}, {"love": v})):
...     model.generate(**batch, max_new_tokens=20)
"""

from __future__ import annotations

from surgery.vectors.config import Side, VectorSpec, parse_vectors
from surgery.vectors.contrast import Vector, at_positions, compute_vectors, contrast, summaries
from surgery.vectors.steer import named_as_vectors, steering

__all__ = [
    "Side", "Vector", "VectorSpec", "at_positions", "compute_vectors", "contrast", "named_as_vectors",
    "parse_vectors", "steering", "summaries",
]  # fmt: skip
