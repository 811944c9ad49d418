"""Preprocessing: a request's wire values -> the plain arrays the model takes.

Images arrive as their JPEG/PNG bytes and are decoded here, in the job, as `preprocess.images`
says for that input; sparse tensors are densified. Both are checked against `limits` first, so
a hostile request costs a header read, not a decompression bomb.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image
from PIL.JpegImagePlugin import JpegImageFile
from PIL.PngImagePlugin import PngImageFile

from cluster_serving.config import ImageConfig, LimitsConfig
from cluster_serving.runtime.outcomes import InvalidInput
from cluster_serving.wire.codec import Value
from cluster_serving.wire.kinds import kind_of

DEFAULT_IMAGE = ImageConfig()
# Only Pillow's JPEG and PNG plugins ever parse request bytes (Image.open would offer them to every
# plugin it has, and runs its bomb check before ours can name the size), chosen by the magic bytes
# those plugins accept.
HEADER_READERS = ((b"\xff\xd8\xff", JpegImageFile), (b"\x89PNG\r\n\x1a\n", PngImageFile))


def prepare_values(
    values: dict[str, Value], images: dict[str, ImageConfig], limits: LimitsConfig
) -> dict[str, np.ndarray]:
    """Every value as an ndarray, as its kind makes it; raises InvalidInput for an image or sparse
    tensor that cannot be."""

    def decode(name: str, data: bytes) -> np.ndarray:
        return decode_image(name, data, images.get(name, DEFAULT_IMAGE), limits.max_image_pixels)

    return {name: kind_of(value).to_array(name, value, decode) for name, value in values.items()}


def configure_pillow(max_pixels: int) -> None:
    """Makes Pillow's own bomb checks (frames, crops, any decoder path ours does not foresee) agree
    with ours: its limit is ours, and its warning between 1x and 2x the limit is an error too.
    Both are process-wide, so the decode stage sets them once when it opens: warnings.catch_warnings
    around each image is not thread-safe, and PyFlink's thread mode runs subtasks as threads."""
    Image.MAX_IMAGE_PIXELS = max_pixels
    warnings.filterwarnings("error", category=Image.DecompressionBombWarning)


def decode_image(name: str, data: bytes, config: ImageConfig, max_pixels: int) -> np.ndarray:
    """JPEG/PNG bytes -> a tensor laid out, typed and normalised as `config` says.

    Whatever the bytes, this returns or raises InvalidInput: Pillow's decoders raise many kinds
    of exception on hostile bytes (OSError, SyntaxError, struct.error, EOFError, MemoryError,
    DecompressionBombError, ...) and one that escaped would restart the whole job."""
    try:
        return _layout(_decode_pixels(name, data, config, max_pixels), config)
    except InvalidInput:
        raise
    except Exception as exc:
        raise InvalidInput(f"image {name!r} does not decode: {str(exc) or type(exc).__name__}") from None


def _decode_pixels(name: str, data: bytes, config: ImageConfig, max_pixels: int) -> np.ndarray:
    """The image's pixels, HWC uint8, decoded only once its header's size is within the limit."""
    reader = next((reader for magic, reader in HEADER_READERS if data.startswith(magic)), None)
    if reader is None:
        raise InvalidInput(f"image {name!r} does not decode: not JPEG or PNG")
    image = reader(io.BytesIO(data))  # reads the header only
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidInput(f"image {name!r}: {width}x{height} pixels, over the limit of {max_pixels}")
    image = image.convert("L" if config.channels == "L" else "RGB")
    if config.resize is not None:
        image = image.resize((config.resize[1], config.resize[0]), Image.Resampling.BILINEAR)
    return np.asarray(image)


def _layout(array: np.ndarray, config: ImageConfig) -> np.ndarray:
    """Decoded pixels -> the channels, dtype, normalisation and layout the model takes."""
    if array.ndim == 2:
        array = array[:, :, np.newaxis]
    if config.channels == "BGR":
        array = array[:, :, ::-1]
    if config.dtype != "uint8":
        array = array.astype(config.dtype) * np.asarray(config.scale, config.dtype)
        if config.mean:
            array = array - np.asarray(config.mean, config.dtype)
        if config.std:
            array = array / np.asarray(config.std, config.dtype)
    if config.layout == "CHW":
        array = array.transpose(2, 0, 1)
    return np.ascontiguousarray(array)
