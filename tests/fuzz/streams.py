"""Structure-aware Arrow streams for the `message` fuzz target: the fuzz input read as a series of
choices (schema metadata, column types, list offsets, nulls, several batches, compression) that
build an IPC stream, which reaches the codec's checks that raw-byte mutation of the framing rarely
gets past."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from cluster_serving.wire.codec import MAX_URI_CHARS


class Reader:
    """Reads choices off the fuzz input, front to back; past its end every read gives 0 / empty.

    A tiny FuzzedDataProvider that needs no atheris, so pytest can replay the same inputs."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def pick(self, options: list | tuple):
        return options[self.byte() % len(options)]

    def int_in(self, low: int, high: int) -> int:
        span = high - low + 1
        value = int.from_bytes(bytes(self.byte() for _ in range(4 if span > 65536 else 2)), "little")
        return low + value % span

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def text(self, max_len: int) -> str:
        return self.take(self.int_in(0, max_len)).decode("utf-8", errors="replace")


NUMERIC = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "float32", "float64")
DTYPE_NAMES = (*NUMERIC, "str", "image", "object", "float128", "complex64", "", "<f4", "O", "S1", "V8")
LAYOUTS = (None, "coo", "COO", "csr", "")
COMPRESSION = (None, None, "lz4", "zstd")
URIS = ("u", "req-1", "", "x" * MAX_URI_CHARS, "x" * (MAX_URI_CHARS + 1), "\udcff", "é" * 600)


def _arrow_values(r: Reader, kind: str, count: int) -> pa.Array:
    """`count` values of the Arrow type that `kind` says, some of them maybe null."""
    nulls = r.byte() % 8 == 0
    mask = np.array([r.byte() % 4 == 0 for _ in range(count)], bool) if nulls and count else None
    if kind == "str":
        values = pa.array([r.text(8) for _ in range(count)], pa.large_string(), mask=mask)
    elif kind in ("binary", "image"):
        values = pa.array([r.take(r.int_in(0, 64)) for _ in range(count)], pa.large_binary(), mask=mask)
    elif kind == "string":  # not large: a type the codec must refuse
        values = pa.array([r.text(4) for _ in range(count)], pa.string(), mask=mask)
    else:
        dtype = np.dtype(kind)
        raw = r.take(count * dtype.itemsize).ljust(count * dtype.itemsize, b"\0")
        array = np.frombuffer(raw, dtype=dtype) if kind != "bool" else np.frombuffer(raw, np.uint8) % 2 == 1
        values = pa.array(array, mask=mask)
    return values


def _column(r: Reader, rows: int) -> tuple[pa.Array, dict[str, str]]:
    """A column of `rows` rows and the field metadata that would describe it honestly: mostly a
    large_list<T> dense tensor, else a sparse struct, an image, or a type the codec must refuse."""
    kind = r.byte() % 16
    if kind == 0:  # a flat column
        return _arrow_values(r, r.pick(NUMERIC), rows), {"cs.dtype": "float32", "cs.shape": "[1]"}
    if kind in (1, 2, 3):  # a COO sparse tensor
        return _sparse_column(r, rows)
    if kind == 4:  # an encoded image
        column, _ = _list_column(r, rows, "image")
        return column, {"cs.dtype": "image", "cs.shape": "[]"}
    element = r.pick((*NUMERIC, "str", "str", "binary", "string"))
    column, count = _list_column(r, rows, element)
    if kind == 5:  # a list<T> instead of large_list<T>
        column = pa.ListArray.from_arrays(pa.array(column.offsets.to_numpy().astype(np.int32)), column.values)
    return column, {"cs.dtype": element, "cs.shape": json.dumps(_factor(r, count))}


