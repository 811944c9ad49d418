"""The batcher's routes: frames with a header (cluster_serving/runtime/frames.py), the JVM routing table parser
(RoutingTable.java), and MicroBatchOperator in a small bounded Flink job: one batch per
(model, version), each model's batch size and delay, control records, the first control frame."""

from __future__ import annotations

import struct

import pytest

from cluster_serving.wire.codec import MAX_URI_CHARS

from cluster_serving.runtime.frames import (
    ALIKE,
    BATCH,
    CONTROL,
    DRAIN,
    NO_URI,
    POLL,
    Frame,
    FrameError,
    Source,
    read_frame,
    read_headers,
    write_batch_frame,
    write_control_frame,
    write_frame,
    write_headers,
    write_signal_frame,
)

U32 = struct.Struct("<I")
# The source of a request read from an unknown place, without headers (frames.py's sources block).
UNKNOWN_SOURCE = struct.pack("<iqI", -1, -1, NO_URI)


def table(generation: int, default: str, *entries: tuple[str, int, int, str]) -> str:
    lines = [f"{generation}\t{default}"] + ["\t".join(map(str, entry)) for entry in entries]
    return "\n".join(lines)


def by_hand(header: bytes, records: list[tuple[bytes | None, bytes]], sources: bytes | None = None) -> bytes:
    parts = [U32.pack(len(header)), header, U32.pack(len(records))]
    for uri, payload in records:
        parts += [U32.pack(NO_URI) if uri is None else U32.pack(len(uri)) + uri, U32.pack(len(payload)), payload]
    parts.append(UNKNOWN_SOURCE * len(records) if sources is None else sources)
    return b"".join(parts)


def plain(frame: Frame) -> tuple:
    return frame.kind, frame.model, frame.version, frame.table, [(uri, bytes(p)) for uri, p in frame.records]


# --- frames, pure Python ------------------------------------------------------------------------


def test_batch_frame_with_route() -> None:
    frame = read_frame(by_hand("Bmodèle\t3".encode(), [(b"u-1", b"\x00\x01"), (None, b""), ("ü".encode(), b"x")]))
    assert plain(frame) == (BATCH, "modèle", "3", None, [("u-1", b"\x00\x01"), (None, b""), ("ü", b"x")])
    assert not frame.is_control
    assert isinstance(frame.records[0][1], memoryview)


def test_batch_frame_without_model_or_version() -> None:
    assert plain(read_frame(by_hand(b"B\t", [(b"a", b"1")]))) == (BATCH, "", "", None, [("a", b"1")])
    assert plain(read_frame(by_hand(b"Bm\t", []))) == (BATCH, "m", "", None, [])


def test_a_tab_in_a_header_value_splits_at_the_last() -> None:
    assert (read_frame(by_hand(b"Ba\tb\t", [])).model, read_frame(by_hand(b"Ba\tb\t", [])).version) == ("a\tb", "")


def test_control_frame() -> None:
    text = table(1700000000000, "a", ("a", 8, 5, "1,2"), ("b", 1, 0, ""))
    frame = read_frame(by_hand(b"C" + text.encode(), []))
    assert plain(frame) == (CONTROL, "", "", text, [])
    assert frame.is_control


def test_python_writers_match_the_layout() -> None:
    records = [("u", b"p"), (None, b"")]
    assert write_batch_frame("m", "2", records) == by_hand(b"Bm\t2", [(b"u", b"p"), (None, b"")])
    assert write_control_frame("1\ta\na\t1\t0\t") == by_hand(b"C1\ta\na\t1\t0\t", [])
    assert write_signal_frame(POLL) == by_hand(b"P", []) and write_signal_frame(DRAIN) == by_hand(b"D", [])
    # Results: the request frames answered, no header, no sources, the dead letters' count.
    assert write_frame([("u", b"p")], answered=[3, 2**40]) == (
        U32.pack(2) + struct.pack("<qq", 3, 2**40) + by_hand(b"", [(b"u", b"p")], sources=b"")[4:] + U32.pack(0))


