"""Load a user's local Hugging Face model directory (written by ``save_pretrained``), offline.

``load_pretrained`` is the ``_target_`` of ``conf/model/hf.yaml``. Nothing is ever downloaded:
``HF_HUB_OFFLINE=1`` is set (unless the environment says otherwise) and every load passes
``local_files_only=True``. transformers 5 restores tied weights itself (``save_pretrained`` omits
GPT-2's ``lm_head.weight``, which is the token embedding); a weight the directory lacks, has in
another shape, or has but the model does not know is refused instead of being left at random.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.core.tensors import is_owned, owned
from surgery.errors import ConfigError
from surgery.files.gate import config_path, listing
from surgery.files.pretrained import checked_directory, from_pretrained

MISSING_EXTRA = "model: a Hugging Face model needs the optional extra: pip install 'surgery[hf]'"
TASKS = ("auto", "causal_lm", "base")
DTYPES = ("float32", "float64", "float16", "bfloat16")


def transformers_offline() -> Any:
    """The transformers module with the Hub switched off; a ConfigError naming the extra when missing."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ConfigError(MISSING_EXTRA) from None
    transformers.utils.logging.disable_progress_bar()  # its bars would interleave with our own output
    return transformers


def model_dir(path: Any, where: str = "model.path") -> Path:
    """``path`` as an existing directory holding ``config.json``, or a ConfigError saying what is wrong."""
    if path is None or str(path) in ("", "???"):
        raise ConfigError(f"{where}: a local directory written by save_pretrained is required, e.g. {where}=./my-gpt2")
    directory = config_path(Path(str(path)).expanduser(), where)
    if not directory.exists():
        raise ConfigError(
            f"{where}: {str(directory)!r} does not exist; give a local directory written by save_pretrained"
        )
    if not directory.is_dir():
        raise ConfigError(
            f"{where}: {str(directory)!r} is a file; give the directory save_pretrained wrote (config.json and"
            " model.safetensors), or load a weights file into a built model with model.checkpoint"
        )
    if not (directory / "config.json").is_file():
        found = ", ".join(listing(directory, where)[:8]) or "nothing"
        raise ConfigError(
            f"{where}: {str(directory)!r} has no config.json (it holds {found}); give a directory written by"
            " save_pretrained, or a hub model saved locally with model.save_pretrained(DIR)"
        )
    return directory


def is_causal_lm(config: Any) -> bool:
    """True when the config's saved architecture is a causal language model (it can ``generate``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(name in causal for name in getattr(config, "architectures", None) or ())


def _model_class(hf: Any, config: Any, task: str) -> Any:
    """Which class loads the directory: the causal LM, the saved architecture itself, or the bare ``AutoModel``."""
    if task == "causal_lm" or (task == "auto" and is_causal_lm(config)):
        return hf.AutoModelForCausalLM
    if task == "auto":  # keep the saved head (BertForMaskedLM's logits) rather than AutoModel's bare encoder
        for name in getattr(config, "architectures", None) or ():
            cls = getattr(hf, name, None)
            if isinstance(cls, type) and issubclass(cls, hf.PreTrainedModel):
                return cls
    return hf.AutoModel


def load_pretrained(
    path: str | Path, attn_implementation: str = "eager", dtype: str | None = None, task: str = "auto"
) -> nn.Module:
    """A model from a local ``save_pretrained`` directory, offline, in eval mode, every weight checked.

    ``task``: ``auto`` (a causal LM when the config's architecture is one, else the saved architecture,
    else ``AutoModel``), ``causal_lm`` or ``base`` (``AutoModel``). ``attn_implementation`` defaults to
    ``eager`` so attention weights exist as tensors hooks and ``function: softmax`` captures can see.
    ``dtype`` is None (as saved) or a torch dtype name. The key/value cache is off for plain forwards
    (the output is just logits, like ``gpt2_tiny``); ``surgery.lm.generate`` turns it on for generation.

    >>> model = load_pretrained("./my-gpt2")
    """
    directory = model_dir(path)
    if task not in TASKS:
        raise ConfigError(f"model.task: {task!r} is not one of {', '.join(TASKS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"model.dtype: {dtype!r} is not one of {', '.join(DTYPES)} (or null: as saved)")
    hf = transformers_offline()
    checked_directory(directory, "model.path")  # config.json through the gate; the model's size from its numbers
    try:
        config = from_pretrained(hf.AutoConfig, directory)
    except Exception as e:  # noqa: BLE001 - an unreadable or unknown config becomes one line
        raise ConfigError(f"model.path: cannot read {str(directory / 'config.json')!r}: {_first_line(e)}") from None
    cls = _model_class(hf, config, task)
    options: dict[str, Any] = {"output_loading_info": True}
    if attn_implementation:
        options["attn_implementation"] = attn_implementation
    if dtype is not None:
        options["dtype"] = getattr(torch, dtype)
    try:
        model, info = from_pretrained(cls, directory, **options)
    except Exception as e:  # noqa: BLE001
        key = "model.attn_implementation" if "attn" in str(e).lower() else "model.path"
        raise ConfigError(
            f"{key}: cannot load {str(directory)!r} as {getattr(cls, '__name__', cls)}: {_first_line(e)}"
        ) from None
    _refuse_misfits(directory, info)
    _own_tensors(model)
    model.config.use_cache = False
    return model.eval()


def _refuse_misfits(directory: Path, info: dict[str, Any]) -> None:
    """transformers leaves missing or reshaped weights at random and drops unknown ones; refuse all three."""
    problems = []
    for what, label in (
        ("missing_keys", "missing"),
        ("mismatched_keys", "of another shape"),
        ("unexpected_keys", "unexpected"),
    ):
        keys = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(what) or ())
        if keys:
            more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
            problems.append(f"{label}: {', '.join(keys[:5])}{more}")
    if problems:
        raise ConfigError(
            f"model.path: the weights in {str(directory)!r} do not fit the model its config.json describes"
            f" ({'; '.join(problems)}); save the model and its config together with save_pretrained"
        )


def _own_tensors(model: nn.Module) -> None:
    """Copy weights read from the file into owned, aligned storage (results must not depend on file offsets)."""
    copies: dict[int, torch.Tensor] = {}  # a buffer shared by modules stays shared
    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and not is_owned(param):  # a tied parameter is one object: copied once
                    param.data = owned(param.data)
            for name, buffer in module._buffers.items():
                if buffer is not None and not is_owned(buffer):
                    if id(buffer) not in copies:
                        copies[id(buffer)] = owned(buffer)
                    module._buffers[name] = copies[id(buffer)]


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
