"""Pure functions around the job's stages: image decoding and layout, densifying, top-N, and the
client's reading of the four input forms."""

from __future__ import annotations

import base64
import io
import struct
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cluster_serving.config import ImageConfig, LimitsConfig, load_config
from cluster_serving.runtime.outcomes import InvalidInput
from cluster_serving.runtime.postprocess import top_n
from cluster_serving.runtime import preprocess
from cluster_serving.runtime.model import stack_rows
from cluster_serving.runtime.preprocess import configure_pillow, decode_image, decode_images, prepare_values
from cluster_serving.wire.codec import EncodedImage, Message, SparseTensor, decode_message, encode_message
from cluster_serving.wire.inputs import json_inputs, wire_value
from cluster_serving.wire.kinds import KINDS, DenseKind, ImageKind, SparseKind, kind_of
from cluster_serving.wire.tensors import TensorError
from tests.forged_images import jpeg_header, png_header
from tests.memory import peak_rss_growth_mb

PIXELS = np.random.default_rng(0).integers(0, 256, size=(6, 8, 3), dtype=np.uint8)  # height 6, width 8


def png(pixels: np.ndarray = PIXELS) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_default_image_is_rgb_hwc_uint8_exact() -> None:
    np.testing.assert_array_equal(decode_image("i", png(), ImageConfig(), 10_000), PIXELS)


def test_image_chw_float_scaled_and_normalised() -> None:
    config = ImageConfig(layout="CHW", dtype="float32", scale=1 / 255, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5))
    out = decode_image("i", png(), config, 10_000)
    expected = ((PIXELS.astype(np.float32) / 255 - [0.5, 0.4, 0.3]) / [0.2, 0.25, 0.5]).transpose(2, 0, 1)
    assert out.shape == (3, 6, 8) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels", ["RGB", "L"])
def test_image_hwc_float_scaled_without_mean_or_std(channels: str) -> None:
    out = decode_image("i", png(), ImageConfig(channels=channels, dtype="float32"), 10_000)
    pixels = PIXELS if channels == "RGB" else np.asarray(Image.fromarray(PIXELS).convert("L"))[:, :, None]
    np.testing.assert_allclose(out, pixels.astype(np.float32) / 255, rtol=1e-6)


def test_image_resize_bgr_and_grayscale() -> None:
    resized = decode_image("i", png(), ImageConfig(resize=(3, 4), channels="BGR"), 10_000)
    expected = np.asarray(Image.fromarray(PIXELS).resize((4, 3), Image.Resampling.BILINEAR))[:, :, ::-1]
    np.testing.assert_array_equal(resized, expected)
    gray = decode_image("i", png(), ImageConfig(channels="L", layout="CHW"), 10_000)
    assert gray.shape == (1, 6, 8)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"not an image", "does not decode"),
        (png()[:60], "does not decode"),
        (b"GIF89a" + png()[6:], "does not decode"),
    ],
)
def test_bad_images_are_invalid_input(data: bytes, reason: str) -> None:
    with pytest.raises(InvalidInput, match=reason):
        decode_image("i", data, ImageConfig(), 10_000)


@pytest.mark.parametrize(
    "data", [b"plain text, not an image", np.random.default_rng(2).bytes(300), b""], ids=["text", "random", "empty"]
)
def test_a_non_image_is_refused_in_a_plain_sentence(data: bytes) -> None:
    """Pillow's own refusal names its file object (`cannot identify image file <_io.BytesIO object
    at 0x7f...>`); a user sees what is wrong with the bytes instead."""
    with pytest.raises(InvalidInput) as refused:
        decode_image("photo", data, ImageConfig(), 10_000)
    assert str(refused.value) == "image 'photo' does not decode: not JPEG or PNG"


def test_image_over_the_pixel_limit_is_refused_before_decoding() -> None:
    with pytest.raises(InvalidInput, match="8x6 pixels, over the limit of 47"):
        decode_image("i", png(), ImageConfig(), 47)


@pytest.mark.parametrize("kind", ["GIF", "BMP", "TIFF"])
def test_other_formats_are_refused_unparsed(kind: str) -> None:
    """Only the JPEG and PNG plugins read request bytes: fewer decoders facing hostile input."""
    buffer = io.BytesIO()
    Image.fromarray(PIXELS).save(buffer, format=kind)
    with pytest.raises(InvalidInput, match="does not decode: not JPEG or PNG"):
        decode_image("i", buffer.getvalue(), ImageConfig(), 10_000)