@pytest.mark.parametrize("kind,letter", [(POLL, b"P"), (DRAIN, b"D")])
def test_poll_and_drain_frames(kind: str, letter: bytes) -> None:
    assert plain(read_frame(by_hand(letter, []))) == (kind, "", "", None, [])
    with pytest.raises(FrameError, match=f"a {kind} frame carries 1 records"):
        read_frame(by_hand(letter, [(b"a", b"1")]))


def test_sources_and_their_headers() -> None:
    block = write_headers([("deadline-ms", b"123"), ("trace", None), ("ü", b"")])
    assert block == (U32.pack(3) + U32.pack(11) + b"deadline-ms" + U32.pack(3) + b"123" + U32.pack(5) + b"trace"
                     + U32.pack(NO_URI) + U32.pack(2) + "ü".encode() + U32.pack(0))
    assert read_headers(block) == [("deadline-ms", b"123"), ("trace", None), ("ü", b"")]
    sources = struct.pack("<iqI", 3, 2**40, len(block)) + block + UNKNOWN_SOURCE
    frame = read_frame(by_hand(b"Bm\t", [(b"a", b"1"), (None, b"")], sources))
    assert frame.sources == [Source(3, 2**40, block), Source()]
    assert write_batch_frame("m", "", [("a", b"1"), (None, b"")], [Source(3, 2**40, block), Source()]) == by_hand(
        b"Bm\t", [(b"a", b"1"), (None, b"")], sources)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x01\x00",
        U32.pack(10) + b"Bm\t",  # header past the end
        by_hand(b"Xm\t1", []),  # unknown kind
        by_hand(b"", []),  # empty header
        by_hand(b"Bmodel", []),  # batch header without a tab
        by_hand(b"C1\ta", [(b"u", b"p")]),  # control frame with records
        by_hand(b"B\xff\t", []),  # header not UTF-8
        by_hand(b"B\t", [(b"u", b"p")])[:-1],  # source cut short
        by_hand(b"B\t", [(b"u", b"p")], b""),  # no sources
        by_hand(b"B\t", [(b"u", b"p")]) + b"!",  # trailing bytes
        by_hand(b"B\t", [])[:-4] + U32.pack(1) + U32.pack(99) + b"u",  # uri past the end
    ],
)
def test_malformed_frames_raise_frame_error(frame: bytes) -> None:
    with pytest.raises(FrameError):
        read_frame(frame)


# --- the JVM side -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env():
    from pyflink.datastream import StreamExecutionEnvironment

    from cluster_serving.config import defaults
    from cluster_serving.jvm import pipeline_jars

    environment = StreamExecutionEnvironment.get_execution_environment()
    environment.add_jars(*(jar.as_uri() for jar in pipeline_jars(defaults().flink)))
    environment.set_parallelism(1)
    return environment


@pytest.fixture(scope="module")
def jvm(env):
    from pyflink.java_gateway import get_gateway

    return get_gateway().jvm.clusterserving.flink


def test_routing_table_parse(jvm) -> None:
    from py4j.java_gateway import get_field

    parsed = jvm.RoutingTable.parse(table(1700000000000, "b", ("a", 8, 5, "1,2,10"), ("b", 1, 0, "")) + "\n")
    assert get_field(parsed, "generation") == 1700000000000
    assert get_field(parsed, "defaultModel") == "b"
    assert list(get_field(parsed, "entries").keySet()) == ["a", "b"]

    def entry(model):
        found = parsed.entryFor(model)
        return get_field(found, "batchSize"), get_field(found, "maxDelayMs"), list(get_field(found, "versions"))

    assert entry("a") == (8, 5, [1, 2, 10])
    assert entry("b") == (1, 0, [])
    assert entry("") == entry("nope") == entry(None) == (1, 0, [])  # batch as the default model


