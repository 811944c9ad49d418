"""1,000 corrupt or adversarial records interleaved with 1,000 valid requests on the input topic of
a running job: every valid request gets its correct result, every corrupt record with a uri gets
an error result, records without one are counted, the job never restarts and its memory stays
within MEMORY_BOUND_MB. The kinds include decompression-bomb image headers (PNG, JPEG, also past
Pillow's own limit), zstd-compressed Arrow that would inflate to 256 MiB, a tensor name given
twice and casts across dtype kinds."""

from __future__ import annotations

import functools
import io
import json
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import pyarrow as pa
from kafka import KafkaProducer
from PIL import Image

from cluster_serving.client import OutputQueue
from cluster_serving.ops.children import EmbeddedJob
from cluster_serving.ops.processes import group_rss_mb
from cluster_serving.ops.sample_model import FEATURES
from cluster_serving.wire.codec import EncodedImage, Message, SparseTensor, encode_message
from cluster_serving.wire.inputs import encode_request
from tests.arrow_streams import one_batch_stream
from tests.forged_images import jpeg_header, png_header

VALID = 1000
CORRUPT = 1000
MAX_INSTANCE_BYTES = 65536
MAX_IMAGE_PIXELS = 10_000
COMPRESSED_BYTES = 256 * 2**20  # what one zstd record inflates to, were it inflated
# The job's memory (its Python and JVM) may grow this much over the run; one inflated zstd record
# alone would be COMPRESSED_BYTES.
MEMORY_BOUND_MB = 200


def forged(uri: str, version: str = "1", dtype: str = "float32", shape: str = f"[{FEATURES}]",
           values: int = FEATURES) -> bytes:
    """A hand-built Arrow stream, to say what no honest encoder would."""
    column = pa.LargeListArray.from_arrays(pa.array([0, values], pa.int64()), pa.array(np.ones(values, np.float32)))
    field = pa.field("features", column.type, metadata={"cs.dtype": dtype, "cs.shape": shape})
    schema = pa.schema([field], metadata={"cs.version": version, "cs.uri": uri})
    return one_batch_stream(schema, [column])


