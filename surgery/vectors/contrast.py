"""Contrastive-mean vectors: a site's activation averaged over ``plus`` prompts minus the same over ``minus``.

The site is read by a ``capture`` action through the engine (sites resolve as for any action), on each
side's prompts as one batch padded on the left (``surgery.lm.text.encode_prompts``, as ``input.prompts``),
so position -1 is every prompt's last token and a position ``p >= 0`` counts from each prompt's first.

>>> v = contrast(model, tok, site="@resid_post.1", plus=["I love it"], minus=["I hate it"], pos=-1)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from surgery.core.compiler import compile_plan
from surgery.core.engine import apply_plan
from surgery.core.tensors import computed
from surgery.errors import ConfigError, SurgeryError
from surgery.vectors.config import Side, VectorSpec, parse_vectors

CAPTURE = "vector"  # the capture action's name (never seen outside this file)


@dataclass(frozen=True)
class Vector:
    """A computed vector, with what the report says about it."""

    name: str
    site: str | None
    module: str | None  # the module the site resolved to
    tensor: torch.Tensor
    examples: dict[str, int | None]  # rows averaged per side (None: a file's mean given as is)
    pos: int | str

    def summary(self) -> dict[str, Any]:
        """report.json's entry: name, site, module, shape, norm, examples per side, pos."""
        return {
            "name": self.name,
            "site": self.site,
            "module": self.module,
            "shape": list(self.tensor.shape),
            "norm": float(torch.linalg.vector_norm(self.tensor.double())),
            "examples": self.examples,
            "pos": self.pos,
        }


def contrast(
    model: nn.Module,
    tokenizer: Any,
    site: str,
    plus: Sequence[str],
    minus: Sequence[str] | None = None,
    pos: int | str = -1,
    safe: bool = False,
) -> torch.Tensor:
    """Mean of ``site``'s activation at ``pos`` over the ``plus`` prompts, minus the same over ``minus``.

    >>> v = surgery.vectors.contrast(model, tok, site="@resid_post.1", plus=["w25 w25"], minus=["w60 w60"])
    """
    spec = {"site": site, "plus": {"prompts": list(plus)}, "pos": pos}
    if minus is not None:
        spec["minus"] = {"prompts": list(minus)}
    (parsed,) = parse_vectors({"contrast": spec}, "vectors")
    return compute(model, parsed, tokenizer, safe, "contrast").tensor


def compute_vectors(model: nn.Module, block: Any, tokenizer: Any, safe: bool = False) -> dict[str, Vector]:
    """Every vector of a ``vectors:`` block, in order; each marked as computed by surgery (``safe`` admits it)."""
    return {spec.name: compute(model, spec, tokenizer, safe, f"vectors.{spec.name}") for spec in parse_vectors(block)}


def compute(model: nn.Module, spec: VectorSpec, tokenizer: Any, safe: bool, where: str) -> Vector:
    """One vector: each side's mean (prompts through the model, or a file), plus minus minus."""
    sides = {"plus": spec.plus, **({"minus": spec.minus} if spec.minus is not None else {})}
    site = None
    if any(side.prompts is not None for side in sides.values()):
        site = _site_plan(model, str(spec.site), safe, f"{where}.site")
    means: dict[str, torch.Tensor] = {}
    examples: dict[str, int | None] = {}
    for name, side in sides.items():
        at = f"{where}.{name}"
        if side.prompts is None:
            means[name], examples[name] = _file_mean(side, at)
        else:
            assert site is not None
            rows = site_rows(model, tokenizer, site, side.prompts, spec.pos, at, where)
            means[name], examples[name] = rows.mean(dim=0), int(rows.shape[0])
    vector = means["plus"]
    if "minus" in means:
        if means["minus"].shape != vector.shape:
            raise ConfigError(f"{where}.minus: its mean has shape {list(means['minus'].shape)}, plus's"
                              f" {list(vector.shape)}; they must match")  # fmt: skip
        vector = vector - means["minus"].to(vector.dtype)
    module = site[1] if site is not None else None
    return Vector(spec.name, spec.site, module, computed(vector), examples, spec.pos)


