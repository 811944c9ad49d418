"""Preprocessing: a request's wire values -> the plain arrays the model takes.

Images arrive as their JPEG/PNG bytes and are decoded here, in the job, as `preprocess.images`
says for that input; sparse tensors are densified. Both are checked against `limits` first, so
a hostile request costs a header read, not a decompression bomb.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from conf import ImageConfig, LimitsConfig
from connectors.codec import EncodedImage, SparseTensor, Value
from job.model import InvalidInput

IMAGE_FORMATS = ("JPEG", "PNG")
DEFAULT_IMAGE = ImageConfig()


def prepare_values(
    values: dict[str, Value], images: dict[str, ImageConfig], limits: LimitsConfig
) -> dict[str, np.ndarray]:
    """Every value as an ndarray; raises InvalidInput for an image or sparse tensor that cannot be."""
    return {name: _prepare(name, value, images, limits) for name, value in values.items()}


def _prepare(name: str, value: Value, images: dict[str, ImageConfig], limits: LimitsConfig) -> np.ndarray:
    if isinstance(value, EncodedImage):
        return decode_image(name, value.data, images.get(name, DEFAULT_IMAGE), limits.max_image_pixels)
    if isinstance(value, SparseTensor):
        return value.to_dense()  # the codec checked its bounds and dense size
    return value


def decode_image(name: str, data: bytes, config: ImageConfig, max_pixels: int) -> np.ndarray:
    """JPEG/PNG bytes -> a tensor laid out, typed and normalised as `config` says."""
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidInput(f"image {name!r} does not decode: {exc}") from None
    if image.format not in IMAGE_FORMATS:
        raise InvalidInput(f"image {name!r}: format {image.format} is not JPEG or PNG")
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidInput(f"image {name!r}: {width}x{height} pixels, over the limit of {max_pixels}")
    try:
        image = image.convert("L" if config.channels == "L" else "RGB")
        if config.resize is not None:
            image = image.resize((config.resize[1], config.resize[0]), Image.Resampling.BILINEAR)
        array = np.asarray(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidInput(f"image {name!r} does not decode: {exc}") from None
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
