"""The micro-batcher: groups requests per key and flushes at `batch_size` or `max_delay_ms`.

It runs in the JVM (job/java/MicroBatchOperator.java), chained to the Kafka source: a
batcher in Python cost a Python call and a state access per request, most of the job's time, and a
keyed one a network exchange per request. Waiting requests are operator state, so a checkpoint
taken while a batch is filling includes them: after a restore they are flushed, never lost with
the offsets already committed. Each batch reaches Python as one frame (job/frames.py). Every
parallel instance batches the partitions its source reads; a model and version can join the
batching later as a map of pending lists.
"""

from __future__ import annotations

from pyflink.common import Types
from pyflink.datastream import DataStream
from pyflink.java_gateway import get_gateway

from conf import KAFKA_RECORD_BYTES, BatchingConfig

# A batch is flushed early once its requests add up to this many bytes, so that one frame stays a
# few of the largest requests (KAFKA_RECORD_BYTES each), not batch_size of them.
MAX_BATCH_BYTES = 3 * KAFKA_RECORD_BYTES
FRAME = Types.PRIMITIVE_ARRAY(Types.BYTE())


def micro_batches(requests: DataStream, batching: BatchingConfig) -> DataStream:
    """Row(uri, payload) requests -> one frame per micro-batch."""
    batcher = get_gateway().jvm.clusterserving.flink.MicroBatchOperator(
        batching.batch_size, batching.max_delay_ms, MAX_BATCH_BYTES
    )
    return DataStream(requests._j_data_stream.transform("micro-batch", FRAME.get_java_type_info(), batcher))


def split_results(frames: DataStream, result_type: Types) -> DataStream:
    """One frame of results per batch -> one Row(uri, payload) per result, for the Kafka sink."""
    helper = get_gateway().jvm.clusterserving.flink
    return DataStream(frames._j_data_stream.flatMap(helper.SplitResults(), result_type.get_java_type_info()))
