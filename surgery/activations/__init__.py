"""Read an activation dataset (``mode=harvest``'s ``activations/``) as a ``torch.utils.data.Dataset``.

Example::

    import surgery.activations
    data = surgery.activations.open("outputs/.../activations")          # one item per kept token
    data[0]  # {"transformer.h.0": tensor [d], ..., "token": tensor(id)}
    rows = surgery.activations.open("outputs/.../activations", by="row")
    rows[0]  # {"input_ids": [context], "transformer.h.0": [context, d], ...}
"""

from __future__ import annotations

from surgery.activations.dataset import ActivationDataset, open

__all__ = ["ActivationDataset", "open"]