def _file_mean(side: Side, where: str) -> tuple[torch.Tensor, int | None]:
    """A tensor file's ``key``: a ``[d]`` tensor is the side's mean as it is; ``[n, d]`` rows are averaged."""
    from surgery.files.gate import config_path
    from surgery.files.tensors import read_tensors

    tensors = read_tensors(config_path(str(side.file), f"{where}.file"), f"{where}.file")
    key = str(side.key)
    if key not in tensors:
        keys = list(tensors)
        raise ConfigError(f"{where}.key: {key!r} is not in {side.file!r}.{' Keys: ' + ', '.join(keys[:10])}")
    tensor = tensors[key]
    if not tensor.is_floating_point() or tensor.dim() not in (1, 2) or tensor.numel() == 0:
        raise ConfigError(f"{where}.key: {key!r} is a {tensor.dtype} tensor of shape {list(tensor.shape)}; a side is"
                          " a float [d] mean or [n, d] rows to average")  # fmt: skip
    if tensor.dim() == 1:
        return tensor, None
    return tensor.mean(dim=0), int(tensor.shape[0])


def _site_plan(model: nn.Module, site: str, safe: bool, where: str) -> tuple[Any, str]:
    """The capture plan reading ``site`` and the one module it resolved to."""
    node: dict[str, Any] = {"kind": "capture", "select": site, "keep": "last"}
    if not site.startswith("@"):
        node["item"] = 0  # a module's output tuple: its first element (a plain tensor is used as it is)
    try:
        plan = compile_plan(model, {CAPTURE: node}, safe=safe)
    except SurgeryError as e:
        raise ConfigError(f"{where}: {_without_action(str(e))}") from None
    names = [t.name for t in plan.steps[0].targets]
    if len(names) != 1:
        shown = ", ".join(names[:4]) + (" …" if len(names) > 4 else "")
        raise ConfigError(f"{where}: {site!r} resolves to {len(names)} modules ({shown}); a vector is read at one,"
                          " e.g. '@resid_post.3'")  # fmt: skip
    return plan, names[0]


def _without_action(text: str) -> str:
    return text.replace(f"actions.{CAPTURE}.select: ", "").replace(f"actions.{CAPTURE}: ", "")


def site_rows(
    model: nn.Module, tokenizer: Any, site: tuple[Any, str], prompts: Sequence[str], pos: int | str, at: str,
    where: str,
) -> torch.Tensor:  # fmt: skip
    """The site's activation (``site``: its capture plan and module) per prompt at ``pos``, or averaged over the
    prompt's tokens: ``[prompts, ...]``. ``at`` names the side (``vectors.V.plus``), ``where`` the vector."""
    from surgery.lm.text import encode_prompts

    if tokenizer is None:
        raise ConfigError(f"{at}.prompts: needs the run's tokenizer; give a text input (e.g. +input=text) or"
                          " input.tokenizer=DIR")  # fmt: skip
    plan, module = site
    batch = encode_prompts(tokenizer, prompts=list(prompts), where=at)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with apply_plan(model, plan) as s, torch.no_grad():
            model(**batch.to(device).kwargs())
            record = s.captures[CAPTURE][module]
    except SurgeryError:
        raise
    except Exception as e:  # noqa: BLE001 - the model's own failure on these prompts
        raise ConfigError(f"{at}.prompts: the model fails on them: {type(e).__name__}: {e}") from None
    acts = record.output if record.output is not None else record.input
    if isinstance(acts, (tuple, list)) and acts:
        acts = acts[0]
    lengths = batch.lengths
    if not isinstance(acts, torch.Tensor) or acts.dim() < 2 or tuple(acts.shape[:2]) != batch.input_ids.shape:
        shape = list(acts.shape) if isinstance(acts, torch.Tensor) else type(acts).__name__
        raise ConfigError(f"{where}.site: {module!r} gives {shape}, not [prompts, tokens, ...]; a vector is read"
                          " per token")  # fmt: skip
    return at_positions(acts.detach(), lengths, pos, f"{where}.pos", list(prompts))


def at_positions(
    acts: torch.Tensor, lengths: Sequence[int], pos: int | str, where: str, prompts: Sequence[str] = ()
) -> torch.Tensor:
    """Each left-padded row's activation at ``pos`` (or the mean over its real tokens): ``[rows, ...]``."""
    tokens = acts.shape[1]
    rows = []
    for i, length in enumerate(lengths):
        first = tokens - length  # left padding: the prompt's tokens are the last ``length``
        if pos == "mean":
            rows.append(acts[i, first:].mean(dim=0))
            continue
        assert isinstance(pos, int)
        if not -length <= pos < length:
            text = f" {prompts[i]!r}" if i < len(prompts) else ""
            raise ConfigError(f"{where}: {pos} is outside the prompt{text} of {length} token(s) (positions"
                              f" {-length} to {length - 1})")  # fmt: skip
        rows.append(acts[i, tokens + pos if pos < 0 else first + pos])
    return torch.stack(rows)


def summaries(vectors: Mapping[str, Vector]) -> list[dict[str, Any]]:
    """report.json's ``vectors`` list."""
    return [v.summary() for v in vectors.values()]
