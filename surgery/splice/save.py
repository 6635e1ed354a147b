"""``save_added`` format ``saelens``: each splice's SAE, as it is now (trained with ``train: true`` or as read), written
the way SAELens 6's ``SAE.save_model`` writes it, so ``sae_lens.SAE.load_from_disk`` reads it to the same encode and
decode, and ``kind: splice`` reads it back.

A directory holds ``cfg.json`` (``architecture``, ``d_in``, ``d_sae``, ``dtype``, ``device``, ``apply_b_dec_to_input``,
``normalize_activations``, ``reshape_activations``, ``metadata``; ``k`` and ``rescale_acts_by_decoder_norm`` for topk;
``d_out`` for transcoders) and ``sae_weights.safetensors`` (``W_enc``, ``b_enc``, ``W_dec``, ``b_dec``, and
``threshold`` / ``W_skip`` where the architecture has them). One spliced module is written in ``DIR``; several, each in
``DIR/MODULE`` (read back with ``module: {path: DIR/{name}}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from surgery.core.steps import SAVE_FORMATS
from surgery.errors import ConfigError
from surgery.files.write import make_dir, write_json, write_tensors
from surgery.splice.formats import ARCHITECTURES, CFG_FILE, WEIGHTS_FILE, SpliceWeights

KEY = "save_added.format"
ARCHITECTURE_OF = {spec: name for name, spec in ARCHITECTURES.items()}  # (activation, transcoder, skip) -> name


def saelens_config(weights: SpliceWeights, module: str, where: str) -> dict[str, Any]:
    """``cfg.json`` as SAELens 6 writes it for these weights (a splice SAELens has no architecture for is refused)."""
    spec = (weights.activation, weights.transcoder, weights.W_skip is not None)
    name = ARCHITECTURE_OF.get(spec)
    if name is None:
        raise ConfigError(
            f"{where}: the splice on {module!r} ({weights.activation}, {'transcoder' if spec[1] else 'SAE'}"
            f"{', skip connection' if spec[2] else ''}) has no SAELens architecture; SAELens has"
            f" {', '.join(ARCHITECTURES)}"
        )
    config: dict[str, Any] = {
        "d_in": weights.d_in, "d_sae": weights.d_sae, "dtype": str(weights.W_enc.dtype).removeprefix("torch."),
        "device": "cpu", "apply_b_dec_to_input": weights.apply_b_dec_to_input,
        "normalize_activations": weights.normalize, "reshape_activations": "none",
        "metadata": {"surgery_module": module},
    }  # fmt: skip
    if weights.activation == "topk":
        config.update(k=weights.k, rescale_acts_by_decoder_norm=weights.rescale_acts_by_decoder_norm)
    if weights.transcoder:
        config["d_out"] = weights.d_out
    config["architecture"] = name
    return config


def saelens_tensors(weights: SpliceWeights) -> dict[str, torch.Tensor]:
    """``sae_weights.safetensors``'s tensors: SAELens's names, detached (a trained splice's current values)."""
    names = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")
    return {n: getattr(weights, n).detach() for n in names if getattr(weights, n) is not None}


@SAVE_FORMATS.register("saelens")
def save_saelens(surgery: Any, path: Path) -> None:
    """Write every splice of the surgery as a SAELens SAE directory (``DIR``, or ``DIR/MODULE`` for several)."""
    found: list[tuple[str, SpliceWeights]] = []
    for step in surgery.plan.steps:
        if step.enabled and step.kind == "splice":
            found += [(t.name, step.live[t.name]) for t in step.targets if t.name in step.live]
    if not found:
        raise ConfigError(f"{KEY}: saelens writes kind: splice actions, and this surgery has none")
    names = [name for name, _ in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{KEY}: {twice[0]!r} is spliced twice; saelens writes one SAE per module (DIR/MODULE)")
    written = [(name, saelens_config(w, name, KEY), saelens_tensors(w)) for name, w in found]  # all checked first
    for name, config, tensors in written:
        directory = make_dir(path if len(written) == 1 else path / name, "save_added.path")
        write_tensors(directory / WEIGHTS_FILE, tensors, "save_added.path")
        write_json(directory / CFG_FILE, config, "save_added.path")
