"""Splices: sparse autoencoders and transcoders put into a model (``kind: splice``), their features and metrics.

Importing this package registers the ``splice`` kind into ``surgery.core.steps.KINDS`` (``import surgery`` does it).
See docs/splices.md.
"""

from surgery.splice import kind, save  # noqa: F401 - registers kind: splice and save_added format saelens
