"""Writes the fuzzers' seed corpus: tests/fuzz/corpus/{decoder,message,image,batch}/.

    python tests/fuzz/make_corpus.py

Deterministic (fixed pixels, fixed random seed), so re-running it rewrites the same files; files
it did not write (e.g. inputs a long fuzz run added) are left alone unless --clean is given.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster_serving.wire.codec import EncodedImage, Message, SparseTensor, encode_message  # noqa: E402
from tests.arrow_streams import one_batch_stream, write_stream  # noqa: E402
from tests.forged_images import png_header  # noqa: E402
from tests.fuzz.targets import KEY_EMPTY, KEY_LONG, KEY_NONE, KEY_OTHER, KEY_TEXT, KEY_URI, pack_records  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "corpus"
PIXELS = np.random.default_rng(0).integers(0, 256, size=(6, 8, 3), dtype=np.uint8)


def image_bytes(pixels: np.ndarray, fmt: str, mode: str | None = None, **save) -> bytes:
    image = Image.fromarray(pixels)
    if mode:
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def images() -> dict[str, bytes]:
    big = np.tile(np.arange(80, dtype=np.uint8)[:, None, None], (1, 80, 3))  # 6,400 pixels
    return {
        "rgb.png": image_bytes(PIXELS, "PNG"),
        "gray.png": image_bytes(PIXELS, "PNG", "L"),
        "rgba.png": image_bytes(PIXELS, "PNG", "RGBA"),
        "palette.png": image_bytes(PIXELS, "PNG", "P"),
        "bilevel.png": image_bytes(PIXELS, "PNG", "1"),
        "gray16.png": image_bytes(PIXELS, "PNG", "I;16"),
        "interlaced.png": image_bytes(PIXELS, "PNG", optimize=False, interlace=1),
        "rgb.jpg": image_bytes(PIXELS, "JPEG", quality=90),
        "gray.jpg": image_bytes(PIXELS, "JPEG", "L"),
        "cmyk.jpg": image_bytes(PIXELS, "JPEG", "CMYK"),
        "progressive.jpg": image_bytes(PIXELS, "JPEG", progressive=True),
        "over_limit_80x80.png": image_bytes(big, "PNG"),  # 6,400 pixels: refused at max_pixels 4096
        "refused.gif": image_bytes(PIXELS, "GIF"),
        # Claims 20000x20000: Pillow raises DecompressionBombError from Image.open (not an
        # OSError/ValueError), which decode_image must turn into InvalidInput.
        "bomb_20000x20000.png": png_header(20000, 20000, idat=zlib.compress(b"")),
        "truncated.png": image_bytes(PIXELS, "PNG")[:60],
    }


def forged(uri: str, column: pa.Array, dtype: str = "float32", shape: str = "[4]", version: str = "1") -> bytes:
    """A hand-built stream, to say what encode_message never would."""
    field = pa.field("x", column.type, metadata={"cs.dtype": dtype, "cs.shape": shape})
    schema = pa.schema([field], metadata={"cs.version": version, "cs.uri": uri})
    return one_batch_stream(schema, [column])


def compressed(message: Message, codec: str) -> bytes:
    """The message as one stream written with Arrow's body compression (the decoder accepts it)."""
    plain = pa.ipc.open_stream(encode_message(message, version=1))
    return write_stream(plain.schema, plain, codec)


def patched(message: Message, old: bytes, new: bytes) -> bytes:
    """The message's bytes with the first `old` replaced by `new` (same length: offsets stay)."""
    data = encode_message(message, version=1)
    assert len(old) == len(new) and old in data
    return data.replace(old, new, 1)


def regressions() -> dict[str, bytes]:
    """Inputs that crashed decode_message (fuzzer finds), kept so that CI replays them."""
    one = {"xy": np.zeros(4, np.float32)}
    sparse = {"sp": SparseTensor(np.zeros((1, 1), np.int64), np.ones(1, np.float32), (2,))}
    # Field flatbuffer: nullable (1), then the type union's tag; LargeList (21) -> Interval (11):
    # a column of interval[months], which pyarrow reads but cannot wrap (KeyError: 21).
    return {
        "regress_field_name_not_utf8.arrow": patched(Message("u", one), b"xy", b"\xff\xfe"),
        "regress_struct_name_not_utf8.arrow": patched(Message("u", sparse), b"values", b"valu\xcd\xcd"),
        "regress_count_superscript.arrow": encode_message(Message("u", one, batch_size="\u00b2"), version=1),  # '²'.isdigit()
        "regress_interval_type.arrow": patched(Message("u", one), b"\x01\x15", b"\x01\x0b"),
        # 2.7 KB on the wire, 64 MiB once inflated: compressed bodies are refused now.
        "regress_zstd_bomb.arrow": compressed(Message("u", {"x": np.zeros(1 << 24, np.float32)}), "zstd"),
    }


