"""Preprocessing: a request's wire values -> the plain arrays the model takes.

Images arrive as their JPEG/PNG bytes and are decoded here, in the job, as `preprocess.images`
says for that input; sparse tensors are densified. Both are checked against `limits` first, so
a hostile request costs a header read, not a decompression bomb.

A batch's images are decoded together (`decode_images`), in a pool of threads: JPEGs by
libjpeg-turbo through simplejpeg, which lets go of the GIL while it works and decodes a large
JPEG at a reduced size (DCT scaling) when the input is resized anyway; images of a fixed size
are laid out and normalised straight into one batch array, whose rows the model then takes
without another copy.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np
import simplejpeg
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
JPEG_MAGIC, PNG_MAGIC = b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n"
HEADER_READERS = ((JPEG_MAGIC, JpegImageFile), (PNG_MAGIC, PngImageFile))
# libjpeg-turbo's names of the colour spaces it converts from itself; others (CMYK, YCCK) go to Pillow.
TURBO_COLORSPACES = {"Gray", "YCbCr", "RGB"}
# Makes the array a batch's images are decoded into, from its shape and dtype.
BatchArray = Callable[[tuple[int, ...], np.dtype], np.ndarray]


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

    Whatever the bytes, this returns or raises InvalidInput: the decoders raise many kinds of
    exception on hostile bytes (ValueError, OSError, SyntaxError, struct.error, EOFError,
    MemoryError, DecompressionBombError, ...) and one that escaped would restart the whole job."""
    pixels = _pixels_or_invalid(name, data, config, max_pixels)
    out = np.empty(tensor_shape(pixels.shape, config), config.dtype)
    lay_out(pixels, config, out)
    return out


def decode_images(
    name: str, images: Sequence[bytes], config: ImageConfig, max_pixels: int, pool: Executor | None = None,
    batch_array: BatchArray = np.empty,
) -> list[np.ndarray | InvalidInput]:
    """Each image of one input as decode_image makes it, or the InvalidInput that refuses it,
    decoded in `pool` (None: in this thread). With a fixed size (`resize`), each image is decoded
    and laid out by one task straight into its row of one batch array from `batch_array(shape,
    dtype)` (the model's page-locked buffer on a GPU); the rows of failed images are closed up,
    so the arrays returned adjoin, in order."""
    each = pool.map if pool is not None else map
    if config.resize is None:
        decoded = list(each(lambda data: _pixels_or_error(name, data, config, max_pixels), images))
        return [pixels if isinstance(pixels, InvalidInput) else _laid_out_or_error(
            name, pixels, np.empty(tensor_shape(pixels.shape, config), config.dtype), config) for pixels in decoded]
    batch = batch_array((len(images), *tensor_shape(tuple(config.resize), config)), np.dtype(config.dtype))
    results = list(each(lambda pair: _decoded_into(name, *pair, config, max_pixels), zip(images, batch)))
    good = [index for index, result in enumerate(results) if not isinstance(result, InvalidInput)]
    for row, index in enumerate(good):
        if row != index:
            batch[row] = batch[index]
    rows = iter(batch[:len(good)])
    return [result if isinstance(result, InvalidInput) else next(rows) for result in results]


def _decoded_into(name: str, data: bytes, out: np.ndarray, config: ImageConfig, max_pixels: int) -> np.ndarray | InvalidInput:
    pixels = _pixels_or_error(name, data, config, max_pixels, out)
    if pixels is out or isinstance(pixels, InvalidInput):  # decoded in place, or refused
        return pixels
    return _laid_out_or_error(name, pixels, out, config)


def _laid_out_or_error(name: str, pixels: np.ndarray, out: np.ndarray, config: ImageConfig) -> np.ndarray | InvalidInput:
    try:
        lay_out(pixels, config, out)
    except Exception as exc:  # no check foresees one; still that image's alone
        return InvalidInput(f"image {name!r} does not decode: {type(exc).__name__}: {exc}")
    return out


def _pixels_or_error(name: str, data: bytes, config: ImageConfig, max_pixels: int,
                     out: np.ndarray | None = None) -> np.ndarray | InvalidInput:
    try:
        return _pixels_or_invalid(name, data, config, max_pixels, out)
    except InvalidInput as refused:
        return refused


def _pixels_or_invalid(name: str, data: bytes, config: ImageConfig, max_pixels: int,
                       out: np.ndarray | None = None) -> np.ndarray:
    try:
        return _decode_pixels(name, data, config, max_pixels, out)
    except InvalidInput:
        raise
    except Exception as exc:
        raise InvalidInput(f"image {name!r} does not decode: {str(exc) or type(exc).__name__}") from None


