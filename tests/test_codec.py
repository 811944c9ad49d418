"""The wire format: exact round trips for every dtype, and refusals for everything else."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cluster_serving.wire.codec import (
    DecodeError, EncodedImage, Message, Served, SparseTensor, TooLarge, decode_message, encode_message, encode_rows,
)
from cluster_serving.wire.inputs import encode_alike_requests, encode_by_kind, encode_request
from cluster_serving.wire.v1 import END_OF_STREAM, _field, _table
from cluster_serving.wire.v2 import V2_MAGIC, encode_arrays
from cluster_serving.wire.values import NUMERIC_DTYPES
from tests.arrow_streams import one_batch_stream, write_stream
from tests.memory import peak_rss_growth_mb

LIMIT = 1 << 24


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(sorted(NUMERIC_DTYPES)),
    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    version=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_numeric_round_trip_is_exact(dtype: str, shape: tuple[int, ...], version: int, data: st.DataObject) -> None:
    array = data.draw(hnp.arrays(np.dtype(dtype), shape))
    payload = encode_message(Message("uri-1", {"t": array}), version=version)
    assert payload.startswith(V2_MAGIC) == (version == 2)
    decoded = decode_message(payload, LIMIT)
    assert decoded.uri == "uri-1"
    out = decoded.tensors["t"]
    assert out.dtype == array.dtype and out.shape == array.shape
    assert out.tobytes() == array.tobytes()  # bit-exact, NaNs included


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(sorted(NUMERIC_DTYPES)),
    byte_order=st.sampled_from("<>"),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    transposed=st.booleans(),
    count=st.integers(1, 5),
    data=st.data(),
)
def test_requests_encoded_together_are_each_ones_own_bytes(
    dtype: str, byte_order: str, shape: tuple[int, ...], transposed: bool, count: int, data: st.DataObject
) -> None:
    """The shortcuts of enqueue_batch (encode_alike_requests) and of a lone request (encode_arrays,
    encode_request's) write exactly what the general path writes for each request, or leave them
    to it (None); they take native little-endian arrays, whatever their memory order."""
    typed = np.dtype(dtype).newbyteorder(byte_order)
    arrays = [data.draw(hnp.arrays(typed, shape)) for _ in range(count)]
    requests = [(f"r{i}", {"t": array.T if transposed else array, "n": np.array([i], np.int64)})
                for i, array in enumerate(arrays)]
    general = [encode_by_kind(uri, inputs) for uri, inputs in requests]
    together = encode_alike_requests(requests)
    assert together == general or together is None
    assert (together is None) == (typed.byteorder == ">")
    alone = [encode_arrays(uri, inputs) for uri, inputs in requests]
    assert alone == general if typed.byteorder != ">" else alone == [None] * count
    assert [encode_request(uri, inputs) for uri, inputs in requests] == general


@pytest.mark.parametrize("odd_one", [
    ("r9", {"t": np.zeros(3, np.float32)}),  # another shape
    ("r9", {"t": np.zeros(4, np.float64)}),  # another dtype
    ("r9", {"s": np.zeros(4, np.float32)}),  # another name
    ("r9", {"t": [0.0, 0.0, 0.0, 0.0]}),  # a list, not an array
    ("r9", {"t": np.zeros(4, np.float32), "s": np.zeros(1, np.float32)}),  # one input more
    ("", {"t": np.zeros(4, np.float32)}),  # no uri
    ("r" * 1025, {"t": np.zeros(4, np.float32)}),  # a uri over the limit
])
def test_requests_not_alike_are_left_to_encode_request(odd_one: tuple[str, dict]) -> None:
    requests = [(f"r{i}", {"t": np.full(4, i, np.float32)}) for i in range(3)]
    assert encode_alike_requests(requests) is not None
    assert encode_alike_requests([*requests, odd_one]) is None
    assert encode_alike_requests([(f"r{i}", {"t": np.array(["a", "b"])}) for i in range(3)]) is None


@pytest.mark.parametrize("inputs", [
    {"t": [0.0, 0.0]},  # a list, not an array
    {"t": np.zeros(2, np.float32), "s": ["a"]},  # one input not an array
    {"t": np.array(["a", "b"])},  # strings
    {"t": np.zeros(2, ">f4")},  # big-endian
    {},  # no input
])
def test_a_lone_request_not_of_number_arrays_is_left_to_the_general_path(inputs: dict) -> None:
    assert encode_arrays("r1", inputs) is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=20), max_size=10))
def test_string_round_trip(texts: list[str]) -> None:
    decoded = decode_message(encode_message(Message("s", {"text": np.array(texts, dtype=object)})), LIMIT)
    assert decoded.tensors["text"].tolist() == texts


@st.composite
def sparse_tensors(draw: st.DrawFn) -> SparseTensor:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=6))
    positions = draw(st.lists(st.tuples(*(st.integers(0, dim - 1) for dim in shape)), max_size=12, unique=True))
    values = draw(hnp.arrays(np.dtype(draw(st.sampled_from(sorted(NUMERIC_DTYPES)))), len(positions)))
    indices = np.array(positions, dtype=np.int64).reshape(len(positions), len(shape))
    return SparseTensor(indices, values, shape)


@settings(max_examples=200, deadline=None)
@given(sparse=sparse_tensors())
def test_sparse_round_trip_is_exact(sparse: SparseTensor) -> None:
    out = decode_message(encode_message(Message("s", {"sp": sparse})), LIMIT).tensors["sp"]
    assert isinstance(out, SparseTensor) and out.shape == sparse.shape
    assert out.values.dtype == sparse.values.dtype and out.values.tobytes() == sparse.values.tobytes()
    np.testing.assert_array_equal(out.indices, sparse.indices)
    assert out.to_dense().tobytes() == sparse.to_dense().tobytes()


@settings(max_examples=50, deadline=None)
@given(data=st.binary(min_size=1, max_size=4096))
def test_image_bytes_and_mixed_values_round_trip(data: bytes) -> None:
    message = Message("m", {
        "img": EncodedImage(data), "text": np.array(["a", "b"], dtype=object), "x": np.arange(4, dtype=np.int32),
        "sp": SparseTensor(np.array([[0, 1]]), np.array([2.5]), (2, 2)),
    })
    out = decode_message(encode_message(message), LIMIT).tensors
    assert out["img"] == EncodedImage(data)
    assert out["text"].tolist() == ["a", "b"] and out["x"].tolist() == [0, 1, 2, 3]
    assert out["sp"].to_dense().tolist() == [[0, 2.5], [0, 0]]


@settings(max_examples=50, deadline=None)
@given(data=st.binary(min_size=1, max_size=4096), other=st.binary(min_size=1, max_size=64))
def test_images_and_number_tensors_travel_in_version_2(data: bytes, other: bytes) -> None:
    """An image request is version 2 (its bytes behind their length), read back byte for byte;
    its layout is no stacking key, since its pixels' shapes are known only once decoded."""
    message = Message("m", {"img": EncodedImage(data), "x": np.arange(3, dtype=np.float32), "img2": EncodedImage(other)})
    payload = encode_message(message)
    assert payload.startswith(V2_MAGIC) and payload.endswith(other)
    out = decode_message(payload, LIMIT)
    assert out.tensors["img"] == EncodedImage(data) and out.tensors["img2"] == EncodedImage(other)
    assert out.tensors["x"].tolist() == [0, 1, 2] and out.layout_key is None
    assert decode_message(encode_message(message, version=1), LIMIT).tensors["img"] == EncodedImage(data)


def test_top_n_result_round_trips() -> None:
    message = Message("t", {"classes": np.array([3, 1]), "probabilities": np.array([0.7, 0.2])}, top_n=2)
    assert decode_message(encode_message(message), LIMIT).top_n == 2


@pytest.mark.parametrize(
    ("sparse", "reason"),
    [
        (SparseTensor(np.array([[0, 5]]), np.array([1.0]), (2, 5)), "outside the shape"),
        (SparseTensor(np.array([[-1, 0]]), np.array([1.0]), (2, 5)), "outside the shape"),
        (SparseTensor(np.array([[0, 0], [1, 1]]), np.array([1.0]), (2, 5)), "need indices of shape"),
        (SparseTensor(np.array([[0, 0]]), np.array(["a"]), (2, 5)), "must be numbers"),
    ],
)
def test_refuses_inconsistent_sparse_on_encode(sparse: SparseTensor, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        encode_message(Message("u", {"sp": sparse}))


def test_refuses_sparse_too_large_once_dense() -> None:
    """A few bytes on the wire that would be 4 TB once dense."""
    payload = encode_message(Message("u", {"sp": SparseTensor(np.array([[0, 0]]), np.array([1.0], np.float32), (2**20, 2**20))}))
    assert len(payload) < 2048
    with pytest.raises(TooLarge, match="once dense, over the limit"):
        decode_message(payload, LIMIT)


def test_result_fields_round_trip() -> None:
    message = Message("u", {"p": np.arange(3, dtype=np.float32)}, batch_size=32)
    decoded = decode_message(encode_message(message), LIMIT)
    assert decoded.batch_size == 32 and decoded.error is None
    error = decode_message(encode_message(Message("u", error="boom", error_code="inference_failed")), LIMIT)
    assert error.error == "boom" and error.error_code == "inference_failed" and error.tensors == {}


def test_refuses_unsupported_dtype_on_encode() -> None:
    with pytest.raises(ValueError, match="not supported"):
        encode_message(Message("u", {"c": np.zeros(2, dtype=np.complex64)}))


def _forged(metadata: dict[str, str], field_meta: dict[str, str], values: pa.Array) -> bytes:
    """A message built by hand, to check what the decoder refuses."""
    column = pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), values)
    schema = pa.schema([pa.field("t", column.type, metadata=field_meta)], metadata=metadata)
    return one_batch_stream(schema, [column])


