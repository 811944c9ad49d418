"""The client library against the real broker process: what enqueue_batch writes and what a
refused record raises; what OutputQueue.dequeue() returns, duplicates."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import confluent_kafka
import numpy as np
import pytest
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from cluster_serving.client import DeliveryError, InputQueue, OutputQueue
from cluster_serving.kafka.admin import topic_records
from cluster_serving.wire.codec import Message, encode_message
from cluster_serving.wire.inputs import encode_by_kind
from tests.conftest import collect


def new_topic(bootstrap: str, partitions: int = 1, **configs: str) -> str:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, partitions, 1, topic_configs=configs)])
    admin.close()
    return topic


def test_enqueue_batch_writes_each_request_as_the_general_encoder_does(broker) -> None:
    """Alike requests are encoded together, others one by one; either way each record is the
    request's own bytes, keyed by its uri, with the model header, and none is missing."""
    bootstrap = broker.bootstrap_servers
    topic = new_topic(bootstrap, partitions=2)
    rows = np.random.default_rng(3).normal(size=(700, 16)).astype(np.float32)
    requests = [(f"r{i}", {"features": row}) for i, row in enumerate(rows)]
    requests[300:303] = [("text", {"words": ["a", "b"]}), ("other-shape", {"features": rows[0][:8]}),
                         ("ints", {"features": np.arange(16)})]
    with InputQueue(bootstrap, topic) as inputs:
        assert inputs.enqueue_batch(requests, model="m") == len(requests)
    records = {record.key.decode(): record for record in topic_records(bootstrap, topic)}
    assert sorted(records) == sorted(uri for uri, _ in requests)
    for uri, inputs in requests:
        assert records[uri].value == encode_by_kind(uri, inputs), uri
        assert dict(records[uri].headers) == {"model": b"m"}


def test_a_record_the_broker_refuses_is_named_at_flush_and_the_rest_go(broker) -> None:
    bootstrap = broker.bootstrap_servers
    topic = new_topic(bootstrap, **{"max.message.bytes": "2048"})
    with InputQueue(bootstrap, topic) as inputs:
        inputs.enqueue("small-1", x=np.zeros(16, np.float32))
        inputs.flush()
        inputs.enqueue("large", x=np.zeros(1024, np.float32))
        with pytest.raises(DeliveryError, match="1 requests not written to topic .* \\('large'\\): .*too large"):
            inputs.flush()
        inputs.enqueue("small-2", x=np.zeros(16, np.float32))
        inputs.flush()
    assert sorted(record.key.decode() for record in topic_records(bootstrap, topic)) == ["small-1", "small-2"]


def write_results(bootstrap: str, topic: str, messages: list[Message]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for message in messages:
        producer.send(topic, key=message.uri.encode(), value=encode_message(message))
    producer.flush()
    producer.close()


def test_dequeue_takes_what_is_there_and_collapses_replays(broker) -> None:
    bootstrap, topic = broker.bootstrap_servers, f"results-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 2, 1)])
    admin.close()
    first = [Message(f"a{i}", {"y": np.full(2, i, np.float32)}) for i in range(50)]
    write_results(bootstrap, topic, first + [Message("bad", error="invalid input: x")] + first[:5])

    group = f"g-{uuid.uuid4().hex}"
    with OutputQueue(bootstrap, topic, group_id=group) as outputs:
        assert outputs.query("bad", timeout=10) == {"error": "invalid input: x"}
        taken = outputs.dequeue()
        assert sorted(taken) == sorted([f"a{i}" for i in range(50)] + ["bad"])
        np.testing.assert_array_equal(taken["a7"]["y"], np.full(2, 7, np.float32))
        assert outputs.store.duplicates == 5
        assert outputs.dequeue() == {}

        # A replay of an already dequeued uri stays collapsed; new uris come in the next call.
        write_results(bootstrap, topic, [first[0], Message("b0", {"y": np.zeros(1, np.float32)})])
        assert list(outputs.dequeue()) == ["b0"]
        assert outputs.store.duplicates == 6
        assert outputs.query("a0") is None  # handed out already

    # dequeue() committed: the same group starts after everything it already took.
    with OutputQueue(bootstrap, topic, group_id=group) as again:
        assert again.dequeue() == {}


def test_dequeue_hands_over_what_is_committed_without_waiting_for_an_open_transaction(broker) -> None:
    """Under kafka.delivery exactly_once the job's results stay in a transaction until the next
    checkpoint: dequeue() returns what readers may see, and the rest once it is committed."""
    bootstrap = broker.bootstrap_servers
    topic = new_topic(bootstrap)
    write_results(bootstrap, topic, [Message("committed", {"y": np.zeros(1, np.float32)})])
    transactional = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{uuid.uuid4().hex}"})
    transactional.init_transactions(30)
    transactional.begin_transaction()
    transactional.produce(topic, encode_message(Message("in-transaction", {"y": np.ones(1, np.float32)})), b"in-transaction")
    transactional.flush(30)
    with OutputQueue(bootstrap, topic, group_id=f"g-{uuid.uuid4().hex}") as outputs:
        with ThreadPoolExecutor(1) as pool:
            # A liveness bound, not a speed claim: ends taken from the high watermark, which counts
            # the open transaction's record, would make this call wait for the commit.
            assert list(pool.submit(outputs.dequeue).result(timeout=60)) == ["committed"]
        transactional.commit_transaction(30)  # the broker marks the partitions committed after it returns
        assert list(collect(outputs, 1, timeout=60)) == ["in-transaction"]


def test_a_transaction_is_written_whole_or_not_at_all(broker) -> None:
    """What a read_committed reader (the job) sees of InputQueue.transaction: a block that ends
    commits its requests, one that raises aborts them; the queue takes no request outside one."""
    bootstrap = broker.bootstrap_servers
    topic = new_topic(bootstrap)
    one = np.ones(2, np.float32)
    with InputQueue(bootstrap, topic, transactional_id=f"tx-{uuid.uuid4().hex}") as inputs:
        with inputs.transaction():
            inputs.enqueue_batch([("kept-1", {"x": one}), ("kept-2", {"x": one})])
        with pytest.raises(ZeroDivisionError), inputs.transaction():
            inputs.enqueue("dropped", x=one)
            inputs.flush()
            1 / 0
        with pytest.raises(RuntimeError, match=r"enqueue inside `with queue.transaction\(\):`"):
            inputs.enqueue("outside", x=one)
    committed = [record.key for record in topic_records(bootstrap, topic, "read_committed")]
    everything = [record.key for record in topic_records(bootstrap, topic)]
    assert committed == [b"kept-1", b"kept-2"]
    assert everything == [b"kept-1", b"kept-2", b"dropped"]
    with InputQueue(bootstrap, topic) as plain, pytest.raises(RuntimeError, match="transactional_id"):
        with plain.transaction():
            pass


@pytest.mark.parametrize("make", [
    lambda: InputQueue("127.0.0.1:9", "t", no_such_setting=1),
    lambda: OutputQueue("127.0.0.1:9", "t", no_such_setting=1),
    lambda: InputQueue("127.0.0.1:9", "t", acks="sometimes"),
])
def test_a_kafka_setting_librdkafka_refuses_is_one_value_error(make) -> None:
    with pytest.raises(ValueError, match=r"^Kafka settings: (No such configuration property: \"no.such.setting\"|"
                                         r"Invalid value for configuration property \"request.required.acks\")"):
        make()