@pytest.mark.parametrize(
    ("data", "size"),
    [(png_header(20000, 20000), "20000x20000"), (png_header(100000, 100000), "100000x100000"),
     (jpeg_header(65000, 65000), "65000x65000"), (png_header(9000, 9000), "9000x9000")],
    ids=["png-20000", "png-100000", "jpeg-65000", "png-9000"],
)
def test_pixel_bombs_are_refused_from_the_header(data: bytes, size: str) -> None:
    """Headers claiming 81 million to 10 billion pixels: refused in milliseconds, nothing allocated
    (Pillow itself raises DecompressionBombError above 179 million, which must not escape)."""
    started = time.perf_counter()

    def decode() -> None:
        with pytest.raises(InvalidInput, match=f"image 'i': {size} pixels, over the limit of 10000"):
            decode_image("i", data, ImageConfig(), 10_000)

    assert peak_rss_growth_mb(decode) < 32
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize(
    "error",
    [struct.error("unpack requires a buffer of 4 bytes"), EOFError(), MemoryError(), SyntaxError("broken"),
     Image.DecompressionBombError("Image size exceeds limit"), Image.DecompressionBombWarning("Image size"),
     RuntimeError("a decoder bug")],
    ids=lambda error: f"{type(error).__module__}.{type(error).__name__}",
)
def test_any_decoder_exception_is_invalid_input(error: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow raises many exception types on hostile bytes; none may escape decode_image."""
    def convert(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(Image.Image, "convert", convert)
    with pytest.raises(InvalidInput, match=f"image 'i' does not decode: {str(error) or type(error).__name__}"):
        decode_image("i", png(), ImageConfig(), 10_000)


def test_mutated_images_never_raise_anything_else() -> None:
    """Truncations and byte flips of real PNGs and JPEGs: an array or InvalidInput, every time, and
    its message never a Python object's repr."""
    rng = np.random.default_rng(1)
    jpeg = io.BytesIO()
    Image.fromarray(PIXELS).save(jpeg, format="JPEG")
    for original in (png(), jpeg.getvalue()):
        for _ in range(300):
            data = bytearray(original[: rng.integers(8, len(original) + 1)])
            for position in rng.integers(0, len(data), rng.integers(1, 6)):
                data[position] = rng.integers(0, 256)
            try:
                decode_image("i", bytes(data), ImageConfig(resize=(4, 4)), 10_000)
            except InvalidInput as refused:
                assert " object at 0x" not in str(refused), refused


def test_pillow_limit_agrees_and_its_warning_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow's own bomb check, run by Image.open here, gets our limit, and its mere warning
    between 1x and 2x the limit (PIXELS: 48 pixels, limit 40) refuses too."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    with warnings.catch_warnings():
        configure_pillow(40)
        with pytest.raises(Image.DecompressionBombWarning, match="exceeds limit of 40 pixels"):
            Image.open(io.BytesIO(png()))


def test_prepare_values_densifies_and_decodes() -> None:
    sparse = SparseTensor(np.array([[0, 0], [1, 2], [4, 5]]), np.array([101, 102, 103]), (5, 10))
    values = {"sp": sparse, "img": EncodedImage(png()), "x": np.arange(3)}
    out = prepare_values(values, {}, LimitsConfig(max_instance_bytes=1 << 20, max_image_pixels=100))
    assert out["sp"][1, 2] == 102 and out["sp"].sum() == 306 and out["sp"].shape == (5, 10)
    assert out["img"].shape == (6, 8, 3) and out["x"].tolist() == [0, 1, 2]


def test_top_n_orders_classes_by_score() -> None:
    result = top_n(Message("u", {"p": np.array([0.1, 0.5, 0.05, 0.35], np.float32)}, batch_size=4), 3)
    assert result.top_n == 3 and result.batch_size == 4
    assert result.tensors["classes"].tolist() == [1, 3, 0]
    np.testing.assert_allclose(result.tensors["probabilities"], [0.5, 0.35, 0.1])
    assert top_n(Message("u", error="boom"), 3).error == "boom"
    assert "needs a vector" in top_n(Message("u", {"p": np.ones((2, 2))}), 3).error


def test_client_reads_the_four_input_forms(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(png())
    assert wire_value("i", {"path": str(path)}) == EncodedImage(png())
    assert wire_value("i", {"b64": base64.b64encode(png()).decode()}) == EncodedImage(png())
    sparse = wire_value("s", [np.array([[0, 1, 4], [0, 2, 5]]), np.array([101, 102, 103]), np.array([5, 10])])
    assert isinstance(sparse, SparseTensor) and sparse.to_dense()[4, 5] == 103
    assert wire_value("t", ["hello", "world"]).tolist() == ["hello", "world"]
    assert wire_value("t", np.eye(2, dtype=np.int32)).dtype == np.int32


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({"b64": "***"}, "not valid base64"),
        ({"path": "/no/such/file.png"}, "cannot read image"),
        ({"url": "http://x"}, "an image is"),
        ([np.array([[0, 9]]).T, np.array([1.0]), np.array([2, 5])], "outside the shape"),
        ([1, "a"], "mixes strings"),
        ([[1, 2], [3]], "rectangular"),
    ],
)
def test_client_refuses_bad_values(value: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        wire_value("v", value)


def test_every_kind_goes_through_every_room() -> None:
    """Each registered kind from a client's form and from JSON, over the wire in both versions, to
    the model's array: a new kind fails here until it brings an example of each."""
    b64 = base64.b64encode(png()).decode()
    examples = {
        ImageKind: ({"b64": b64}, {"b64": b64}, PIXELS),
        SparseKind: ([np.array([[0, 1], [2, 0]]), np.array([5.0, 6.0]), np.array([2, 3])],
                     {"shape": [2, 3], "data": [5, 6], "indices": [[0, 2], [1, 0]]}, [[0, 0, 5.0], [6.0, 0, 0]]),
        DenseKind: (np.arange(4.0).reshape(2, 2), [[0, 1], [2, 3]], [[0.0, 1.0], [2.0, 3.0]]),
    }
    assert [type(kind) for kind in KINDS] == list(examples)  # the order the forms are tried in
    limits = LimitsConfig(max_instance_bytes=1 << 20, max_image_pixels=100)
    for kind in KINDS:
        client_form, json_form, expected = examples[type(kind)]
        from_client = wire_value("v", client_form)
        from_json = json_inputs({"v": json_form}, lambda name: np.dtype("float64"), frozenset())["v"]
        for value in (from_client, from_json):
            assert kind_of(value) is kind
            for version in (1, 2):
                decoded = decode_message(encode_message(Message("u", {"v": value}), version=version), 1 << 20).tensors
                assert kind_of(decoded["v"]) is kind
                np.testing.assert_array_equal(prepare_values(decoded, {}, limits)["v"], expected)


def test_json_objects_of_no_kind_are_refused_naming_every_kind() -> None:
    with pytest.raises(TensorError) as refused:
        json_inputs({"v": {"url": "http://x"}}, lambda name: None, frozenset())
    assert str(refused.value) == (
        "input 'v': an object must be an image {'b64': '...'} or a sparse tensor "
        "{'shape': [...], 'data': [...], 'indices': [[...], ...]}"
    )
    assert json_inputs({"v": "aGk="}, lambda name: None, frozenset({"v"}))["v"] == EncodedImage(b"hi")


def test_image_config_is_validated() -> None:
    config = load_config(overrides={"preprocess.images": {"img": {"layout": "CHW", "dtype": "float32"}}})
    assert config.preprocess.images["img"].scale == pytest.approx(1 / 255)
    for bad, reason in [
        ({"layout": "NCHW"}, "layout: must be one of"),
        ({"resize": [0, 3]}, "resize: must be between"),
        ({"dtype": "float32", "mean": [0.5]}, "list of 3 numbers"),
        ({"scale": 2}, "need a float dtype"),
        ({"colour": "RGB"}, "unknown key"),
    ]:
        with pytest.raises(ValueError, match=reason):
            load_config(overrides={"preprocess.images": {"img": bad}})


def jpeg_bytes(pixels: np.ndarray, **options: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def test_a_batch_of_images_decodes_in_a_pool_into_consecutive_rows_and_bad_ones_fail_alone() -> None:
    """Good JPEGs and PNGs between a corrupt JPEG, a truncated one and one over the pixel limit:
    each bad image is its own InvalidInput, whichever thread met it, and the good ones are what
    decode_image makes of them, as consecutive rows of one array that the model takes as it is."""
    rng = np.random.default_rng(3)
    photos = [rng.integers(0, 256, (12, 16, 3), dtype=np.uint8) for _ in range(5)]
    good = [jpeg_bytes(photos[0]), png(photos[1]), jpeg_bytes(photos[2]), jpeg_bytes(photos[3]), png(photos[4])]
    bad = [b"\xff\xd8\xff" + b"\x00" * 64, jpeg_bytes(photos[0])[:100], jpeg_header(400, 400)]
    images = [good[0], bad[0], good[1], good[2], bad[1], good[3], bad[2], good[4]]
    config = ImageConfig(resize=(6, 8), layout="CHW", dtype="float32", mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5))
    with ThreadPoolExecutor(2) as pool:
        decoded = decode_images("photo", images, config, 10_000, pool)
    refused = [str(item) for item in decoded if isinstance(item, InvalidInput)]
    assert [isinstance(item, InvalidInput) for item in decoded] == [False, True, False, False, True, False, True, False]
    assert refused[0].startswith("image 'photo' does not decode: ") and refused[1].startswith("image 'photo' does not decode: ")
    assert refused[2] == "image 'photo': 400x400 pixels, over the limit of 10000"
    rows = [item for item in decoded if not isinstance(item, InvalidInput)]
    for row, data in zip(rows, good):
        np.testing.assert_allclose(row, decode_image("photo", data, config, 10_000), rtol=1e-6)
    batch = stack_rows(rows)
    assert batch.shape == (5, 3, 6, 8) and np.shares_memory(batch, rows[0])  # the rows' own array, no copy


def test_jpegs_of_the_target_size_decode_straight_into_the_batch_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """uint8 HWC rows (the device path's plain pixels): a JPEG of the target size is written by
    the decoder into its row, with no copy after it, and its pixels are what decode_image makes; a
    larger JPEG or a PNG beside it goes the other way, and a truncated one fails alone."""
    rng = np.random.default_rng(5)
    photos = [rng.integers(0, 256, (12, 16, 3), dtype=np.uint8) for _ in range(3)]
    images = [jpeg_bytes(photos[0]), jpeg_bytes(photos[1])[:100], jpeg_bytes(np.repeat(photos[1], 2, axis=0)),
              png(photos[2]), jpeg_bytes(photos[2])]
    config = ImageConfig(resize=(12, 16))
    laid_out = []
    real = preprocess.lay_out
    monkeypatch.setattr(preprocess, "lay_out", lambda pixels, *rest: (laid_out.append(pixels.shape), real(pixels, *rest)))
    buffer = np.zeros((len(images), 12, 16, 3), np.uint8)
    with ThreadPoolExecutor(2) as pool:
        decoded = decode_images("photo", images, config, 10_000, pool, lambda shape, dtype: buffer[:shape[0]])
    assert [isinstance(item, InvalidInput) for item in decoded] == [False, True, False, False, False]
    rows = [item for item in decoded if not isinstance(item, InvalidInput)]
    assert all(np.shares_memory(row, buffer) for row in rows)
    monkeypatch.setattr(preprocess, "lay_out", real)
    for row, data in zip(rows, [images[0], images[2], images[3], images[4]]):
        np.testing.assert_array_equal(row, decode_image("photo", data, config, 10_000))
    assert sorted(laid_out) == [(12, 16, 3), (12, 16, 3)]  # the resized JPEG and the PNG only


def test_large_jpegs_decode_at_a_reduced_scale_then_resize() -> None:
    """A JPEG four times the target size per side decodes by DCT scaling (libjpeg-turbo), then
    resizes: close to decoding it whole and resizing, at a fraction of the work."""
    y, x = np.mgrid[0:256, 0:256]
    smooth = np.stack([x, y, (x + y) // 2], axis=2).astype(np.uint8)
    data = jpeg_bytes(smooth, quality=95)
    scaled = decode_image("i", data, ImageConfig(resize=(64, 64)), 1 << 20)
    whole = np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((64, 64), Image.Resampling.BILINEAR))
    assert scaled.shape == (64, 64, 3)
    assert np.abs(scaled.astype(int) - whole.astype(int)).mean() < 2


def test_stack_rows_copies_rows_that_are_not_one_arrays_consecutive_rows() -> None:
    batch = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    assert np.shares_memory(stack_rows([batch[1], batch[2], batch[3]]), batch)
    for rows in ([batch[0], batch[2]], [batch[1], batch[0]], [batch[0], np.ones((2, 3), np.float32)]):
        stacked = stack_rows(rows)
        assert not np.shares_memory(stacked, batch)
        np.testing.assert_array_equal(stacked, np.stack(rows))


def test_an_unforeseen_error_laying_out_one_image_is_that_images_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    real = preprocess.lay_out

    def lay_out(pixels: np.ndarray, config: ImageConfig, out: np.ndarray) -> None:
        if pixels[0, 0, 0] == 7:
            raise MemoryError("no room")
        real(pixels, config, out)

    monkeypatch.setattr(preprocess, "lay_out", lay_out)
    pixels = [np.full((6, 8, 3), value, np.uint8) for value in (1, 7, 3)]
    with ThreadPoolExecutor(2) as pool:
        decoded = decode_images("i", [png(p) for p in pixels], ImageConfig(resize=(6, 8)), 10_000, pool)
    assert isinstance(decoded[1], InvalidInput) and str(decoded[1]) == "image 'i' does not decode: MemoryError: no room"
    assert [row[0, 0, 0] for row in (decoded[0], decoded[2])] == [1, 3]