GOOD_META = {"cs.version": "1", "cs.uri": "u"}
FLOATS = pa.array([1.0, 2.0], pa.float32())


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "not a cluster-serving message"),
        (b"\x00garbage" * 10, "not a cluster-serving message"),
        (_forged({"cs.version": "9", "cs.uri": "u"}, {"cs.dtype": "float32", "cs.shape": "[2]"}, FLOATS), "version"),
        (_forged({"cs.version": "1"}, {"cs.dtype": "float32", "cs.shape": "[2]"}, FLOATS), "uri"),
        (_forged(GOOD_META, {"cs.dtype": "object", "cs.shape": "[2]"}, FLOATS), "not allowed"),
        (_forged(GOOD_META, {"cs.dtype": "float32", "cs.shape": "[3]"}, FLOATS), "do not fill"),
        (_forged(GOOD_META, {"cs.dtype": "float64", "cs.shape": "[2]"}, FLOATS), "do not match"),
        (_forged(GOOD_META, {"cs.dtype": "float32", "cs.shape": "[-2]"}, FLOATS), "invalid shape"),
        (_forged(GOOD_META, {"cs.dtype": "float32", "cs.shape": "two"}, FLOATS), "not a JSON list"),
        (_forged(GOOD_META, {"cs.dtype": "float32", "cs.shape": json.dumps([1] * 17)}, FLOATS), "invalid shape"),
        (_forged(GOOD_META, {"cs.dtype": "float32", "cs.shape": "[2]", "cs.layout": "csr"}, FLOATS), "unknown layout"),
        (_forged(GOOD_META, {"cs.dtype": "float32", "cs.shape": "[2]", "cs.layout": "coo"}, FLOATS), "struct of indices"),
        (_forged(GOOD_META, {"cs.dtype": "image", "cs.shape": "[]"}, FLOATS), "large_binary"),
        (_forged(GOOD_META, {"cs.dtype": "image", "cs.shape": "[]"}, pa.array([b""], pa.large_binary())), "non-empty"),
    ],
)
def test_refuses_bad_payloads(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError, match=reason):
        decode_message(payload, LIMIT)


