"""The decode stage's promise: one record's problem, whatever its kind, is that record's error
result (or a dropped count without a uri); the rest of the micro-batch is decoded as usual."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from pyflink.common import Row

import cluster_serving.runtime.decode as decoding
from cluster_serving.config import LimitsConfig
from cluster_serving.runtime.decode import decode_records, prepare_instances
from cluster_serving.runtime.preprocess import prepare_values
from cluster_serving.wire.codec import Message, SparseTensor, encode_message

LIMITS = LimitsConfig(max_instance_bytes=1 << 20, max_image_pixels=10_000)
URIS = ["a", "boom", "b"]


def records(*extra: Row) -> list[Row]:
    """One valid request per uri of URIS, x filled with the uri's index, then `extra`. Format 1:
    its values are prepared (format 2 holds only dense tensors, which need no preparing)."""
    valid = [
        Row(uri, encode_message(Message(uri, {"x": np.full(3, i, np.float32)}), version=1))
        for i, uri in enumerate(URIS)
    ]
    return valid + list(extra)


def test_an_unexpected_exception_preparing_one_record_is_its_error_result(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def prepare(values: dict, images: dict, limits: LimitsConfig) -> dict:
        if values["x"][0] == URIS.index("boom"):
            raise RuntimeError("a bug in preprocessing")
        return prepare_values(values, images, limits)

    monkeypatch.setattr(decoding, "prepare_values", prepare)
    with caplog.at_level(logging.WARNING, logger="cluster_serving.runtime"):
        batch, dropped = decode_records(records(), LIMITS)
        ready, rejected = prepare_instances(batch.instances, {}, LIMITS)
    assert [message.uri for message in ready] == ["a", "b"] and dropped == []
    assert ready[1].tensors["x"].tolist() == [2.0, 2.0, 2.0]
    assert [(message.uri, message.error) for message in rejected] == [
        ("boom", "invalid input: RuntimeError: a bug in preprocessing")
    ]
    assert "uri=boom invalid input: RuntimeError: a bug in preprocessing" in caplog.text
    assert "Traceback" in caplog.text  # a bug to fix, not a bad request


def test_an_unexpected_exception_reading_one_record_is_its_error_result(monkeypatch: pytest.MonkeyPatch) -> None:
    real = decoding.decode_message

    def decode(payload: bytes, max_bytes: int) -> Message:
        if b"boom" in payload or b"keyless" in payload:
            raise KeyError("cs.uri")
        return real(payload, max_bytes)

    monkeypatch.setattr(decoding, "decode_message", decode)
    keyless = Row(None, encode_message(Message("keyless", {"x": np.zeros(1)})))
    batch, dropped = decode_records(records(keyless), LIMITS)
    assert [message.uri for message in batch.instances] == ["a", "b"]
    assert [(message.uri, message.error, message.error_code) for message in batch.rejected] == [
        ("boom", "bad request: KeyError: 'cs.uri'", "bad_request")]
    assert dropped == [(3, "KeyError: 'cs.uri'")]


def test_each_unreadable_record_says_why_by_its_code_too() -> None:
    """bad_request for bytes that are no message, too_large for a message over
    limits.max_instance_bytes or a sparse tensor that would be over it once dense."""
    big = Row("big", encode_message(Message("big", {"x": np.zeros((1 << 20) // 4 + 16, np.float32)})))
    sparse = SparseTensor(np.array([[0, 0]]), np.array([1.0], np.float32), (1 << 12, 1 << 12))
    dense_too_large = Row("sparse", encode_message(Message("sparse", {"x": sparse})))
    batch, _ = decode_records(records(Row("junk", b"not a message"), big, dense_too_large), LIMITS)
    codes = {message.uri: message.error_code for message in batch.rejected}
    assert codes == {"junk": "bad_request", "big": "too_large", "sparse": "too_large"}