@pytest.mark.parametrize(
    "text",
    [
        "",
        "garbage",
        "1\ta",  # the default model has no line
        "0\ta\na\t1\t0\t",  # generation not positive
        "x\ta\na\t1\t0\t",
        "1\ta\na\t0\t0\t",  # batch_size below 1
        "1\ta\na\t65537\t0\t",
        "1\ta\na\t1\t60001\t",  # max_delay_ms above 60 s
        "1\ta\na\t1\t-1\t",
        "1\ta\na\t1\t0",  # 3 fields
        "1\ta\na\t1\t0\t2,1",  # versions not ascending
        "1\ta\na\t1\t0\t1,,2",
        "1\ta\na\t1\t0\t\na\t2\t0\t",  # a model twice
        "1\ta b\na b\t1\t0\t",  # not a model name
        "1\ta\na\t1\t0\t\n\n",  # an empty line
        "99999999999999999999\ta\na\t1\t0\t",  # generation past int64
    ],
)
def test_routing_table_rejects_malformed_text(jvm, text: str) -> None:
    from py4j.protocol import Py4JJavaError

    with pytest.raises(Py4JJavaError, match="IllegalArgumentException"):
        jvm.RoutingTable.parse(text)


def test_jvm_frames_read_in_python(jvm) -> None:
    from pyflink.java_gateway import get_gateway

    gateway = get_gateway()
    rows = gateway.jvm.java.util.ArrayList()
    for uri, payload in [("u-1", b"\x00\xff"), (None, b"")]:
        fields = gateway.new_array(gateway.jvm.Object, 2)
        fields[0], fields[1] = uri, bytearray(payload)
        rows.add(gateway.jvm.org.apache.flink.types.Row.of(fields))
    batch = read_frame(bytes(jvm.BatchFrames.encodeBatch("m", "", rows, MAX_URI_CHARS, 1 << 20)))
    assert plain(batch) == (BATCH, "m", "", None, [("u-1", b"\x00\xff"), (None, b"")])
    assert plain(read_frame(bytes(jvm.BatchFrames.encodeControl("1\tm\nm\t1\t0\t")))) == (
        CONTROL, "", "", "1\tm\nm\t1\t0\t", [],
    )
    assert plain(read_frame(bytes(jvm.BatchFrames.encodeSignal("P")))) == (POLL, "", "", None, [])
    assert list(jvm.BatchFrames.answered(write_frame([("u", b"p")], answered=[7, 9]))) == [7, 9]


def test_operator_rejects_a_malformed_table(jvm) -> None:
    from py4j.protocol import Py4JJavaError

    with pytest.raises(Py4JJavaError, match="IllegalArgumentException"):
        jvm.MicroBatchOperator("not a table", 1000, MAX_URI_CHARS, 1 << 20, 1, 0)


def test_batches_per_route_and_control_records(env) -> None:
    from pyflink.common import Row

    from cluster_serving.job.batch import REQUEST_ROW, micro_batches

    first = table(100, "a", ("a", 2, 60000, "1"), ("b", 3, 60000, "1"), ("c", 1, 60000, "1"), ("d", 9, 60000, "1"))
    second = table(200, "a", ("a", 1, 0, "1,2"), ("b", 3, 60000, "1"))

    offsets = iter(range(1000))

    def request(uri, model, version=None, payload=b"x"):
        return Row(uri, payload, model, version, False, 2, next(offsets), b"headers of " + (uri or "-").encode())

    def control(text: str | bytes):
        return Row(None, text if isinstance(text, bytes) else text.encode(), None, None, True, 0, next(offsets), None)

    rows = [
        request("a1", "a"),
        request("b1", "b"),
        request("a2", "a"),  # a is full at 2
        request("a3", "a", "2"),  # another route of a
        request(None, "zzz"),  # unknown model: batches as the default, on a route of its own
        request("c1", "c"),  # batch size 1: at once (max_delay_ms 0 is tested in a running job: test_batching)
        request("d1", "d", payload=b"y" * 1000),  # max_batch_bytes: at once
        control(b"\xffgarbage"),  # malformed: ignored
        control(table(50, "a", ("a", 1, 0, ""))),  # older: ignored
        request("b2", "b"),
        control(second),  # flushes b, a/2, zzz in that order, then announces the table
        control(second),  # the same generation again (another partition's marker): ignored
        request("a4", "a"),  # batch size 1 now
        request("b3", "b"),
        request("n1", None),  # no model header: the default's batching (a: batches of one), route ""
        request("b4", "b", "1"),
        # end of input: what waits is flushed, b before b/1
    ]
    requests = env.from_collection(rows, type_info=REQUEST_ROW)
    frames = micro_batches(requests, first, 1 << 20, max_batch_bytes=1000, max_joined_batches=1)
    seen, sources = [], {}
    with frames.execute_and_collect("batcher-routes") as results:
        for frame in results:
            parsed = read_frame(bytes(b & 0xFF for b in frame))  # Java byte[]: signed ints
            sources.update(zip((uri for uri, _ in parsed.records), parsed.sources))
            seen.append(
                ("C", parsed.table) if parsed.is_control else (parsed.kind,) if parsed.kind in (POLL, DRAIN)
                else (parsed.model, parsed.version, [uri for uri, _ in parsed.records])
            )
    assert seen == [
        ("C", first),
        ("a", "", ["a1", "a2"]),
        ("c", "", ["c1"]),
        ("d", "", ["d1"]),
        ("b", "", ["b1", "b2"]),
        ("a", "2", ["a3"]),
        ("zzz", "", [None]),
        ("C", second),
        ("a", "", ["a4"]),
        ("", "", ["n1"]),
        ("b", "", ["b3"]),
        ("b", "1", ["b4"]),
        (DRAIN,),  # the end of the input: Python answers whatever it holds
    ]
    assert sources == {row[0]: Source(2, row[6], row[7]) for row in rows if not row[4]}