def _v2(layout: object, values: bytes = b"\x00" * 8, uri: bytes = b"u") -> bytes:
    text = layout if isinstance(layout, bytes) else json.dumps(layout).encode()
    return V2_MAGIC + struct.pack("<H", len(uri)) + uri + struct.pack("<I", len(text)) + text + values


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (V2_MAGIC + b"\x05", "header cut short"),
        (_v2({"tensors": [["t", "float32", [2]]]}, uri=b"\xff\xfe"), "not UTF-8"),
        (_v2({"tensors": [["t", "float32", [2]]]}, uri=b""), "uri"),
        (V2_MAGIC + struct.pack("<H", 1) + b"u" + struct.pack("<I", 1 << 30), "does not fit"),
        (_v2(b"{not json"), "not JSON"),
        (_v2([1, 2]), "at most 64"),
        (_v2({"tensors": [["t", "float32", [2]]] * 65}), "at most 64"),
        (_v2({"tensors": [["t", "object", [2]]]}), "number dtype"),
        (_v2({"tensors": [["t", "str", [2]]]}), "number dtype"),
        (_v2({"tensors": [[1, "float32", [2]]]}), "name, number dtype"),
        (_v2({"tensors": [["t", ["float32"], [2]]]}), "name, number dtype"),
        (_v2({"tensors": [["t", {"d": 1}, [2]]]}), "name, number dtype"),
        (_v2({"tensors": [["t", "float32", [-2]]]}), "invalid shape"),
        (_v2({"tensors": [["t", "float32", [True, 2]]]}), "invalid shape"),
        (_v2({"tensors": [["t", "float32", [1] * 17]]}), "invalid shape"),
        (_v2({"tensors": [["t", "float32", [3]]]}), "needs 12 bytes"),
        (_v2({"tensors": [["t", "float32", [1]]]}), "needs 4 bytes"),
        (_v2({"tensors": [["t", "float32", [2**31 - 1, 2**31 - 1]]]}), "needs"),
        (_v2({"tensors": [["t", "float32", [1]], ["t", "int32", [1]]]}), "more than once"),
        (_v2({"tensors": [["i", "image", [2]]]}), "'image', \\[\\]"),
        (_v2({"tensors": [["i", "image", []]]}, b"\x01\x00"), "needs 4 bytes"),
        (_v2({"tensors": [["i", "image", []]]}, struct.pack("<I", 0)), "image 'i': 0 bytes"),
        (_v2({"tensors": [["i", "image", []]]}, struct.pack("<I", 9) + b"12345678"), "image 'i': 9 bytes, the message has 8 left"),
        (_v2({"tensors": [["i", "image", []]]}, struct.pack("<I", 2**32 - 1) + b"1"), "4294967295 bytes"),
        (_v2({"tensors": [["i", "image", []]]}, struct.pack("<I", 1) + b"12"), "values end at byte"),
        (_v2({"tensors": [["i", "image", []], ["t", "float32", [1]]]}, struct.pack("<I", 2) + b"12" + b"\x00" * 2), "tensor 't': 4 bytes, the message has 2 left"),
        (_v2({"tensors": [["i", "image", []], ["j", "image", []]]}, struct.pack("<I", 2) + b"12\x00\x00"), "image 'j': its length is cut short|needs 8"),
    ],
)
def test_refuses_bad_version_2_payloads(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError, match=reason):
        decode_message(payload, LIMIT)


