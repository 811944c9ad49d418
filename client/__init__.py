"""The client library: InputQueue and OutputQueue over the Kafka topics of a serving job."""

from client.queues import DeliveryError, InputQueue, OutputQueue, PredictError, QueueFullError, ResultStore
from connectors.codec import SparseTensor

__all__ = ["DeliveryError", "InputQueue", "OutputQueue", "PredictError", "QueueFullError", "ResultStore", "SparseTensor"]
