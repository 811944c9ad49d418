"""OutputQueue semantics against the real broker process: what dequeue() returns, duplicates."""

from __future__ import annotations

import uuid

import numpy as np
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from client import OutputQueue
from connectors.codec import Message, encode_message


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
