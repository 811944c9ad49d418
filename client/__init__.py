"""The client library: InputQueue and OutputQueue over the Kafka topics of a serving job."""

from client.queues import InputQueue, OutputQueue, ResultStore

__all__ = ["InputQueue", "OutputQueue", "ResultStore"]