def test_full_batches_ready_at_once_share_a_frame(env) -> None:
    """With max_delay_ms 0, more than a batch of alike requests read back to back goes as one "A"
    frame (at most MAX_JOINED_BATCHES full batches), the last batch partial where they do not fill
    it; requests that are not alike never share a frame beyond batch_size."""
    import numpy as np
    from pyflink.common import Row

    from cluster_serving.job.batch import MAX_JOINED_BATCHES, REQUEST_ROW, micro_batches
    from cluster_serving.wire.codec import Message, encode_message

    routes = table(100, "a", ("a", 2, 0, "1"), ("b", 2, 0, "1"))
    alike = [Row(f"a{i}", encode_message(Message(f"a{i}", {"x": np.full(4, i, np.float32)})), "a", None, False, 0, i, None)
             for i in range(69)]
    other = [Row(f"b{i}", b"x" * (i + 1), "b", None, False, 0, 100 + i, None) for i in range(9)]
    requests = env.from_collection(alike + other, type_info=REQUEST_ROW)
    frames = []
    with micro_batches(requests, routes, 1 << 20).execute_and_collect("joined-batches") as results:
        for frame in results:
            parsed = read_frame(bytes(b & 0xFF for b in frame))
            if not parsed.is_control and parsed.kind not in (POLL, DRAIN):
                uris = list(parsed.alike.uris) if parsed.alike is not None else [uri for uri, _ in parsed.records]
                frames.append((parsed.model, parsed.kind, uris))
    assert [uri for model, _, uris in frames if model == "a" for uri in uris] == [f"a{i}" for i in range(69)]
    assert [uri for model, _, uris in frames if model == "b" for uri in uris] == [f"b{i}" for i in range(9)]
    joined = [len(uris) for model, kind, uris in frames if len(uris) > 2]
    assert joined, "no batches were joined"
    for model, kind, uris in frames:
        assert len(uris) <= 2 or (model, kind) == ("a", ALIKE) and len(uris) <= 2 * MAX_JOINED_BATCHES


def test_python_table_text_parses_in_the_jvm(jvm) -> None:
    from py4j.java_gateway import get_field

    from cluster_serving.runtime.repository import RoutingTable, TableEntry

    python = RoutingTable(1700000000123, "b", {"a": TableEntry(8, 5, (1, 3)), "b": TableEntry(1, 0, ())})
    parsed = jvm.RoutingTable.parse(python.text())
    assert (get_field(parsed, "generation"), get_field(parsed, "defaultModel")) == (1700000000123, "b")
    for name, entry in python.entries.items():
        found = parsed.entryFor(name)
        assert (get_field(found, "batchSize"), get_field(found, "maxDelayMs"), tuple(get_field(found, "versions"))) == (
            entry.batch_size, entry.max_delay_ms, entry.versions,
        )
    assert RoutingTable.parse(get_field(parsed, "text")) == python
