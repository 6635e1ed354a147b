"""Pictures of captured tensors: a grid of feature maps for spatial tensors, else a histogram.

matplotlib is imported inside the functions (a run without ``plot: true`` never loads it), and
only its object-oriented ``Figure`` is used: no pyplot, no global backend switch, no window.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from pathlib import Path
from typing import Any

import torch

from surgery.core.records import Record
from surgery.files.write import write_figure

MAX_CHANNELS = 16  # feature maps shown per figure
MAX_NAME = 120  # characters in a plot's file name, well under the usual 255-byte limit
HISTOGRAM_SAMPLE = 1_000_000  # values binned at most (evenly strided); mean/std use them all
DPI = 100
MAX_SIDE = 256  # feature maps larger than this are averaged down before drawing
WHATS = ("input", "output", "grad_input", "grad_output", "grad")


def plot_tensor(
    tensor: torch.Tensor, title: str, path: Path, gradient: bool = False, tokens: list[str] | None = None
) -> Path:
    """Write a PNG of ``tensor`` to ``path`` (atomically) and return ``path``.

    A spatial tensor (``[C, H, W]``, or ``[N, C, H, W]`` of which the first example is shown)
    becomes a grid of up to 16 channel feature maps, each on its own colour scale with a colour
    bar; a ``gradient`` instead on one shared scale centred on zero (a diverging map, zero white)
    with one labelled colour bar. Anything else (1-D, 2-D, or 1×1 maps) becomes a histogram of
    its values with mean and std.

    ``tokens`` label both axes of square maps as long as the prompt: an attention pattern
    ``[batch, heads, query, key]`` becomes one map per head, queries down and keys across.

    Example: ``plot_tensor(torch.randn(2, 8, 7, 7), "capture · block3 · output", Path("block3.png"))``.
    """
    fig = figure_of(tensor, title, gradient, tokens)
    try:
        write_figure(path, fig, dpi=DPI)
    finally:
        fig.clear()  # a Figure outside pyplot is freed with its last reference; drop the artists now
    return path


def figure_of(tensor: torch.Tensor, title: str, gradient: bool = False, tokens: list[str] | None = None) -> Any:
    """The matplotlib ``Figure`` that :func:`plot_tensor` saves."""
    from matplotlib.figure import Figure

    t = tensor.detach().to("cpu")
    t = (t.real if t.is_complex() else t).float()
    while t.dim() > 3 and t.shape[0] > 0:  # [N, C, H, W] → the first example
        t = t[0]
    spatial = t.dim() == 3 and t.shape[-1] * t.shape[-2] > 1 and t.numel() > 0
    fig = Figure()
    square = spatial and tokens is not None and t.shape[-1] == t.shape[-2] == len(tokens) <= MAX_SIDE
    if spatial:
        _feature_maps(fig, t, tensor.shape, title, gradient, tokens if square else None)
    else:
        _histogram(fig, t, tensor.shape, title)
    return fig


def _feature_maps(
    fig: Any, t: torch.Tensor, shape: torch.Size, title: str, gradient: bool, tokens: list[str] | None = None
) -> None:
    channels = min(t.shape[0], MAX_CHANNELS)
    maps = t[:channels]
    if max(maps.shape[-2:]) > MAX_SIDE:  # a figure cell is ~180 px wide: average big maps down first
        scale = MAX_SIDE / max(maps.shape[-2:])
        size = (max(1, round(maps.shape[-2] * scale)), max(1, round(maps.shape[-1] * scale)))
        maps = torch.nn.functional.adaptive_avg_pool2d(maps.nan_to_num(), size)
    cols = math.ceil(math.sqrt(channels))
    rows = math.ceil(channels / cols)
    width, height = (1.8 if gradient else 2.2) * cols + (1.2 if gradient else 0.4), 1.9 * rows + 0.7
    fig.set_size_inches(width, height)
    shown = f"channels 0–{channels - 1} of {t.shape[0]}" if channels < t.shape[0] else f"{channels} channels"
    fig.suptitle(f"{title}\n{list(shape)} · {shown}", fontsize=10, y=1 - 0.1 / height, va="top")
    # a fixed layout: matplotlib's constrained layout costs more than the drawing for 16 small axes
    right = 1 - (1.0 if gradient else 0.2) / width  # a gradient's one colour bar goes in the margin on the right
    margin = 0.5 if tokens else 0.1  # room for token labels left of and below the maps
    fig.subplots_adjust(left=(0.1 + margin) / width, right=right, bottom=margin / height, top=1 - 0.7 / height)
    fig.subplots_adjust(
        wspace=0.1 if gradient else 0.45 + margin, hspace=0.25 + margin
    )  # room for activations' colour bars
    # A gradient's sign is the point: zero white, both signs on one scale so channels can be compared.
    finite_all = maps[torch.isfinite(maps)]
    bound = max(finite_all.abs().max().item(), 1e-12) if gradient and finite_all.numel() else 1.0
    image = None
    for c, ax in enumerate(fig.subplots(rows, cols, squeeze=False).flat):
        ax.set_xticks(range(len(tokens)) if tokens and c < channels else [])
        ax.set_yticks(range(len(tokens)) if tokens and c < channels else [])
        if tokens and c < channels:  # a pattern: keys across, queries down, each labelled by its token
            ax.set_xticklabels(tokens, fontsize=4, rotation=90)
            ax.set_yticklabels(tokens, fontsize=4)
        if c >= channels:
            ax.set_axis_off()
            continue
        if gradient:
            image = ax.imshow(maps[c].numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound, interpolation="nearest")
        else:  # an activation on its own colour scale, read off its own colour bar
            own = ax.imshow(maps[c].numpy(), cmap="viridis", interpolation="nearest")
            fig.colorbar(own, ax=ax, fraction=0.046, pad=0.03).ax.tick_params(labelsize=5)
        finite = t[c][torch.isfinite(t[c])]  # the range of the values themselves, not of the drawing
        scale_text = f" [{finite.min().item():.2g}, {finite.max().item():.2g}]" if finite.numel() else ""
        ax.set_title(f"{'head ' if tokens else 'c'}{c}{scale_text}", fontsize=7, pad=2)
    if image is not None:
        bar = fig.colorbar(image, cax=fig.add_axes((1 - 0.8 / width, 0.15, 0.15 / width, 0.6)))
        bar.set_label("gradient (one scale for all channels; 0 is white)", fontsize=7)
        bar.ax.tick_params(labelsize=6)


def _histogram(fig: Any, t: torch.Tensor, shape: torch.Size, title: str) -> None:
    fig.set_size_inches(6.4, 4.2)
    fig.suptitle(f"{title}\n{list(shape)}", fontsize=10, y=1 - 0.1 / 4.2, va="top")
    fig.subplots_adjust(left=0.12, right=0.96, bottom=0.12, top=1 - 0.7 / 4.2)
    ax = fig.subplots()
    values = t.reshape(-1).double()
    finite = values[torch.isfinite(values)]
    if finite.numel() == 0:
        ax.text(
            0.5,
            0.5,
            "no finite values" if values.numel() else "empty tensor",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_axis_off()
        return
    mean, std = finite.mean().item(), finite.std().item() if finite.numel() > 1 else 0.0
    sample = finite[:: max(1, finite.numel() // HISTOGRAM_SAMPLE)]
    label = f"mean {mean:.4g}\nstd {std:.4g}\nn {finite.numel():,}"
    if finite.numel() < values.numel():
        label += f"\n{values.numel() - finite.numel():,} non-finite left out"
    ax.hist(sample.numpy(), bins=min(50, max(1, sample.numel())), color="tab:blue", label=label)
    ax.set_xlabel("value")
    ax.set_ylabel("count")
    ax.legend(fontsize=8)


def safe_file_name(*parts: str) -> str:
    """A portable file name from parts such as action, module and what: ``[A-Za-z0-9._-]`` joined by ``__``.

    Other characters become ``_`` (accents are dropped first), a leading dot is replaced,
    and a name longer than 120 characters is cut and given a hash of the whole.

    >>> safe_file_name("cap", "<root>", "output")
    'cap___root___output'
    """
    cleaned = []
    for part in parts:
        text = unicodedata.normalize("NFKD", str(part))
        text = "".join(ch for ch in text if not unicodedata.combining(ch))
        cleaned.append(re.sub(r"[^A-Za-z0-9._-]", "_", text))
    name = "__".join(cleaned)
    name = re.sub(r"^\.", "_", name) or "_"
    if len(name) > MAX_NAME:
        digest = hashlib.sha256("\x00".join(map(str, parts)).encode()).hexdigest()[:12]
        name = f"{name[: MAX_NAME - 13]}-{digest}"
    return name


def plot_records(
    captures: dict[str, dict[str, Record]], actions: set[str], out_dir: Path, tokens: list[str] | None = None
) -> list[Path]:
    """Plot the last call's tensors of every record of the ``plot: true`` actions into ``out_dir/plots``.

    ``tokens`` (the first prompt's) label the axes of attention patterns (``@attn_pattern``).

    One PNG per tensor: ``input.0``, ``output``, ``grad_input.0``, ``grad_output.0``, ``grad``
    (the first tensor of a tuple or dict), titled ``ACTION · MODULE · WHAT``.
    """
    paths: list[Path] = []
    used: set[str] = set()
    for action, records in captures.items():
        if action not in actions:
            continue
        for module, record in records.items():
            if not record.calls:
                continue
            call = record.calls[-1]
            for field in WHATS:
                found = _first_tensor(field, getattr(call, field))
                if found is None:
                    continue
                what, tensor = found
                name = safe_file_name(action, module, what)
                if name in used:  # two module names that clean to the same text
                    name += "-" + hashlib.sha256(f"{action}\x00{module}\x00{what}".encode()).hexdigest()[:8]
                used.add(name)
                title = f"{action} · {module} · {what}"
                gradient = what.startswith("grad")
                paths.append(plot_tensor(tensor, title, out_dir / "plots" / f"{name}.png", gradient, tokens))
    return paths


def _first_tensor(field: str, value: Any) -> tuple[str, torch.Tensor] | None:
    """``(what, tensor)`` for a tensor, or the first tensor in a tuple/list/dict named ``field.i``/``field.KEY``."""
    if isinstance(value, torch.Tensor):
        return field, value
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, (tuple, list)):
        items = enumerate(value)
    else:
        return None
    for key, v in items:
        if isinstance(v, torch.Tensor):
            return f"{field}.{key}", v
    return None
