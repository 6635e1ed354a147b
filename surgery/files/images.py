"""Images from others: the declared size is read from the header and checked before any pixel is decoded.

A small file can declare a huge image (a decompression bomb): 389 KB of PNG for 20000×20000 took
28 s and 3.3 GB to decode. Every image reader here caps width, height and pixels first, from the
header alone, whether the image is a file (``input.path``, image folders) or the bytes of a
``datasets`` Image column; a batch of images is checked against ``limits.memory_gb`` as a whole.
"""

from __future__ import annotations

import io
import struct
import warnings
from pathlib import Path

import numpy as np
import torch

from surgery.core.limits import check_memory
from surgery.core.tensors import owned
from surgery.errors import ConfigError
from surgery.files.paths import read_failure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PNG_SIDE = 16384  # pixels; an image past either cap is refused before decoding (docs/errors.md)
MAX_PNG_PIXELS = 4096 * 4096
PNG_CHANNELS = {0: 1, 2: 3, 3: 4, 4: 2, 6: 4}  # IHDR colour type → channels decoded (a palette decodes to RGBA)


def check_image_size(width: int, height: int, key: str, where: str, kind: str = "an image") -> None:
    """Refuse an image declaring more than the caps (or nothing), before it is decoded."""
    if not (0 < width <= MAX_PNG_SIDE and 0 < height <= MAX_PNG_SIDE and width * height <= MAX_PNG_PIXELS):
        raise ConfigError(
            f"{key}: {where} declares a {width}×{height} image; {kind} input may have at most"
            f" {MAX_PNG_SIDE} pixels a side and {MAX_PNG_PIXELS} pixels (4096×4096) in all. Resize it first"
        )


def _png_header(path: Path, what: str) -> tuple[int, int, int]:
    """(width, height, channels) from the PNG signature and IHDR chunk, refused past the caps."""
    with path.open("rb") as f:
        head = f.read(26)  # signature (8), IHDR length (4), b"IHDR" (4), width, height (4 each), depth, colour type
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise ConfigError(f"{what}: cannot read {str(path)!r} as .png (no PNG signature and IHDR header)")
    width, height = struct.unpack(">II", head[16:24])
    check_image_size(width, height, what, repr(str(path)), "a PNG")
    return width, height, PNG_CHANNELS.get(head[25] if len(head) > 25 else 6, 4)


def png_size(path: Path, what: str) -> tuple[int, int]:
    """(width, height) as the PNG header (IHDR) declares them, refused past the caps before any decoding."""
    width, height, _ = _png_header(path, what)
    return width, height


def png_decoded_bytes(path: Path, what: str) -> int:
    """The bytes :func:`read_png` will hold for this file (float32 per channel), from its header alone."""
    width, height, channels = _png_header(path, what)
    return width * height * channels * 4


def read_png(path: Path, what: str) -> torch.Tensor:
    """A PNG as floats in [0, 1], H×W (grey) or C×H×W, after checking its declared size."""
    import matplotlib.image

    check_memory(png_decoded_bytes(path, what), what, f"decoding {str(path)!r}")
    try:
        image = torch.from_numpy(matplotlib.image.imread(str(path)).copy()).float()
    except Exception as e:  # noqa: BLE001 - PIL raises SyntaxError, OSError, ...
        raise ConfigError(f"{what}: cannot read {str(path)!r} as .png ({read_failure(e)})") from None
    return owned(image if image.dim() == 2 else image.permute(2, 0, 1))


def open_png(path: Path, what: str) -> object:
    """A PNG as a loaded PIL image, after checking its declared size (caps and ``limits.memory_gb``) from the header."""
    from PIL import Image

    check_memory(png_decoded_bytes(path, what), what, f"decoding {str(path)!r}")
    try:
        with Image.open(path) as opened:
            opened.load()
            return opened.copy()
    except Exception as e:  # noqa: BLE001 - PIL raises SyntaxError, OSError, ...
        raise ConfigError(f"{what}: cannot read {str(path)!r} as .png ({read_failure(e)})") from None


def open_image_bytes(data: bytes, key: str, where: str) -> tuple[object, int]:
    """A PIL image opened (header only, nothing decoded) from ``data``, and the bytes decoding it will take."""
    from PIL import Image

    if data[:8] == PNG_SIGNATURE and len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        check_image_size(width, height, key, where)  # before PIL parses anything else
    try:
        with warnings.catch_warnings():  # PIL's bomb warning: the caps below are what decides
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise ConfigError(
            f"{key}: {where} declares an image of more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels;"
            f" an image input may have at most {MAX_PNG_PIXELS} pixels (4096×4096). Resize it first"
        ) from None
    except Exception as e:  # noqa: BLE001 - PIL raises UnidentifiedImageError, OSError, SyntaxError ...
        raise ConfigError(f"{key}: cannot read {where} as an image ({read_failure(e)})") from None
    width, height = image.size
    check_image_size(width, height, key, where)
    itemsize = 8 if image.mode.startswith(("I", "F")) else 1  # 16/32-bit samples become int64 or float tensors
    return image, width * height * len(image.getbands()) * itemsize


def decode_image(image: object, key: str, where: str) -> torch.Tensor:
    """A PIL image opened by :func:`open_image_bytes` as a C×H×W tensor (``datasets``' torch format)."""
    try:
        array = np.array(image)  # a writable copy: torch refuses to share a read-only buffer
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt image fails only when decoded
        raise ConfigError(f"{key}: cannot decode {where} ({read_failure(e)})") from None
    if array.ndim == 2:
        array = array[:, :, None]
    if array.dtype in (np.uint16, np.uint32):
        array = array.astype(np.int64)
    return owned(torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))))
