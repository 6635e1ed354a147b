"""Reading a sparse autoencoder or transcoder from disk: SAELens's saved directory, or a plain .safetensors file.

A SAELens directory holds ``cfg.json`` and ``sae_weights.safetensors`` (what ``SAE.save_model`` writes). The
config is read the way SAELens's ``load_from_disk`` reads it: ``architecture`` (``standard`` when absent),
``apply_b_dec_to_input`` (true when absent), ``normalize_activations`` (a bool means none / expected_average_only_in),
``k`` for topk (``activation_fn_kwargs.k`` in configs written before SAELens 6), the weights cast to ``dtype``,
``log_threshold`` read as ``threshold = exp(log_threshold)``. A plain file holds ``W_enc [d_in, d_sae]``, ``b_enc``,
``W_dec [d_sae, d_out]``, ``b_dec`` (+ ``threshold``), and the action says its ``activation``.
Everything is checked here, before the model is touched; each message names the file and the tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from surgery.core.plan_cache import depends_on_more
from surgery.errors import ConfigError
from surgery.files import gate
from surgery.files.paths import refuse_url
from surgery.files.tensors import read_tensors

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")
# SAELens architecture -> (activation, transcoder, skip connection)
ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "standard": ("relu", False, False),
    "jumprelu": ("jumprelu", False, False),
    "topk": ("topk", False, False),
    "transcoder": ("relu", True, False),
    "skip_transcoder": ("relu", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False),
    "jumprelu_skip_transcoder": ("jumprelu", True, True),
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class SpliceWeights:
    """A loaded sparse autoencoder (or transcoder): its tensors and how it encodes and decodes."""

    source: str  # the path as given, for messages
    W_enc: torch.Tensor  # noqa: N815 - SAELens's names  [d_in, d_sae]
    b_enc: torch.Tensor  # noqa: N815  [d_sae]
    W_dec: torch.Tensor  # noqa: N815  [d_sae, d_out]
    b_dec: torch.Tensor  # noqa: N815  [d_out]
    threshold: torch.Tensor | None = None  # jumprelu  [d_sae]
    W_skip: torch.Tensor | None = None  # noqa: N815 - skip transcoders  [d_out, d_in]
    activation: str = "relu"  # relu | topk | jumprelu
    k: int | None = None  # topk
    rescale_acts_by_decoder_norm: bool = False  # topk: rank features by activation x decoder norm
    apply_b_dec_to_input: bool = True
    normalize: str = "none"  # normalize_activations, as SAELens runs it
    transcoder: bool = False  # decodes to another site: no b_dec on the input, no output de-normalization
    jump_relu_of_threshold: bool = True  # JumpReLU SAEs compare against relu(threshold); transcoders the raw one

    @property
    def d_in(self) -> int:
        """Width the encoder reads."""
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        """Number of features."""
        return int(self.W_enc.shape[1])

    @property
    def d_out(self) -> int:
        """Width the decoder writes."""
        return int(self.W_dec.shape[1])

    def to(self, device: torch.device) -> SpliceWeights:
        """The same weights on ``device`` (itself when they are there already)."""
        if self.W_enc.device == device:
            return self
        moved: dict[str, Any] = {}
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip"):
            tensor = getattr(self, name)
            moved[name] = tensor.to(device) if tensor is not None else None
        return replace(self, **moved)


def resolve(path: str, where: str) -> Path:
    """A local path (never a URL) that exists."""
    refuse_url(path, where, "the splice")
    found = gate.config_path(Path(path).expanduser(), where)
    if not found.exists():
        raise ConfigError(
            f"{where}: {path!r} does not exist; give a SAELens directory (cfg.json + {WEIGHTS_FILE}) or a"
            " .safetensors file with W_enc, b_enc, W_dec, b_dec"
        )
    return found


_CACHE: dict[tuple[Any, ...], SpliceWeights] = {}
_CACHE_SIZE = 64  # a study plans every cell again: the same file is read once while it is unchanged


def load(
    path: str, where: str, activation: str | None, k: int | None, apply_b_dec: bool | None, transcoding: bool = False
) -> SpliceWeights:
    """The SAE at ``path`` (a SAELens directory or a .safetensors file), checked; read once while unchanged.

    ``transcoding``: the action reads one side and writes the other (``read: input, at: output``), so a plain
    ``.safetensors`` file is a transcoder: its ``b_dec`` lives in the output space and is never subtracted from
    the input (as SAELens's transcoders and SAELens directories here), unless ``apply_b_dec_to_input`` says so.
    """
    depends_on_more(where)  # the file may change between plans
    found = resolve(path, where)
    files = [found / CFG_FILE, found / WEIGHTS_FILE] if found.is_dir() else [found]
    stamp = tuple((str(os.path.realpath(f)), f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.exists())
    key = (stamp, activation, k, apply_b_dec, transcoding)
    cached = _CACHE.get(key)
    if cached is not None:
        return replace(cached, source=path)
    weights = (
        _load_dir(found, path, where, activation, k, apply_b_dec)
        if found.is_dir()
        else _load_file(found, path, where, activation, k, apply_b_dec, transcoding)
    )
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = weights
    return weights


def _load_dir(
    found: Path, path: str, where: str, activation: str | None, k: int | None, apply_b_dec: bool | None
) -> SpliceWeights:
    missing = [name for name in (CFG_FILE, WEIGHTS_FILE) if not os.path.lexists(found / name)]
    if missing:
        raise ConfigError(
            f"{where}: the directory {path!r} has no {' or '.join(missing)}; a SAELens SAE directory holds {CFG_FILE}"
            f" and {WEIGHTS_FILE} (what SAE.save_model writes)"
        )
    cfg_file = gate.member(found, CFG_FILE, where, "the SAE's config")  # a link out of the directory is refused
    weights_file = gate.member(found, WEIGHTS_FILE, where, "the SAE's weights")
    cfg = _checked_cfg(gate.read_json_object(cfg_file, where), cfg_file, where)
    architecture = cfg.get("architecture") or "standard"
    old_activation = cfg.get("activation_fn", cfg.get("activation_fn_str"))
    if architecture == "standard" and old_activation == "topk":  # written before SAELens 6: topk was an activation
        architecture = "topk"
    if architecture not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: {str(cfg_file)!r} has architecture {_short(architecture)}, which splice does not run; it runs"
            f" {', '.join(ARCHITECTURES)}"
        )
    kind, transcoder, skip = ARCHITECTURES[architecture]
    if activation is not None and activation != kind:
        raise ConfigError(
            f"{where.rsplit('.', 2)[0]}.activation: {activation!r} contradicts {str(cfg_file)!r}, whose architecture"
            f" {architecture!r} uses {kind}; drop activation (cfg.json says it)"
        )
    normalize = cfg.get("normalize_activations", "none")
    normalize = {True: "expected_average_only_in", False: "none", None: "none"}.get(normalize, normalize)
    if normalize not in NORMALIZATIONS:
        raise ConfigError(
            f"{where}: {str(cfg_file)!r} has normalize_activations {_short(normalize)}; SAELens defines"
            f" {', '.join(NORMALIZATIONS)}"
        )
    if cfg.get("reshape_activations", "none") not in ("none", None):
        raise ConfigError(
            f"{where}: {str(cfg_file)!r} reshapes activations ({_short(cfg['reshape_activations'])}, per-head hook_z);"
            " splice reads a [..., d_in] tensor: select a module whose output is already flat"
        )
    if cfg.get("finetuning_scaling_factor"):
        raise ConfigError(f"{where}: {str(cfg_file)!r} uses finetuning_scaling_factor, which splice does not run")
    dtype_name = str(cfg.get("dtype", "float32")).removeprefix("torch.")
    if dtype_name not in DTYPES:
        raise ConfigError(f"{where}: {str(cfg_file)!r} has dtype {_short(dtype_name)}; one of {', '.join(DTYPES)}")
    tensors = read_tensors(weights_file, where)
    if "log_threshold" in tensors and "threshold" not in tensors:  # older JumpReLU checkpoints, as SAELens reads them
        tensors["threshold"] = torch.exp(tensors.pop("log_threshold"))
    scale = tensors.pop("scaling_factor", None)
    if scale is not None and not bool(torch.all(scale == 1)):
        raise ConfigError(
            f"{where}: {str(weights_file)!r} holds a scaling_factor other than 1, which splice does not run"
        )
    tensors = {name: t.to(DTYPES[dtype_name]) for name, t in tensors.items()}
    if kind == "topk":
        k = k if k is not None else cfg.get("k")
        if k is None:
            k = 100  # SAELens's TopKSAEConfig default
    elif k is not None:
        raise ConfigError(f"{where.rsplit('.', 2)[0]}.k: only a topk SAE takes k; {path!r} is {architecture!r}")
    b_dec_in = cfg.get("apply_b_dec_to_input", True) if apply_b_dec is None else apply_b_dec
    if transcoder and b_dec_in:
        if apply_b_dec:
            raise ConfigError(
                f"{where.rsplit('.', 2)[0]}.apply_b_dec_to_input: a transcoder's b_dec has the output's width"
            )
        b_dec_in = False  # SAELens refuses it for transcoders; its default true does not apply
    weights = _build(
        tensors, str(weights_file), path, where, kind, int(k) if k is not None else None, b_dec_in, transcoder, skip
    )
    weights = replace(
        weights, normalize=normalize, rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
        jump_relu_of_threshold=not transcoder,
    )  # fmt: skip
    for key, width in (("d_in", weights.d_in), ("d_sae", weights.d_sae), ("d_out", weights.d_out)):
        said = cfg.get(key)
        if said is not None and said != width and not (key == "d_out" and not transcoder):
            raise ConfigError(
                f"{where}: {str(cfg_file)!r} says {key}={said}, but its weights have {key}={width}"
                f" (W_enc {list(weights.W_enc.shape)}, W_dec {list(weights.W_dec.shape)})"
            )
    return weights


# cfg.json keys splice reads -> the JSON types each may hold (None: absent or null)
CFG_TYPES: dict[str, tuple[type, ...]] = {
    "architecture": (str,), "activation_fn": (str,), "activation_fn_str": (str,), "activation_fn_kwargs": (dict,),
    "normalize_activations": (str, bool), "reshape_activations": (str,),
    "finetuning_scaling_factor": (bool, int, float),
    "dtype": (str,), "k": (int,), "apply_b_dec_to_input": (bool,), "rescale_acts_by_decoder_norm": (bool,),
    "d_in": (int,), "d_sae": (int,), "d_out": (int,),
}  # fmt: skip


def _checked_cfg(cfg: dict[str, Any], cfg_file: Path, where: str) -> dict[str, Any]:
    """``cfg.json`` with every key splice reads of the type SAELens writes (absent and null keys dropped)."""
    checked = {key: value for key, value in cfg.items() if key in CFG_TYPES and value is not None}
    nested = checked.get("activation_fn_kwargs", {})
    if isinstance(nested, dict) and nested.get("k") is not None and "k" not in checked:
        checked["k"] = nested["k"]
    for key, value in checked.items():
        kinds = CFG_TYPES[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join({str: "a string", bool: "true/false", int: "a whole number", float: "a number",
                                 dict: "an object"}[k] for k in kinds)  # fmt: skip
            raise ConfigError(
                f"{where}: {str(cfg_file)!r} has {key} {_short(value)}, a JSON {_json_type(value)}; SAELens writes"
                f" {names}"
            )
    for key in ("k", "d_in", "d_sae", "d_out"):
        if key in checked:
            gate.whole(checked[key], f"{where}: {key} in {str(cfg_file)!r}", 1, 2**31)
    if "finetuning_scaling_factor" in checked and not isinstance(checked["finetuning_scaling_factor"], bool):
        gate.finite(checked["finetuning_scaling_factor"], f"{where}: finetuning_scaling_factor in {str(cfg_file)!r}")
    checked.pop("activation_fn_kwargs", None)
    return checked


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _load_file(
    found: Path, path: str, where: str, activation: str | None, k: int | None, apply_b_dec: bool | None,
    transcoding: bool = False,
) -> SpliceWeights:  # fmt: skip
    if found.suffix.lower() != ".safetensors":
        raise ConfigError(
            f"{where}: {path!r} is neither a SAELens directory (cfg.json + {WEIGHTS_FILE}) nor a .safetensors file"
        )
    tensors = read_tensors(found, where)
    action = where.rsplit(".", 2)[0]
    kind = activation or ("jumprelu" if "threshold" in tensors else "relu")
    if kind == "topk" and k is None:
        raise ConfigError(f"{action}.k: activation topk needs k (how many features stay active per position)")
    if kind != "topk" and k is not None:
        raise ConfigError(f"{action}.k: only activation topk takes k; this splice's activation is {kind!r}")
    b_dec_in = not transcoding if apply_b_dec is None else apply_b_dec
    weights = _build(tensors, path, path, where, kind, k, b_dec_in, False, "W_skip" in tensors)
    if weights.d_in != weights.d_out and b_dec_in:
        raise ConfigError(
            f"{action}.apply_b_dec_to_input: {path!r} maps width {weights.d_in} to {weights.d_out} (a transcoder), so"
            " b_dec cannot be subtracted from its input; set apply_b_dec_to_input: false"
        )
    return replace(weights, transcoder=transcoding or weights.d_in != weights.d_out)


def _build(
    tensors: dict[str, torch.Tensor], file: str, path: str, where: str, kind: str, k: int | None, b_dec_in: bool,
    transcoder: bool, skip: bool,
) -> SpliceWeights:  # fmt: skip
    """Check names and shapes of the tensors against each other; one line naming the file and the tensor."""
    needed = ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if kind == "jumprelu" else [])
    needed += ["W_skip"] if skip else []
    for name in needed:
        if name not in tensors:
            why = " (a JumpReLU SAE needs its threshold)" if name == "threshold" else ""
            raise ConfigError(
                f"{where}: {file!r} has no tensor {name!r}{why}; it has {', '.join(sorted(tensors)) or 'none'}"
            )
    w_enc, b_enc, w_dec, b_dec = (tensors[n] for n in ("W_enc", "b_enc", "W_dec", "b_dec"))
    for name in needed:
        if not tensors[name].is_floating_point():
            raise ConfigError(f"{where}: {name} in {file!r} is {tensors[name].dtype}, not a floating-point tensor")
    if w_enc.dim() != 2 or w_dec.dim() != 2:
        bad = "W_enc" if w_enc.dim() != 2 else "W_dec"
        raise ConfigError(f"{where}: {bad} in {file!r} has shape {list(tensors[bad].shape)}; it must be a matrix")
    d_in, d_sae = w_enc.shape
    expected = {"b_enc": (d_sae,), "W_dec": (d_sae, w_dec.shape[1]), "b_dec": (w_dec.shape[1],), "threshold": (d_sae,)}
    if skip:
        expected["W_skip"] = (w_dec.shape[1], d_in)
    for name, shape in expected.items():
        if name in needed and tuple(tensors[name].shape) != shape:
            raise ConfigError(
                f"{where}: {name} in {file!r} has shape {list(tensors[name].shape)}, but W_enc {list(w_enc.shape)}"
                f" (d_in {d_in}, d_sae {d_sae}) needs {list(shape)}"
            )
    if not transcoder and w_dec.shape[1] != d_in and b_dec_in:
        raise ConfigError(
            f"{where}: W_dec in {file!r} has shape {list(w_dec.shape)}; an SAE decodes back to d_in {d_in}"
        )
    return SpliceWeights(
        source=path, W_enc=w_enc, b_enc=b_enc, W_dec=w_dec, b_dec=b_dec, threshold=tensors.get("threshold"),
        W_skip=tensors.get("W_skip") if skip else None, activation=kind, k=k, apply_b_dec_to_input=b_dec_in,
        transcoder=transcoder,
    )  # fmt: skip