def big_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (200, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


@functools.cache
def compressed_zeros() -> tuple[pa.Field, pa.Array]:
    """COMPRESSED_BYTES of float32 zeros, the column a zstd bomb carries."""
    column = pa.LargeListArray.from_arrays(pa.array([0, COMPRESSED_BYTES // 4], pa.int64()),
                                          pa.array(np.zeros(COMPRESSED_BYTES // 4, np.float32)))
    field = pa.field("features", column.type, metadata={"cs.dtype": "float32", "cs.shape": f"[{COMPRESSED_BYTES // 4}]"})
    return field, column


def compressed(uri: str) -> bytes:
    """A few KB on the wire, COMPRESSED_BYTES once inflated."""
    field, column = compressed_zeros()
    schema = pa.schema([field], metadata={"cs.version": "1", "cs.uri": uri})
    return one_batch_stream(schema, [column], "zstd")


def duplicate_names(uri: str) -> bytes:
    """Two tensors named `features`: which one would be served?"""
    column = pa.LargeListArray.from_arrays(pa.array([0, FEATURES], pa.int64()), pa.array(np.ones(FEATURES, np.float32)))
    field = pa.field("features", column.type, metadata={"cs.dtype": "float32", "cs.shape": f"[{FEATURES}]"})
    schema = pa.schema([field, field], metadata={"cs.version": "1", "cs.uri": uri})
    return one_batch_stream(schema, [column, column])


def valid(uri: str) -> bytes:
    return encode_request(uri, {"features": np.ones(FEATURES, np.float32)})


# Each kind: (uri -> record value, the start of the error result it must get).
CORRUPTIONS: dict[str, tuple[Callable[[str], bytes], str]] = {
    "garbage bytes": (lambda uri: np.random.default_rng(len(uri)).bytes(300), "bad request: not a cluster-serving message"),
    "truncated": (lambda uri: valid(uri)[:-10], "bad request"),
    "empty": (lambda uri: b"", "bad request: not a cluster-serving message"),
    "unknown version": (lambda uri: forged(uri, version="99"), "bad request: unsupported format version"),
    "dtype not allowed": (lambda uri: forged(uri, dtype="object"), "bad request: tensor 'features': dtype 'object' is not allowed"),
    "shape does not match payload": (lambda uri: forged(uri, shape="[4096,4096]"), "bad request: tensor 'features': 16 values do not fill"),
    "over max_instance_bytes": (
        lambda uri: encode_request(uri, {"features": np.ones(MAX_INSTANCE_BYTES // 4, np.float32)}), "bad request: message of"),
    "sparse bomb": (
        lambda uri: encode_message(Message(uri, {"features": SparseTensor(np.array([[0, 0]]), np.ones(1, np.float32), (2**20, 2**20))})),
        "bad request: sparse tensor 'features'"),
    "record key is not the uri": (lambda uri: valid("someone-else"), "bad request: the record key is not the payload's uri"),
    "wrong dtype for the model": (lambda uri: encode_request(uri, {"features": ["a"] * FEATURES}), "invalid input: input 'features': expects float32"),
    "wrong shape for the model": (lambda uri: encode_request(uri, {"features": np.ones(FEATURES + 1, np.float32)}), "invalid input: input 'features': shape"),
    "missing input": (lambda uri: encode_request(uri, {"pixels": np.ones(FEATURES, np.float32)}), "invalid input: unknown input 'pixels'"),
    "image that does not decode": (lambda uri: encode_request(uri, {"features": EncodedImage(b"\x89PNG not really")}), "invalid input: image 'features' does not decode"),
    "image over max_image_pixels": (lambda uri: encode_request(uri, {"features": EncodedImage(big_png())}), "invalid input: image 'features': 200x200 pixels"),
    "PNG bomb header": (lambda uri: encode_request(uri, {"features": EncodedImage(png_header(20000, 20000))}),
                        "invalid input: image 'features': 20000x20000 pixels, over the limit"),
    "PNG bomb over Pillow's own limit": (lambda uri: encode_request(uri, {"features": EncodedImage(png_header(65535, 65535))}),
                                         "invalid input: image 'features': 65535x65535 pixels, over the limit"),
    "JPEG bomb header": (lambda uri: encode_request(uri, {"features": EncodedImage(jpeg_header(65000, 65000))}),
                         "invalid input: image 'features': 65000x65000 pixels, over the limit"),
    "zstd-compressed Arrow": (compressed, "bad request: compressed record batches are not part of the format"),
    "tensor name twice": (duplicate_names, "bad request: tensor 'features' appears more than once"),
    "int32 for a float32 input": (lambda uri: encode_request(uri, {"features": np.ones(FEATURES, np.int32)}),
                                  "invalid input: input 'features': expects float32, got int32"),
    "bool for a float32 input": (lambda uri: encode_request(uri, {"features": np.ones(FEATURES, bool)}),
                                 "invalid input: input 'features': expects float32, got bool"),
    "uint64 for a float32 input": (lambda uri: encode_request(uri, {"features": np.ones(FEATURES, np.uint64)}),
                                   "invalid input: input 'features': expects float32, got uint64"),
    "int32 for a float32 input, format v1": (
        lambda uri: encode_message(Message(uri, {"features": np.ones(FEATURES, np.int32)}), version=1),
        "invalid input: input 'features': expects float32, got int32"),
    "sparse int64 values for a float32 input": (
        lambda uri: encode_request(uri, {"features": [np.array([[0, 5]]), np.array([1, 2]), np.array([FEATURES])]}),
        "invalid input: input 'features': expects float32, got int64"),
    "text as an image": (lambda uri: encode_request(uri, {"features": EncodedImage(b"plain text, not an image")}),
                         "invalid input: image 'features' does not decode: not JPEG or PNG"),
}
KEYLESS = "no key"


class MemorySampler(threading.Thread):
    """The job's resident memory (Python and JVM) every 0.2 s until `done`."""

    def __init__(self, pgid: int):
        super().__init__(daemon=True)
        self.pgid, self.rss, self.done = pgid, [group_rss_mb(pgid)], threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.rss.append(group_rss_mb(self.pgid))


def operator_counter(job: EmbeddedJob, suffix: str) -> int:
    """A Python operator counter summed over the job's vertices and subtasks (Flink REST)."""
    total = 0
    for vertex in job.rest(f"/jobs/{job.job_id}")["vertices"]:
        base = f"/jobs/{job.job_id}/vertices/{vertex['id']}/metrics"
        names = [item["id"] for item in job.rest(base) if item["id"].endswith(suffix)]
        if names:
            total += sum(int(float(item["value"])) for item in job.rest(f"{base}?get={','.join(names)}"))
    return total


def test_hostile_input_hurts_no_one_else(write_config, start_job) -> None:
    path, config = write_config(limits={"max_instance_bytes": MAX_INSTANCE_BYTES, "max_image_pixels": MAX_IMAGE_PIXELS})
    job = start_job(path, config)
    kinds = [*CORRUPTIONS, KEYLESS]
    features = np.random.default_rng(5).normal(size=(VALID, FEATURES)).astype(np.float32)
    expected_kind: dict[str, str] = {}
    kafka = config.kafka
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap_servers, linger_ms=5, max_request_size=1 << 20)
    memory = MemorySampler(job.process.pid)
    memory.start()
    started = time.monotonic()
    for i in range(VALID + CORRUPT):
        if i % 2 == 0:
            uri = f"ok-{i // 2}"
            producer.send(kafka.input_topic, key=uri.encode(), value=encode_request(uri, {"features": features[i // 2]}))
            continue
        kind = kinds[(i // 2) % len(kinds)]
        if kind == KEYLESS:
            producer.send(kafka.input_topic, key=None, value=b"\x00\x01 no key, no uri")
            continue
        uri = f"bad-{i // 2}"
        expected_kind[uri] = kind
        producer.send(kafka.input_topic, key=uri.encode(), value=CORRUPTIONS[kind][0](uri))
    producer.flush()
    producer.close()
    keyless = CORRUPT - len(expected_kind)

    with OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client") as outputs:
        results: dict[str, dict] = {}
        deadline = time.monotonic() + 180
        while len(results) < VALID + len(expected_kind) and time.monotonic() < deadline:
            results.update(outputs.dequeue())
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        duplicates = outputs.store.duplicates
    memory.done.set()
    memory.join()
    memory_growth_mb = max(memory.rss) - memory.rss[0]

    probabilities = ort.InferenceSession(str(config.model.path)).run(None, {"features": features})[0]
    wrong = [i for i in range(VALID) if "probabilities" not in results.get(f"ok-{i}", {})
             or not np.allclose(results[f"ok-{i}"]["probabilities"], probabilities[i], atol=1e-5)]
    misreported = {uri: results.get(uri) for uri, kind in expected_kind.items()
                   if not str(results.get(uri, {}).get("error", "")).startswith(CORRUPTIONS[kind][1])}
    unexpected = set(results) - {f"ok-{i}" for i in range(VALID)} - set(expected_kind)

    dropped_and_decoded = inference_errors = -1
    deadline = time.monotonic() + 40  # Flink reports user metrics with a lag of about 10 s
    while time.monotonic() < deadline:
        dropped_and_decoded = operator_counter(job, "cluster_serving.decodeErrors")
        inference_errors = operator_counter(job, "cluster_serving.inferenceErrors")
        if dropped_and_decoded + inference_errors >= CORRUPT:
            break
        time.sleep(2)
    decode_errors = dropped_and_decoded
    restarts = job.rest(f"/jobs/{job.job_id}/metrics?get=numRestarts")
    exceptions = job.rest(f"/jobs/{job.job_id}/exceptions")
    state = job.rest(f"/jobs/{job.job_id}")["state"]

    per_kind = Counter(expected_kind.values())
    print(json.dumps({
        "valid sent": VALID, "valid correct": VALID - len(wrong),
        "corrupt sent": CORRUPT, "corrupt with uri": len(expected_kind), "error results as expected": len(expected_kind) - len(misreported),
        "keyless dropped": keyless, "flink decodeErrors": decode_errors, "flink inferenceErrors": inference_errors,
        "duplicates": duplicates, "restarts": restarts, "seconds to all results": round(elapsed, 1),
        "records/s": round((VALID + CORRUPT) / elapsed), "job memory MB start/peak": [round(memory.rss[0]), round(max(memory.rss))],
        "per kind": per_kind,
    }, indent=1))
    assert not wrong, f"{len(wrong)} valid requests without their correct result, e.g. ok-{wrong[0]}: {results.get(f'ok-{wrong[0]}')}"
    one_per_kind = {expected_kind[uri]: result for uri, result in misreported.items()}
    assert not misreported, f"{len(misreported)} corrupt records without the right error, one per kind: {one_per_kind}"
    assert not unexpected, f"results for uris nobody sent: {sorted(unexpected)[:5]}"
    assert decode_errors + inference_errors == CORRUPT
    assert restarts == [{"id": "numRestarts", "value": "0"}]
    assert not exceptions.get("exceptionHistory", {}).get("entries"), exceptions
    assert state == "RUNNING"
    assert memory_growth_mb < MEMORY_BOUND_MB, f"the job's memory grew by {memory_growth_mb:.0f} MB"