def test_version_2_result_fields_round_trip_and_layouts_are_shared() -> None:
    """Results of one batch share their layout bytes: a reader parses it once."""
    rows = [Message(f"r{i}", {"p": np.full(3, i, np.float32)}, batch_size=2, inference_us=7) for i in range(2)]
    payloads = [encode_message(row) for row in rows]
    layout = payloads[0][len(V2_MAGIC) + 2 + 2:-12]
    assert layout == payloads[1][len(V2_MAGIC) + 2 + 2:-12] and b'"batch_size":2' in layout
    decoded = decode_message(payloads[1], LIMIT)
    assert (decoded.uri, decoded.batch_size, decoded.inference_us) == ("r1", 2, 7)
    assert decoded.tensors["p"].tolist() == [1.0, 1.0, 1.0]


@given(model=st.text(max_size=20), inference_us=st.integers(0, 2**40), batch_size=st.integers(1, 4096),
       version=st.integers(1, 10**6))
@settings(max_examples=50, deadline=None)
def test_a_result_layout_is_the_json_of_its_fields(model: str, inference_us: int, batch_size: int, version: int) -> None:
    """A result's layout, written without a JSON encoder call per batch, reads as JSON of the
    same fields in the same order, whatever the model's name holds (quotes, non-ASCII)."""
    served = Served(batch_size=batch_size, inference_us=inference_us, model=model, model_version=version)
    payload = encode_rows(["r0"], {"p": np.zeros((1, 2), np.float32)}, served)[0]
    at = len(V2_MAGIC) + 2 + 2
    (length,) = struct.unpack_from("<I", payload, at)
    layout = payload[at + 4:at + 4 + length]
    assert layout == json.dumps({"tensors": [["p", "float32", [2]]], "batch_size": batch_size, "inference_us": inference_us,
                                 "model": model, "model_version": version}, separators=(",", ":")).encode()
    decoded = decode_message(payload, LIMIT)
    assert (decoded.batch_size, decoded.inference_us, decoded.model, decoded.model_version) == (batch_size, inference_us, model, version)


