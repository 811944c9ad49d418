"""Dead letters: every request of a batch that ended in an error result (or could not be answered
for want of a uri) as it came, key, value and headers, with headers saying why and where it was
read. They leave in the batch's results frame, for the sink that writes the results, so that under
exactly-once a dead letter is committed with its error result."""

from __future__ import annotations

from cluster_serving.config import KafkaConfig
from cluster_serving.runtime.decode import DecodedBatch
from cluster_serving.runtime.frames import DeadLetter, Frame, Headers, Source, read_headers
from cluster_serving.runtime.outcomes import Outcome
from cluster_serving.wire.codec import MODEL_HEADER, VERSION_HEADER, Message
from cluster_serving.wire.open_inference import MLSERVER_MODEL_HEADER, MLSERVER_VERSION_HEADER, RECORD_TIMESTAMP_HEADER

# The headers a dead letter gets besides the request's own.
ERROR_CODE_HEADER = "cluster-serving-error-code"
ERROR_HEADER = "cluster-serving-error"
SERVED_MODEL_HEADER = "cluster-serving-model"
SERVED_VERSION_HEADER = "cluster-serving-version"
SOURCE_TOPIC_HEADER = "cluster-serving-source-topic"
SOURCE_PARTITION_HEADER = "cluster-serving-source-partition"
SOURCE_OFFSET_HEADER = "cluster-serving-source-offset"


def dead_letters(batch: DecodedBatch, outcomes: list[Outcome], kafka: KafkaConfig) -> list[DeadLetter]:
    """The dead letters of a served batch: one per error result, and one per record dropped; none
    when the config turns them off."""
    frame, source_topic = batch.frame, kafka.input_topic
    failed = [outcome for outcome in outcomes if isinstance(outcome, Message) and outcome.error is not None]
    if frame is None or not kafka.dead_letters or not (failed or batch.dropped):
        return []
    indexes = _RequestIndex(frame, batch.unkeyed)
    letters = []
    for message in failed:
        index = indexes.take(message.uri)
        if index is not None:
            why = (message.error_code or "internal", message.error or "", message.model, message.model_version)
            letters.append(_letter(frame, index, why, source_topic))
    for index, why in batch.dropped:
        letters.append(_letter(frame, index, ("bad_request", f"no result can answer it: {why}", None, None), source_topic))
    return letters


class _RequestIndex:
    """Where each uri's request is in a frame; a uri sent twice in one batch takes its places in turn."""

    def __init__(self, frame: Frame, unkeyed: dict[str, int]):
        uris = frame.alike.uris if frame.alike is not None else [uri for uri, _ in frame.records]
        self.places: dict[str, list[int]] = {}
        for index, uri in enumerate(uris):
            if uri is not None:
                self.places.setdefault(uri, []).append(index)
        for uri, index in unkeyed.items():  # a record without a key, answered under its value's uri
            self.places.setdefault(uri, []).append(index)

    def take(self, uri: str) -> int | None:
        places = self.places.get(uri)
        if not places:
            return None
        return places.pop(0) if len(places) > 1 else places[0]


def _letter(frame: Frame, index: int, why: tuple[str, str, str | None, int | None], source_topic: str) -> DeadLetter:
    if frame.alike is not None:
        key, value, source = frame.alike.uris[index], frame.alike.payload(index), frame.alike.sources[index]
    else:
        (key, value), source = frame.records[index], frame.sources[index] if index < len(frame.sources) else Source()
    code, reason, model, version = why
    own = [header for header in read_headers(source.headers) if header[0] != RECORD_TIMESTAMP_HEADER] if source.headers is not None else []
    headers: Headers = [] if _routed_by_mlserver(frame, own) else _route_headers(frame)
    headers += own
    headers += [(ERROR_CODE_HEADER, code.encode()), (ERROR_HEADER, reason.encode())]
    if model is not None:
        headers.append((SERVED_MODEL_HEADER, model.encode()))
    if version is not None:
        headers.append((SERVED_VERSION_HEADER, str(version).encode()))
    headers.append((SOURCE_TOPIC_HEADER, source_topic.encode()))
    if source.partition >= 0:
        headers += [(SOURCE_PARTITION_HEADER, str(source.partition).encode()), (SOURCE_OFFSET_HEADER, str(source.offset).encode())]
    return DeadLetter(key, value, headers)


def _route_headers(frame: Frame) -> Headers:
    """The request's `model` and `version` headers, which the JVM took off into the batch's route."""
    headers: Headers = [(MODEL_HEADER, frame.model.encode())] if frame.model else []
    if frame.version:
        headers.append((VERSION_HEADER, frame.version.encode()))
    return headers


def _routed_by_mlserver(frame: Frame, headers: Headers) -> bool:
    """Whether MLServer's headers, which the JVM leaves with the request's, name its route."""
    named = {name: (value or b"").decode(errors="replace") for name, value in headers}
    return (MLSERVER_MODEL_HEADER in named and named[MLSERVER_MODEL_HEADER] == frame.model
            and named.get(MLSERVER_VERSION_HEADER, "") == frame.version)
