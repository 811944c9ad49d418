"""The client library: InputQueue and OutputQueue over the Kafka topics of a serving job."""

from cluster_serving.client.queues import DeliveryError, InputQueue, OutputQueue, PredictError, QueueFullError, ResultStore
from cluster_serving.wire.codec import SparseTensor

__all__ = ["DeliveryError", "InputQueue", "OutputQueue", "PredictError", "QueueFullError", "ResultStore", "SparseTensor"]