def _factor(r: Reader, count: int) -> list[int]:
    """A shape with `count` elements: [count], [1, count], [a, b] or [] for a scalar."""
    choice = r.byte() % 4
    if choice == 0 and count == 1:
        return []
    if choice == 1:
        return [1, count]
    if choice == 2 and count:
        first = next(d for d in range(2, count + 1) if count % d == 0) if count > 1 else 1
        return [first, count // first]
    return [count]


def _sparse_column(r: Reader, rows: int) -> tuple[pa.Array, dict[str, str]]:
    rank, nnz, dim = r.int_in(0, 3), r.int_in(0, 6), r.int_in(1, 8)
    element = r.pick(NUMERIC)
    index_values = [[r.byte() % (dim + 1) for _ in range(rank * nnz)] for _ in range(rows)]
    indices = pa.LargeListArray.from_arrays(
        pa.array(np.cumsum([0, *map(len, index_values)]).astype(np.int64)),
        pa.array([i for row in index_values for i in row], pa.int64()))
    values = _arrow_values(r, element, nnz * rows)
    values = pa.LargeListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int64) * nnz), values)
    names = r.pick((["indices", "values"], ["indices", "values"], ["indices", "values"], ["values", "indices"], ["i", "v"]))
    column = pa.StructArray.from_arrays([indices, values], names=names)
    return column, {"cs.dtype": element, "cs.shape": json.dumps([dim] * rank), "cs.layout": "coo"}


def _list_column(r: Reader, rows: int, element: str) -> tuple[pa.Array, int]:
    """A large_list column of `rows` rows over values that may reach past them (nonzero offsets);
    also returns the first row's length."""
    lengths = [r.int_in(0, 40) for _ in range(rows)]
    lead, tail = r.byte() % 4, r.byte() % 4
    values = _arrow_values(r, element, lead + sum(lengths) + tail)
    offsets = np.cumsum([lead, *lengths]).astype(np.int64)
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    if r.byte() % 6 == 0 and rows:  # a slice: the column itself has an offset
        padded = pa.LargeListArray.from_arrays(pa.array(np.concatenate([[0], offsets])), values)
        column = padded.slice(1, rows)
    return column, lengths[0] if lengths else 0


def _metadata_value(r: Reader, options: tuple) -> str | None:
    """Mostly options[0] (the usual value, or None: absent), else another option, absent, or text."""
    choice = r.byte()
    if choice < 160:
        return options[0]
    choice %= len(options) + 1
    if choice < len(options):
        return options[choice]
    return None if choice % 2 else r.text(16)


SHAPES = ("[]", "", "null", "{}", "[1.5]", "[true]", "[-1]", "[2147483648]", "[[1]]", '["1"]',
          "[" + ",".join(["1"] * 17) + "]", "[1e3]", "[0]", "[NaN]", "[2147483647,2147483647]")


def build_stream(data: bytes) -> bytes:
    """An Arrow IPC stream whose schema, metadata, columns and framing the input chooses."""
    r = Reader(data)
    meta: dict[str, str] = {}
    for key, options in (
        ("cs.version", ("1", "2", "", "01")),
        ("cs.uri", URIS),
        ("cs.error", (None, "boom", "")),
        ("cs.batch_size", (None, "3", "-1", "1" * 19, "٣", "²", "")),
        ("cs.inference_us", (None, "12", "x")),
        ("cs.top_n", (None, "5", "0")),
    ):
        value = _metadata_value(r, options)
        if value is not None:
            meta[key] = value
    rows = r.pick((1, 1, 1, 1, 1, 1, 0, 2))
    fields, columns = [], []
    for _ in range(r.pick((1, 1, 2, 3, 0))):
        column, honest = _column(r, rows)
        field_meta = {}
        for key, options in (("cs.dtype", DTYPE_NAMES), ("cs.shape", SHAPES), ("cs.layout", LAYOUTS)):
            value = _metadata_value(r, (honest.get(key), *options))  # mostly the honest value
            if value is not None:
                field_meta[key] = value
        fields.append(pa.field(r.pick(("x", "y", "image", "x", r.text(4))), column.type, metadata=field_meta))
        columns.append(column)
    schema = pa.schema(fields, metadata={k: v.encode("utf-8", "surrogatepass") for k, v in meta.items()})
    batch = pa.record_batch(columns, schema=schema) if columns else pa.record_batch([], schema=schema)
    options = pa.ipc.IpcWriteOptions(compression=r.pick(COMPRESSION))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=options) as writer:
        for _ in range(r.pick((1, 1, 1, 1, 1, 1, 0, 2))):
            writer.write_batch(batch)
    stream = sink.getvalue().to_pybytes()
    damage = r.byte() % 16
    if damage == 1 and stream:  # flip one byte
        at = r.int_in(0, len(stream) - 1)
        stream = stream[:at] + bytes([stream[at] ^ (r.byte() or 1)]) + stream[at + 1:]
    elif damage == 2:  # truncate
        stream = stream[: r.int_in(0, len(stream))]
    return stream
