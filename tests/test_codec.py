"""The wire format: exact round trips for every dtype, and refusals for everything else."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from connectors.codec import (
    NUMERIC_DTYPES,
    DecodeError,
    EncodedImage,
    Message,
    SparseTensor,
    decode_message,
    encode_message,
)

LIMIT = 1 << 24


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(sorted(NUMERIC_DTYPES)),
    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
    data=st.data(),
)
def test_numeric_round_trip_is_exact(dtype: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    array = data.draw(hnp.arrays(np.dtype(dtype), shape))
    decoded = decode_message(encode_message(Message("uri-1", {"t": array})), LIMIT)
    assert decoded.uri == "uri-1"
    out = decoded.tensors["t"]
    assert out.dtype == array.dtype and out.shape == array.shape
    assert out.tobytes() == array.tobytes()  # bit-exact, NaNs included


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
    with pytest.raises(DecodeError, match="once dense, over the limit"):
        decode_message(payload, LIMIT)


def test_result_fields_round_trip() -> None:
    message = Message("u", {"p": np.arange(3, dtype=np.float32)}, batch_size=32)
    decoded = decode_message(encode_message(message), LIMIT)
    assert decoded.batch_size == 32 and decoded.error is None
    error = decode_message(encode_message(Message("u", error="boom")), LIMIT)
    assert error.error == "boom" and error.tensors == {}


def test_refuses_unsupported_dtype_on_encode() -> None:
    with pytest.raises(ValueError, match="not supported"):
        encode_message(Message("u", {"c": np.zeros(2, dtype=np.complex64)}))


def _forged(metadata: dict[str, str], field_meta: dict[str, str], values: pa.Array) -> bytes:
    """A message built by hand, to check what the decoder refuses."""
    column = pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), values)
    schema = pa.schema([pa.field("t", column.type, metadata=field_meta)], metadata=metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch([column], schema=schema))
    return sink.getvalue().to_pybytes()


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
    payload = encode_message(Message("u", {"t": np.arange(5, dtype=np.int64)}))
    with pa.ipc.open_stream(payload) as reader:
        schema, batches = reader.schema, list(reader)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    assert sink.getvalue().to_pybytes() == payload


def _forged_sparse(indices: list[int], values: list[float], shape: str) -> bytes:
    one_row = lambda array: pa.LargeListArray.from_arrays(pa.array([0, len(array)], pa.int64()), array)  # noqa: E731
    column = pa.StructArray.from_arrays(
        [one_row(pa.array(indices, pa.int64())), one_row(pa.array(values, pa.float32()))], names=["indices", "values"]
    )
    field = pa.field("sp", column.type, metadata={"cs.dtype": "float32", "cs.shape": shape, "cs.layout": "coo"})
    schema = pa.schema([field], metadata=GOOD_META)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch([column], schema=schema))
    return sink.getvalue().to_pybytes()


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