def _decode_pixels(name: str, data: bytes, config: ImageConfig, max_pixels: int, out: np.ndarray | None = None) -> np.ndarray:
    """The image's pixels, HWC uint8 in the channel order of `config`, at its `resize` size;
    decoded only once its header's size is within the limit. A JPEG whose pixels are what `out`
    takes as they are (uint8 HWC, of its size) is decoded straight into `out`, which is returned."""
    if data.startswith(JPEG_MAGIC):
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)  # the header only
        _check_size(name, width, height, max_pixels)
        if colorspace in TURBO_COLORSPACES:
            if out is not None and _takes_as_decoded(out, height, width, config):
                return _decode_jpeg(data, config, out)
            return _resized(_decode_jpeg(data, config), config)
    reader = next((reader for magic, reader in HEADER_READERS if data.startswith(magic)), None)
    if reader is None:
        raise InvalidInput(f"image {name!r} does not decode: not JPEG or PNG")
    image = reader(io.BytesIO(data))  # reads the header only
    _check_size(name, *image.size, max_pixels)
    pixels = np.asarray(image.convert("L" if config.channels == "L" else "RGB"))
    return _resized(pixels[:, :, ::-1] if config.channels == "BGR" else pixels, config)


def _takes_as_decoded(out: np.ndarray, height: int, width: int, config: ImageConfig) -> bool:
    """Whether `out` takes an image's pixels as the JPEG decoder writes them: uint8 HWC, its size."""
    return config.layout == "HWC" and out.dtype == np.uint8 and out.shape == tensor_shape((height, width), config)


def _check_size(name: str, width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise InvalidInput(f"image {name!r}: {width}x{height} pixels, over the limit of {max_pixels}")


def _decode_jpeg(data: bytes, config: ImageConfig, out: np.ndarray | None = None) -> np.ndarray:
    """libjpeg-turbo's decode (into `out` when given, which must fit it); a JPEG at least twice the
    target size on each side decodes at the smallest DCT scale (1/2, 1/4, 1/8) not below it. A
    smaller one decodes whole, pixel for pixel as Pillow decodes it."""
    height, width = config.resize or (0, 0)
    colorspace = {"L": "GRAY", "BGR": "BGR"}.get(config.channels, "RGB")
    if out is not None:
        simplejpeg.decode_jpeg(data, colorspace=colorspace, buffer=out)
        return out
    return simplejpeg.decode_jpeg(data, colorspace=colorspace, min_height=height, min_width=width, min_factor=2)


def _resized(pixels: np.ndarray, config: ImageConfig) -> np.ndarray:
    if config.resize is None or pixels.shape[:2] == tuple(config.resize):
        return pixels
    image = Image.fromarray(pixels[:, :, 0] if pixels.ndim == 3 and pixels.shape[2] == 1 else pixels)
    return np.asarray(image.resize((config.resize[1], config.resize[0]), Image.Resampling.BILINEAR))


def tensor_shape(pixels_shape: tuple[int, ...], config: ImageConfig) -> tuple[int, int, int]:
    """The tensor of an image of these pixels: HWC or CHW."""
    height, width = pixels_shape[:2]
    channels = 1 if config.channels == "L" else 3
    return (channels, height, width) if config.layout == "CHW" else (height, width, channels)


def lay_out(pixels: np.ndarray, config: ImageConfig, out: np.ndarray) -> None:
    """Writes decoded pixels into `out` with the dtype, normalisation and layout the model takes,
    reading them in `out`'s layout so that the writes are in order: (pixel * scale - mean) / std
    as pixel * (scale / std) - mean / std."""
    height, width = pixels.shape[:2]
    if config.layout == "CHW":
        source, target, repeat = pixels.reshape(height, width, -1).transpose(2, 0, 1), out, 1
    else:  # rows of width x channels values: long inner loops instead of ones of 3 channels
        source, target, repeat = pixels.reshape(height, -1), out.reshape(height, -1), width
    if config.dtype == "uint8":
        np.copyto(target, source)
        return
    factor, offset = affine(config)
    np.multiply(source, np.tile(factor, repeat), out=target)
    if offset is not None:
        np.subtract(target, np.tile(offset, repeat), out=target)


def affine(config: ImageConfig) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-channel factor and offset, shaped to broadcast over the channel axis of the layout."""
    std = np.asarray(config.std or (1.0,) * (1 if config.channels == "L" else 3), np.float64)
    shape = (-1, 1, 1) if config.layout == "CHW" else (-1,)
    factor = (config.scale / std).astype(config.dtype).reshape(shape)
    offset = (np.asarray(config.mean, np.float64) / std).astype(config.dtype).reshape(shape) if config.mean else None
    return factor, offset