@pytest.mark.parametrize("outputs", [
    {"p": np.arange(6, dtype=np.float32).reshape(2, 3)},
    {"p": np.arange(6, dtype=np.float32).reshape(2, 3), "label": np.array([["a"], ["b"]], dtype=object)},
], ids=["numbers", "with strings"])
def test_rows_of_a_batch_say_how_they_were_served(outputs: dict[str, np.ndarray]) -> None:
    """encode_rows: every row carries the batch's size, time, model and version, whether the rows
    share a layout (numbers) or go message by message (strings)."""
    served = Served(batch_size=2, inference_us=7, model="m", model_version=3)
    decoded = [decode_message(payload, LIMIT) for payload in encode_rows(["r0", "r1"], outputs, served)]
    assert [(row.uri, row.batch_size, row.inference_us, row.model, row.model_version, row.error_code) for row in decoded] == [
        ("r0", 2, 7, "m", 3, None), ("r1", 2, 7, "m", 3, None)]
    assert decoded[1].tensors["p"].tolist() == [3.0, 4.0, 5.0]


def test_refuses_truncated_and_oversized() -> None:
    payload = encode_message(Message("u", {"t": np.ones(100, np.float32)}))
    with pytest.raises(DecodeError):
        decode_message(payload[: len(payload) // 2], LIMIT)
    with pytest.raises(DecodeError, match="exceeds the limit"):
        decode_message(payload, len(payload) - 1)


def test_non_native_byte_order_round_trips_by_value() -> None:
    big_endian = np.arange(6, dtype=">f4").reshape(2, 3)
    decoded = decode_message(encode_message(Message("u", {"t": big_endian})), LIMIT).tensors["t"]
    assert decoded.dtype == np.dtype("float32")
    np.testing.assert_array_equal(decoded, big_endian)


def test_encoding_matches_the_arrow_stream_writer() -> None:
    """The hand-assembled stream is byte for byte what pyarrow's stream writer produces."""
    payload = encode_message(Message("u", {"t": np.arange(5, dtype=np.int64)}), version=1)
    with pa.ipc.open_stream(payload) as reader:
        schema, batches = reader.schema, list(reader)
    assert write_stream(schema, batches) == payload


def _forged_sparse(indices: list[int], values: list[float], shape: str) -> bytes:
    one_row = lambda array: pa.LargeListArray.from_arrays(pa.array([0, len(array)], pa.int64()), array)  # noqa: E731
    column = pa.StructArray.from_arrays(
        [one_row(pa.array(indices, pa.int64())), one_row(pa.array(values, pa.float32()))], names=["indices", "values"]
    )
    field = pa.field("sp", column.type, metadata={"cs.dtype": "float32", "cs.shape": shape, "cs.layout": "coo"})
    schema = pa.schema([field], metadata=GOOD_META)
    return one_batch_stream(schema, [column])


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (_forged_sparse([0, 9], [1.0], "[2,5]"), "outside the shape"),
        (_forged_sparse([0, 1, 1], [1.0], "[2,5]"), "3 indices for 1 values"),
        (_forged_sparse([0, 0], [1.0], "[65536,65536]"), "once dense"),
    ],
)
def test_refuses_forged_sparse(payload: bytes, reason: str) -> None:
    assert decode_message(_forged_sparse([1, 4], [2.0], "[2,5]"), LIMIT).tensors["sp"].to_dense()[1, 4] == 2.0
    with pytest.raises(DecodeError, match=reason):
        decode_message(payload, LIMIT)


def test_refuses_names_that_are_not_utf8() -> None:
    """pyarrow reads names as UTF-8 only when asked for them, and raises UnicodeDecodeError then."""
    payload = encode_message(Message("u", {"x" * 8: np.ones(2, np.float32)}), version=1)
    with pytest.raises(DecodeError, match="a name in its schema is not UTF-8"):
        decode_message(payload.replace(b"x" * 8, b"\xff" * 8), LIMIT)


def test_result_counts_read_only_ascii_digits() -> None:
    """'²' is a digit to str.isdigit() and not a number to int()."""
    schema = pa.schema([], metadata={**GOOD_META, "cs.batch_size": "²", "cs.top_n": "3"})
    decoded = decode_message(write_stream(schema, [pa.record_batch([], schema=schema)]), LIMIT)
    assert decoded.batch_size is None and decoded.top_n == 3


def test_refuses_duplicate_tensor_names() -> None:
    """Two columns named `x` would be served with one of them silently dropped."""
    column = pa.LargeListArray.from_arrays(pa.array([0, 2], pa.int64()), FLOATS)
    field = pa.field("x", column.type, metadata={"cs.dtype": "float32", "cs.shape": "[2]"})
    schema = pa.schema([field, field], metadata=GOOD_META)
    with pytest.raises(DecodeError, match="tensor 'x' appears more than once"):
        decode_message(one_batch_stream(schema, [column, column]), LIMIT)


