"""Arrow IPC streams written by hand, for the tests and the fuzz corpus: what encode_message never
writes (forged metadata, compressed bodies, a name twice, several batches)."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa


def write_stream(schema: pa.Schema, batches: Iterable[pa.RecordBatch], compression: str | None = None) -> bytes:
    """The stream pyarrow's writer makes of `batches`, with body compression when asked."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def one_batch_stream(schema: pa.Schema, columns: list[pa.Array], compression: str | None = None) -> bytes:
    """A stream of one record batch of `columns`."""
    return write_stream(schema, [pa.record_batch(columns, schema=schema)], compression)
