"""Images for a vision model as its own image processor prepares them, and the input such a model runs by default.

A directory written by ``save_pretrained`` for a vision model usually holds the image processor it was
trained with (``preprocessor_config.json``: resize, rescale, normalize). Its pixels are what the model
expects; raw ``[0, 1]`` pixels are not. So an image given to such a model (``+input=file`` with a PNG,
an image folder) is opened with PIL and passed through ``AutoImageProcessor`` from the model's directory,
exactly as ``processor(images=Image.open(path), return_tensors="pt")["pixel_values"]`` does by hand
(an image with another colour mode is converted to RGB first when the processor normalizes three channels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.core.tensors import owned
from surgery.errors import ConfigError
from surgery.files.gate import config_path, read_json_object
from surgery.files.images import open_png
from surgery.files.paths import read_failure
from surgery.files.pretrained import from_pretrained

PROCESSOR_FILE = "preprocessor_config.json"


def is_vision_model(model: nn.Module) -> bool:
    """True for a transformers model whose main input is ``pixel_values`` (ViT, ConvNeXt, ...)."""
    return getattr(model, "main_input_name", None) == "pixel_values"


def image_input(model: nn.Module) -> dict[str, Any]:
    """The input a vision model runs when none is given: seeded random ``pixel_values`` ``[1, C, H, W]``.

    Random normal pixels are what a normalizing processor's output looks like; for a real image give
    ``+input=file input.path=IMAGE.png`` (its processor is applied).
    """
    config = getattr(model, "config", None)
    size = getattr(config, "image_size", None)
    height, width = (size, size) if isinstance(size, int) else tuple(size or (224, 224))[:2]
    channels = getattr(config, "num_channels", 3)
    return {"kind": "random", "shape": [1, int(channels), int(height), int(width)]}


def image_processor(model_path: Any) -> Any:
    """The image processor saved in ``model_path`` (``AutoImageProcessor``, offline), or None when there is none."""
    if model_path is None or str(model_path) in ("", "???"):
        return None
    directory = config_path(Path(str(model_path)).expanduser(), "model.path")
    if not (directory / PROCESSOR_FILE).is_file():
        return None
    from surgery.lm.load import transformers_offline

    hf = transformers_offline()
    read_json_object(directory / PROCESSOR_FILE, "model.path")  # a regular, capped JSON file before the library's read
    try:
        return from_pretrained(hf.AutoImageProcessor, directory)
    except Exception as e:  # noqa: BLE001 - an unknown processor type, a broken json, a missing extra ...
        raise ConfigError(
            f"model.path: cannot load the image processor in {str(directory / PROCESSOR_FILE)!r}: {read_failure(e)}"
        ) from None


def processed_image(processor: Any, path: Path, what: str = "input.path") -> torch.Tensor:
    """The PNG at ``path`` through ``processor``: ``pixel_values`` ``[1, C, H, W]``, size checked before decoding."""
    return process_image(processor, open_png(path, what), what, repr(str(path)))


def process_image(processor: Any, image: Any, what: str = "input.path", where: str = "an image") -> torch.Tensor:
    """A PIL image through ``processor``: ``pixel_values`` ``[1, C, H, W]`` (RGB first if it normalizes 3 channels)."""
    if _wants_rgb(processor) and getattr(image, "mode", "RGB") != "RGB":
        image = image.convert("RGB")
    try:
        pixels = processor(images=image, return_tensors="pt")["pixel_values"]
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"{what}: the model's image processor ({type(processor).__name__}) fails on {where}: {read_failure(e)}"
        ) from None
    return owned(pixels)


def _wants_rgb(processor: Any) -> bool:
    mean = getattr(processor, "image_mean", None)
    return isinstance(mean, (list, tuple)) and len(mean) == 3