def messages(pictures: dict[str, bytes]) -> dict[str, bytes]:
    floats = Message("dense-f32", {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
    valid = {
        "dense_float32.arrow": encode_message(floats, version=1),
        "int64.arrow": encode_message(Message("int64", {"ids": np.array([1, -2, 2**62, 0], np.int64)}), version=1),
        "dense_float32.cst2": encode_message(floats),
        "int64_bool.cst2": encode_message(Message("ib", {"ids": np.array([1, -2, 2**62], np.int64), "on": np.ones(2, bool)})),
        "result.cst2": encode_message(Message("r", {"p": np.ones(10, np.float32)}, batch_size=32, inference_us=250)),
        "strings.arrow": encode_message(Message("strings", {"text": np.array([["héllo", ""], ["wörld", "€"]])})),
        "sparse.arrow": encode_message(Message("sparse", {"sp": SparseTensor(
            np.array([[0, 0], [1, 2], [4, 9]], np.int64), np.array([1.5, -2, 3], np.float32), (5, 10))})),
        "image.arrow": encode_message(Message("image", {"image": EncodedImage(pictures["rgb.png"])})),
        "error_result.arrow": encode_message(Message("failed", error="model error: boom", batch_size=4)),
        "top_n_result.arrow": encode_message(Message(
            "top-n", {"classes": np.array([3, 1], np.int64), "probabilities": np.array([0.7, 0.2], np.float32)},
            batch_size=8, inference_us=1234, top_n=2)),
        "mixed.arrow": encode_message(Message("mixed", {
            "flags": np.array([True, False, True]), "half": np.ones((2, 2), np.float16),
            "bytes": np.arange(5, dtype=np.uint8), "empty": np.zeros((0, 3), np.float64),
            "scalar": np.array(7, np.int32)}), version=1),
        "lz4.arrow": compressed(floats, "lz4"),
        "zstd.arrow": compressed(floats, "zstd"),
    }
    good = valid["dense_float32.arrow"]
    column = pa.LargeListArray.from_arrays(pa.array([0, 4], pa.int64()), pa.array(np.ones(4, np.float32)))
    corrupt = {
        "bad_truncated.arrow": good[: len(good) // 2],
        "flipped.arrow": good[:100] + bytes([good[100] ^ 0xFF]) + good[101:],
        "bad_garbage.bin": np.random.default_rng(2).bytes(200),
        "no_eos.arrow": good[:-8],
        "bad_version.arrow": forged("u", column, version="2"),
        "bad_dtype_object.arrow": forged("u", column, dtype="object"),
        "bad_shape.arrow": forged("u", column, shape="[4096,4096]"),
        "bad_shape_text.arrow": forged("u", column, shape="[1,"),
        "bad_list32.arrow": forged("u", pa.ListArray.from_arrays(pa.array([0, 4], pa.int32()), pa.array(np.ones(4, np.float32)))),
        "bad_nulls.arrow": forged("u", pa.LargeListArray.from_arrays(
            pa.array([0, 4], pa.int64()), pa.array([1.0, None, 2.0, 3.0], pa.float32()))),
        "offset_slice.arrow": forged("u", pa.LargeListArray.from_arrays(
            pa.array([0, 2, 6], pa.int64()), pa.array(np.arange(6, dtype=np.float32))).slice(1, 1)),
        "bad_uri_empty.arrow": forged("", column),
        "bad_two_rows.arrow": forged("u", pa.LargeListArray.from_arrays(
            pa.array([0, 2, 4], pa.int64()), pa.array(np.ones(4, np.float32))), shape="[2]"),
        "bad_truncated.cst2": valid["int64_bool.cst2"][:-3],
        "bad_layout.cst2": valid["dense_float32.cst2"].replace(b'"float32"', b'"float64"', 1),
    }
    return {**valid, **corrupt, **regressions()}


def batches(wire: dict[str, bytes], bomb_image: bytes) -> dict[str, bytes]:
    bomb = encode_message(Message("bomb", {"image": EncodedImage(bomb_image)}))
    mixed = [
        (KEY_URI, wire["dense_float32.arrow"]),
        (KEY_URI, wire["image.arrow"]),
        (KEY_OTHER, wire["int64.arrow"]),
        (KEY_NONE, wire["bad_garbage.bin"]),
        (KEY_LONG, wire["bad_truncated.arrow"]),
        (KEY_EMPTY, None),
        (KEY_TEXT + 6 * 5, wire["sparse.arrow"]),
        (KEY_NONE, wire["strings.arrow"]),
    ]
    return {
        "one_valid": pack_records([(KEY_URI, wire["dense_float32.arrow"])]),
        "mixed": pack_records(mixed),
        "results": pack_records([(KEY_URI, wire["top_n_result.arrow"]), (KEY_URI, wire["error_result.arrow"])]),
        "sparse_and_image": pack_records([(KEY_URI, wire["sparse.arrow"]), (KEY_URI, wire["image.arrow"])]),
        "compressed": pack_records([(KEY_URI, wire["lz4.arrow"]), (KEY_URI, wire["zstd.arrow"])]),
        # The PNG pixel bomb inside a request: decode_records must answer it with an error result.
        "image_bomb": pack_records([(KEY_URI, bomb), (KEY_URI, wire["dense_float32.arrow"])]),
        "regressions": pack_records([(KEY_URI, data) for name, data in wire.items() if name.startswith("regress_")]),
        "version_2": pack_records([(KEY_URI, wire["dense_float32.cst2"]), (KEY_URI, wire["int64_bool.cst2"]),
                                   (KEY_URI, wire["bad_layout.cst2"]), (KEY_OTHER, wire["dense_float32.cst2"])]),
    }


def structured() -> dict[str, bytes]:
    """Inputs for the `message` target: its builder reads choices off the bytes, any bytes will do."""
    rng = np.random.default_rng(3)
    seeds = {f"random_{i:02d}": rng.bytes(int(rng.integers(16, 400))) for i in range(12)}
    seeds["zeros"] = bytes(64)  # all-defaults: version "1", uri "u", no columns
    seeds["ones"] = b"\x01" * 64
    return seeds


def oip_requests() -> dict[str, bytes]:
    """OIP requests, each behind the byte that picks its encoding (even: JSON, odd: protobuf)."""
    from open_inference.grpc.protocol import ModelInferRequest, ModelInferResponse

    from cluster_serving.wire.open_inference import encode_request

    tensors = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "flags": np.array([[True, False]]),
               "text": np.array([["a", "ü"]], dtype=object), "half": np.array([[0.5, -2.0]], np.float16),
               "big": np.array([[2**64 - 1, 3]], np.uint64)}
    typed = ModelInferRequest(id="t")
    typed.parameters["timeout"].int64_param = 5
    typed.inputs.add(name="i", datatype="INT16", shape=[1, 2]).contents.int_contents.extend([-3, 7])
    typed.inputs.add(name="s", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"text")
    response = ModelInferResponse(id="r")
    response.outputs.add(name="y", datatype="FP64", shape=[1])
    response.raw_output_contents.append(np.array([1.5]).tobytes())
    return {
        "json": b"\0" + encode_request("json", "key", tensors),
        "json_nested": b"\0" + b'{"inputs": [{"name": "n", "shape": [2, 2], "datatype": "INT8", "data": [[1, 2], [3, 4]]}],'
                                b' "outputs": [{"name": "y"}], "parameters": {"timeout": 100}}',
        "protobuf_raw": b"\1" + encode_request("protobuf", "key", tensors),
        "protobuf_typed": b"\1" + typed.SerializeToString(),
        "protobuf_response": b"\1" + response.SerializeToString(),
    }


def write(folder: Path, files: dict[str, bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="delete the corpus folders first")
    args = parser.parse_args()
    if args.clean:
        shutil.rmtree(CORPUS, ignore_errors=True)
    pictures = images()
    wire = messages(pictures)
    write(CORPUS / "image", pictures)
    write(CORPUS / "decoder", wire)
    write(CORPUS / "batch", batches(wire, pictures["bomb_20000x20000.png"]))
    write(CORPUS / "message", structured())
    write(CORPUS / "oip", oip_requests())
    total = sum(path.stat().st_size for path in CORPUS.rglob("*") if path.is_file())
    print(f"{sum(1 for p in CORPUS.rglob('*') if p.is_file())} files, {total} bytes under {CORPUS}")


if __name__ == "__main__":
    main()