ZEROS = 1 << 24  # float32 values: 64 MiB once inflated, a few KB compressed


def _compressed_zeros(compression: str) -> bytes:
    column = pa.LargeListArray.from_arrays(pa.array([0, ZEROS], pa.int64()), pa.array(np.zeros(ZEROS, np.float32)))
    schema = pa.schema([pa.field("t", column.type, metadata={"cs.dtype": "float32", "cs.shape": f"[{ZEROS}]"})],
                       metadata=GOOD_META)
    return one_batch_stream(schema, [column], compression)


def _compressed_dictionary() -> bytes:
    """A dictionary batch (not part of the format) whose one value is 64 MiB of zeros."""
    column = pa.DictionaryArray.from_arrays(pa.array([0], pa.int32()), pa.array([bytes(4 * ZEROS)], pa.large_binary()))
    schema = pa.schema([pa.field("t", column.type)], metadata=GOOD_META)
    return one_batch_stream(schema, [column], "zstd")


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda: _compressed_zeros("lz4"), "compressed record batches are not part of the format"),
        (lambda: _compressed_zeros("zstd"), "compressed record batches are not part of the format"),
        (_compressed_dictionary, "got schema, dictionary, record batch"),
    ],
    ids=["lz4", "zstd", "zstd-dictionary"],
)
def test_refuses_compression_before_inflating(build: Callable[[], bytes], reason: str) -> None:
    """A few KB of LZ4/ZSTD would be 64 MiB once inflated, past any limit checked after reading."""
    payload = build()
    assert len(payload) < 300_000
    started = time.perf_counter()

    def decode() -> None:
        with pytest.raises(DecodeError, match=reason):
            decode_message(payload, LIMIT)

    assert peak_rss_growth_mb(decode) < 32
    assert time.perf_counter() - started < 1


def _patched_batch(
    batch: pa.RecordBatch, nodes: dict[int, int], buffers: dict[int, int], offsets: dict[int, int]
) -> bytes:
    """The batch's IPC message with field node lengths, buffer descriptors (made copies of another
    one) and last list offsets changed in place: what no Arrow writer produces."""
    message = pa.ipc.read_message(batch.serialize())
    metadata, body = bytearray(message.metadata.to_pybytes()), bytearray(message.body.to_pybytes())
    header = _table(metadata, _field(metadata, _table(metadata, 0), 2))
    node_vector, buffer_vector = (_table(metadata, _field(metadata, header, i)) + 4 for i in (1, 2))
    for node, length in nodes.items():
        struct.pack_into("<q", metadata, node_vector + 16 * node, length)
    for target, source in buffers.items():
        metadata[buffer_vector + 16 * target: buffer_vector + 16 * target + 16] = \
            metadata[buffer_vector + 16 * source: buffer_vector + 16 * source + 16]
    for buffer, last in offsets.items():
        start = struct.unpack_from("<q", metadata, buffer_vector + 16 * buffer)[0]
        struct.pack_into("<q", body, start + 8, last)
    return b"\xff\xff\xff\xff" + struct.pack("<i", len(metadata)) + bytes(metadata) + bytes(body)


def test_refuses_buffers_that_overlap_past_the_limit() -> None:
    """Uncompressed columns can still decode to more than the wire holds: buffer descriptors may
    point at the same bytes. Here columns b and c are one value on the wire and views of a's
    million once decoded (nodes: a, a.item, b, b.item, ...; buffers: validity and offsets or data)."""
    size = 1 << 20
    one_row = lambda values: pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), values)  # noqa: E731
    columns = [one_row(pa.array(np.ones(size, np.float32))), one_row(FLOATS[:1]), one_row(FLOATS[:1])]
    meta = {"cs.dtype": "float32", "cs.shape": f"[{size}]"}
    schema = pa.schema([pa.field(name, columns[0].type, metadata=meta) for name in "abc"], metadata=GOOD_META)
    batch = _patched_batch(pa.record_batch(columns, schema=schema), nodes={3: size, 5: size},
                           buffers={7: 3, 11: 3}, offsets={5: size, 9: size})
    payload = schema.serialize().to_pybytes() + batch + END_OF_STREAM
    limit = len(payload) + 4096
    with pytest.raises(DecodeError, match=f"bytes once decoded, over the limit of {limit}"):
        decode_message(payload, limit)
    assert decode_message(payload, 4 * limit).tensors["c"].size == size  # within a limit, views are fine
