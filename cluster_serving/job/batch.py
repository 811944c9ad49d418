"""The micro-batcher: groups requests per route (model, version) and flushes each at its model's
`batch_size` or `max_delay_ms` (0: once the requests that have arrived are all read).

It runs in the JVM (cluster_serving/jvm/java/MicroBatchOperator.java), chained to the Kafka source: a
batcher in Python cost a Python call and a state access per request, most of the job's time, and a
keyed one a network exchange per request. Waiting requests are operator state, so a checkpoint
taken while a batch is filling includes them: after a restore they are flushed, never lost with
the offsets already committed. Each batch reaches Python as one frame (cluster_serving/runtime/frames.py) of one
route, or with more of its route ready at once (MAX_JOINED_BATCHES); the routing table (cluster_serving/runtime/repository.py's table text) says each model's batching, and a
control record of the input topic carrying a newer table switches to it at that point of the log
(a control frame tells Python). Every parallel instance batches the partitions its source reads.
The module also holds the other side of a batch's trip through Python: the JVM splitter of its
results, and the name the Python stages run under.
"""

from __future__ import annotations

from pyflink.common import Types
from pyflink.datastream import DataStream, StreamExecutionEnvironment
from pyflink.java_gateway import get_gateway

from cluster_serving.config import KAFKA_RECORD_BYTES
from cluster_serving.wire.codec import MAX_URI_CHARS

# A batch is flushed early once its requests add up to this many bytes, so that one frame stays a
# few of the largest requests (KAFKA_RECORD_BYTES each), not batch_size of them.
MAX_BATCH_BYTES = 3 * KAFKA_RECORD_BYTES
# With max_delay_ms 0, more than a batch of a route ready at once goes to Python in one frame, up
# to this many full batches and these many bytes (the last batch partial where they do not fill
# it): one Python call, decode and encode for all of them, while the model still runs each batch
# on its own (runtime/serve.py). Large requests stay a batch a frame: the bytes bind before the
# count for requests over 256 bytes, and those of 1 KiB or more join as they did under 8 batches
# (docs/benchmarks.md, "Frames of up to 32 batches").
MAX_JOINED_BATCHES = 32
MAX_JOINED_BYTES = 256 << 10
FRAME = Types.PRIMITIVE_ARRAY(Types.BYTE())
# What the Kafka source emits (KeyValueDeserializationSchema.java): the key as the uri, the value,
# the `model` and `version` headers (None when absent or empty), whether it is a control record
# (header `cluster-serving-control`; its payload is a routing table's text, its uri None), where it
# was read, and its other headers as a header block (None when none; cluster_serving/runtime/frames.py).
REQUEST_ROW = Types.ROW_NAMED(
    ["uri", "payload", "model", "version", "control", "partition", "offset", "headers"],
    [Types.STRING(), Types.PRIMITIVE_ARRAY(Types.BYTE()), Types.STRING(), Types.STRING(), Types.BOOLEAN(),
     Types.INT(), Types.LONG(), Types.PRIMITIVE_ARRAY(Types.BYTE())],
)


def micro_batches(requests: DataStream, table_text: str, max_instance_bytes: int,
                  max_batch_bytes: int = MAX_BATCH_BYTES, max_joined_batches: int = MAX_JOINED_BATCHES) -> DataStream:
    """REQUEST_ROW requests -> one frame per micro-batch of one route, a control frame first and at
    every newer table (cluster_serving/runtime/frames.py read_frame). `table_text` is the routing table the job starts
    with; one restored from a checkpoint wins when its generation is newer. A malformed table
    raises here (py4j's error around the JVM's IllegalArgumentException). A batch of alike
    requests goes as one "A" frame when they are within the limits Python holds each to
    (MAX_URI_CHARS, `max_instance_bytes`), else as a "B" frame, where the ones over them get
    their error results. Batches ready at once may share a frame (MAX_JOINED_BATCHES;
    `max_joined_batches` 1: never)."""
    batcher = get_gateway().jvm.clusterserving.flink.MicroBatchOperator(
        table_text, max_batch_bytes, MAX_URI_CHARS, max_instance_bytes, max_joined_batches, MAX_JOINED_BYTES)
    return DataStream(requests._j_data_stream.transform("micro-batch", FRAME.get_java_type_info(), batcher))


def split_results(frames: DataStream, result_type: Types) -> DataStream:
    """One frame of results per batch -> one Row(key, value, headers) of bytes per result or dead
    letter, for the Kafka sink."""
    helper = get_gateway().jvm.clusterserving.flink
    return DataStream(frames._j_data_stream.flatMap(helper.SplitResults(), result_type.get_java_type_info()))


def name_python_stages(env: StreamExecutionEnvironment, first_uid: str, name: str, description: str) -> None:
    """Names the one operator that consecutive Python stages run as. PyFlink fuses them when the
    job is submitted (no serialization between them) into an operator named after all of them,
    "decode, infer, encode": a long name that every metric of theirs carries in the web UI, as
    `0.decode__infer__encode.cluster_serving.batchSize`, cut off in its metric picker. Fusing here,
    once the whole job is wired, as submitting would (its second pass then finds nothing left to
    fuse), gives the operator a short name for metrics and the vertex, and the stages in its
    description, which the web UI shows with the vertex. The fused operator keeps the uid of the
    first stage (`first_uid`), as with PyFlink's own fusing."""
    j_env = env._j_stream_execution_environment
    get_gateway().jvm.org.apache.flink.python.chain.PythonOperatorChainingOptimizer.apply(j_env)
    fused = next(transformation for transformation in j_env.getTransformations() if transformation.getUid() == first_uid)
    fused.setName(name)
    fused.setDescription(description)
