"""The Open Inference Protocol on Kafka through the serving path: batches as the JVM frames them
(BatchFrames.java, each request with its headers), served by a BatchServer, the answers as the
JVM writes them. Requests are made and answers read with the OIP working group's protobuf messages
and as JSON, for every datatype of the protocol, raw and typed contents, batches of one and more;
each is answered in the encoding it came in. Producers written with MLServer's and Seldon's own
libraries, through Kafka and a running job, are in test_peer_producers.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest
from onnx import TensorProto, helper
from open_inference.grpc.protocol import ModelInferRequest, ModelInferResponse

from cluster_serving.config import load_config
from cluster_serving.ops.sample_model import FEATURES, build_sample_model
from cluster_serving.runtime.frames import write_control_frame, write_headers
from cluster_serving.runtime.repository import RoutingTable, scan
from cluster_serving.runtime.serve import BatchServer
from cluster_serving.wire.codec import decode_message
from tests.onnx_models import graph_model
from tests.test_alike_batches import jvm  # noqa: F401  (a fixture)
from tests.test_dead_letters import jvm_frame

# Each OIP datatype: (the ONNX type, numpy's, values of a row).
DATATYPES = {
    "BOOL": (TensorProto.BOOL, np.bool_, [True, False]),
    "UINT8": (TensorProto.UINT8, np.uint8, [0, 255]),
    "UINT16": (TensorProto.UINT16, np.uint16, [1, 65535]),
    "UINT32": (TensorProto.UINT32, np.uint32, [2, 2**32 - 1]),
    "UINT64": (TensorProto.UINT64, np.uint64, [3, 2**64 - 1]),
    "INT8": (TensorProto.INT8, np.int8, [-128, 127]),
    "INT16": (TensorProto.INT16, np.int16, [-32768, 5]),
    "INT32": (TensorProto.INT32, np.int32, [-(2**31), 7]),
    "INT64": (TensorProto.INT64, np.int64, [-(2**63), 2**62]),
    "FP16": (TensorProto.FLOAT16, np.float16, [0.5, -1.25]),
    "FP32": (TensorProto.FLOAT, np.float32, [0.1, -3e38]),
    "FP64": (TensorProto.DOUBLE, np.float64, [1e-300, 2.5]),
    "BYTES": (TensorProto.STRING, np.object_, ["ünï", ""]),
}
TYPED = {"BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
         "UINT64": "uint64_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
         "INT64": "int64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
MLSERVER = [("mlserver-model", b"identity")]
SELDON_JSON = [("seldon-infer-type", b"json/inferModelRequest")]
SELDON_PROTO = [("seldon-infer-type", b"proto/InferModelRequest")]


def identity_model(path: Path, datatypes: list[str]) -> Path:
    """in_<datatype> -> out_<datatype>, unchanged, for each datatype, with a batch dimension."""
    nodes = [helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]) for name in datatypes]
    specs = [(name, DATATYPES[name][0], [2]) for name in datatypes]
    return graph_model(path, [(f"in_{n}", kind, shape) for n, kind, shape in specs], nodes,
                       [(f"out_{n}", kind, shape) for n, kind, shape in specs])


def batch_of(datatypes: list[str], rows: int) -> dict[str, np.ndarray]:
    return {f"in_{name}": np.array([DATATYPES[name][2]] * rows, dtype=DATATYPES[name][1]) for name in datatypes}


def serving(tmp_path_factory, datatypes: list[str], **limits) -> BatchServer:
    path = identity_model(tmp_path_factory.mktemp("oip") / "identity.onnx", datatypes)
    config = load_config(overrides={"model.path": str(path), "model.name": "identity",
                                    **{f"limits.{key}": value for key, value in limits.items()}})
    server = BatchServer(config)
    server.serve_frame(write_control_frame(RoutingTable.of(scan(config)).text()))
    return server


@pytest.fixture(scope="module")
def every_datatype(tmp_path_factory):
    server = serving(tmp_path_factory, list(DATATYPES))
    yield server
    server.close()


@pytest.fixture(scope="module")
def typed_datatypes(tmp_path_factory):
    server = serving(tmp_path_factory, list(TYPED))  # FP16 travels in raw contents only
    yield server
    server.close()


def served(gateway, server: BatchServer, records: list[tuple[str | None, bytes, list]], route=("", "")):
    """The answers (key -> value bytes) and dead letters (key -> (value, headers)) of a batch."""
    frame = jvm_frame(gateway, [(key, value, write_headers(headers) if headers else None) for key, value, headers in records], route)
    rows = gateway.jvm.clusterserving.flink.BatchFrames.decode(bytearray(server.serve_frame(frame)))
    answers, letters = {}, {}
    for row in rows:
        key, value, headers = row.getField(0), bytes(row.getField(1)), row.getField(2)
        key = None if key is None else bytes(key).decode()
        if headers is None:
            answers[key] = value
        else:
            schema = gateway.jvm.clusterserving.flink.ResultRecordSerializationSchema("results", "letters")
            record = schema.serialize(row, None, None)
            letters[key] = (value, {h.key(): bytes(h.value()) for h in record.headers().toArray()})
    return answers, letters


def json_request(tensors: dict[str, np.ndarray], **fields) -> bytes:
    return orjson.dumps({**fields, "inputs": [
        {"name": name, "shape": list(value.shape), "datatype": datatype_of(name), "data": value.reshape(-1).tolist()}
        for name, value in tensors.items()]})


def protobuf_request(tensors: dict[str, np.ndarray], raw: bool = True, **fields) -> bytes:
    request = ModelInferRequest(**fields)
    for name, value in tensors.items():
        tensor = request.inputs.add(name=name, datatype=datatype_of(name), shape=list(value.shape))
        if not raw:
            items = [item.encode() for item in value.reshape(-1)] if value.dtype == object else value.reshape(-1).tolist()
            getattr(tensor.contents, TYPED[datatype_of(name)]).extend(items)
        elif value.dtype == object:
            request.raw_input_contents.append(b"".join(len(s.encode()).to_bytes(4, "little") + s.encode() for s in value.reshape(-1)))
        else:
            request.raw_input_contents.append(value.astype(value.dtype.newbyteorder("<")).tobytes())
    return request.SerializeToString()


def datatype_of(name: str) -> str:
    """The datatype an identity model's input name says (in_FP32); the sample model's are FP32."""
    return name.split("_", 1)[1] if name.startswith("in_") else "FP32"


def json_outputs(answer: bytes) -> dict[str, np.ndarray]:
    body = orjson.loads(answer)
    assert "error" not in body, body
    return {out["name"]: np.array(out["data"], dtype=DATATYPES[out["datatype"]][1]).reshape(out["shape"])
            for out in body["outputs"]}


def protobuf_outputs(answer: bytes) -> dict[str, np.ndarray]:
    response = ModelInferResponse.FromString(answer)
    assert "error" not in response.parameters, response.parameters["error"]
    outputs = {}
    for out, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        dtype = DATATYPES[out.datatype][1]
        if dtype == np.object_:
            items, at = [], 0
            while at < len(raw):
                length = int.from_bytes(raw[at:at + 4], "little")
                items.append(raw[at + 4:at + 4 + length].decode())
                at += 4 + length
            outputs[out.name] = np.array(items, dtype=object).reshape(list(out.shape))
        else:
            outputs[out.name] = np.frombuffer(raw, np.dtype(dtype).newbyteorder("<")).reshape(list(out.shape))
    return outputs


def assert_identity(sent: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert set(got) == {name.replace("in_", "out_") for name in sent}
    for name, value in sent.items():
        out = got[name.replace("in_", "out_")]
        assert out.shape == value.shape and out.dtype == value.dtype, name
        assert out.tolist() == value.tolist(), name


@pytest.mark.parametrize("rows", [1, 3])
def test_every_datatype_in_every_encoding(jvm, every_datatype: BatchServer, rows: int) -> None:  # noqa: F811
    """A batch of one and of three rows of every OIP datatype, as MLServer's JSON, Seldon's JSON and
    Seldon's protobuf (headed and not), each answered in its encoding with the inputs unchanged."""
    tensors = batch_of(list(DATATYPES), rows)
    answers, letters = served(jvm, every_datatype, [
        ("mlserver", json_request(tensors, id="ignored: the key takes precedence"), MLSERVER),
        ("seldon-json", json_request(tensors), SELDON_JSON),
        ("seldon-proto", protobuf_request(tensors), SELDON_PROTO),
        ("headerless-proto", protobuf_request(tensors), []),
    ], route=("identity", ""))
    assert letters == {}
    for key in ("mlserver", "seldon-json"):
        body = orjson.loads(answers[key])
        assert (body["id"], body["model_name"], body["model_version"]) == (key, "identity", "1")
        assert_identity(tensors, json_outputs(answers[key]))
    for key in ("seldon-proto", "headerless-proto"):
        response = ModelInferResponse.FromString(answers[key])
        assert (response.id, response.model_name, response.model_version) == (key, "identity", "1")
        assert_identity(tensors, protobuf_outputs(answers[key]))


def test_typed_contents(jvm, typed_datatypes: BatchServer) -> None:  # noqa: F811
    """Protobuf tensors in their typed contents fields (bool_contents, int_contents, ...)."""
    tensors = batch_of(list(TYPED), 2)
    answers, _ = served(jvm, typed_datatypes, [("typed", protobuf_request(tensors, raw=False), SELDON_PROTO)])
    assert_identity(tensors, protobuf_outputs(answers["typed"]))


def test_requests_in_our_format_and_oip_share_a_batch(jvm, tmp_path_factory) -> None:  # noqa: F811
    """One batch of our own requests, MLServer's and Seldon's, stacked into the model's runs
    together: each gets the model's answer for its own row, in its own format."""
    from cluster_serving.wire.codec import Message, encode_message
    path = build_sample_model(tmp_path_factory.mktemp("mixed") / "model.onnx")
    config = load_config(overrides={"model.path": str(path)})
    server = BatchServer(config)
    server.serve_frame(write_control_frame(RoutingTable.of(scan(config)).text()))
    rows = np.random.default_rng(4).normal(size=(4, FEATURES)).astype(np.float32)
    mlserver = {"features": rows[1:3]}
    answers, _ = served(jvm, server, [
        ("native", encode_message(Message("native", {"features": rows[0]})), None),
        ("mlserver", json_request(mlserver), [("mlserver-model", b"")]),
        ("proto", protobuf_request({"features": rows[3:]}), SELDON_PROTO),
    ])
    alone = {}
    for i in range(4):
        single, _ = served(jvm, server, [("one", encode_message(Message("one", {"features": rows[i]})), None)])
        alone[i] = decode_message(single["one"], 1 << 20).tensors["probabilities"]
    assert np.allclose(decode_message(answers["native"], 1 << 20).tensors["probabilities"], alone[0])
    body = orjson.loads(answers["mlserver"])
    assert np.allclose(np.array(body["outputs"][0]["data"]).reshape(2, -1), [alone[1], alone[2]], atol=1e-6)
    response = ModelInferResponse.FromString(answers["proto"])
    assert np.allclose(np.frombuffer(response.raw_output_contents[0], np.float32), alone[3])
    server.close()


def error_of(encoding: str, answer: bytes) -> tuple[str, str]:
    if encoding == "json":
        body = orjson.loads(answer)
        return body["error_code"], body["error"]
    parameters = ModelInferResponse.FromString(answer).parameters
    return parameters["error_code"].string_param, parameters["error"].string_param


BAD = {
    "not JSON": ("json", b"{not json", MLSERVER, "bad_request", "not an OIP JSON request"),
    "no inputs": ("json", b'{"inputs": []}', SELDON_JSON, "bad_request", "non-empty list of inputs"),
    "unknown datatype": ("json", b'{"inputs": [{"name": "in_FP32", "shape": [1, 2], "datatype": "FP8", "data": [1, 2]}]}',
                         MLSERVER, "bad_request", "unknown datatype 'FP8'"),
    "data short of the shape": ("json", b'{"inputs": [{"name": "in_FP32", "shape": [1, 3], "datatype": "FP32", "data": [1, 2]}]}',
                                MLSERVER, "bad_request", "2 values do not fill shape [1, 3]"),
    "a fraction for an integer": ("json", b'{"inputs": [{"name": "in_INT32", "shape": [1, 2], "datatype": "INT32", "data": [1, 2.5]}]}',
                                  MLSERVER, "bad_request", "in_INT32"),
    "not protobuf": ("protobuf", b"\xff\x00garbage", SELDON_PROTO, "bad_request", "not an OIP protobuf ModelInferRequest"),
    "a shape far over the limit": ("protobuf", None, SELDON_PROTO, "too_large", "over the limit"),
    "raw bytes short of the shape": ("protobuf", None, SELDON_PROTO, "bad_request", "1 values do not fill shape [1, 2]"),
    "a BOOL byte that is not 0 or 1": ("protobuf", None, SELDON_PROTO, "bad_request", "a BOOL value is one byte, 0 or 1"),
    "an unknown seldon type": ("json", b"{}", [("seldon-infer-type", b"json/somethingElse")], None, "seldon-infer-type"),
}


def bad_protobuf(case: str) -> bytes:
    request = ModelInferRequest()
    if case == "a BOOL byte that is not 0 or 1":
        request.inputs.add(name="in_BOOL", datatype="BOOL", shape=[1, 2])
        request.raw_input_contents.append(b"\x01\x02")
        return request.SerializeToString()
    request.inputs.add(name="in_FP32", datatype="FP32", shape=[1 << 30, 2] if case == "a shape far over the limit" else [1, 2])
    request.raw_input_contents.append(b"\0" * 4)
    return request.SerializeToString()


@pytest.mark.parametrize("case", list(BAD))
def test_a_request_that_claims_a_protocol_and_is_not_it(jvm, every_datatype: BatchServer, case: str) -> None:  # noqa: F811
    """A bad_request (or too_large) answer in the encoding the record claims, and a dead letter
    holding the record as it came; the good request beside it is served."""
    encoding, value, headers, code, words = BAD[case]
    value = value if value is not None else bad_protobuf(case)
    good = batch_of(list(DATATYPES), 1)
    answers, letters = served(jvm, every_datatype, [("bad", value, headers), ("good", json_request(good), MLSERVER)])
    assert_identity(good, json_outputs(answers["good"]))
    if code is None:  # no protocol to answer in: our own error result
        result = decode_message(answers["bad"], 1 << 20)
        assert result.error_code == "bad_request" and words in result.error
    else:
        got_code, error = error_of(encoding, answers["bad"])
        assert got_code == code and words in error, error
    letter_value, letter_headers = letters["bad"]
    assert letter_value == value
    assert {name: value for name, value in headers}.items() <= letter_headers.items()
    assert letter_headers["cluster-serving-error-code"] == (code or "bad_request").encode()
    assert "model" not in letter_headers or headers != MLSERVER  # routed by MLServer's header: left as it came


def test_a_record_over_the_size_limit_is_refused_before_it_is_read(jvm, tmp_path_factory) -> None:  # noqa: F811
    server = serving(tmp_path_factory, ["FP32"], max_instance_bytes=1024)
    tensors = {"in_FP32": np.zeros((200, 2), np.float32)}
    answers, letters = served(jvm, server, [("big", protobuf_request(tensors), SELDON_PROTO)])
    assert error_of("protobuf", answers["big"])[0] == "too_large"
    assert "big" in letters
    server.close()


def test_the_body_may_not_name_another_model_than_its_route(jvm, every_datatype: BatchServer) -> None:  # noqa: F811
    tensors = batch_of(list(DATATYPES), 1)
    answers, _ = served(jvm, every_datatype, [
        ("other", protobuf_request(tensors, model_name="resnet"), SELDON_PROTO),
        ("same", protobuf_request(tensors, model_name="identity", model_version="1"), SELDON_PROTO),
        ("old", protobuf_request(tensors, model_name="identity", model_version="7"), SELDON_PROTO),
    ])
    assert error_of("protobuf", answers["other"])[0] == "bad_request"
    assert "routed to 'identity'" in error_of("protobuf", answers["other"])[1]
    assert error_of("protobuf", answers["old"])[0] == "bad_request"
    assert_identity(tensors, protobuf_outputs(answers["same"]))


def test_only_the_outputs_asked_for(jvm, every_datatype: BatchServer) -> None:  # noqa: F811
    tensors = batch_of(list(DATATYPES), 1)
    asked = orjson.loads(json_request(tensors)) | {"outputs": [{"name": "out_INT8"}, {"name": "out_BYTES"}]}
    answers, _ = served(jvm, every_datatype, [("some", orjson.dumps(asked), MLSERVER)])
    assert [out["name"] for out in orjson.loads(answers["some"])["outputs"]] == ["out_INT8", "out_BYTES"]
    asked["outputs"] = [{"name": "nope"}]
    answers, letters = served(jvm, every_datatype, [("none", orjson.dumps(asked), MLSERVER)])
    assert letters["none"][1]["cluster-serving-error-code"] == b"bad_request"
    assert error_of("json", answers["none"]) == ("bad_request", "bad request: no output 'nope'; the model has "
                                                 + ", ".join(f"out_{name}" for name in DATATYPES))


def test_a_seldon_response_chains_into_the_next_model(jvm, every_datatype: BatchServer) -> None:  # noqa: F811
    """Seldon's response kinds: a model's ModelInferResponse (its outputs named as the next model's
    inputs) served as a request."""
    tensors = batch_of(list(DATATYPES), 2)
    request = ModelInferRequest.FromString(protobuf_request(tensors))
    response = ModelInferResponse(id="chained", outputs=[
        ModelInferResponse.InferOutputTensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in request.inputs])
    response.raw_output_contents.extend(request.raw_input_contents)
    answers, _ = served(jvm, every_datatype, [
        ("chained", response.SerializeToString(), [("seldon-infer-type", b"proto/InferModelResponse")])])
    assert_identity(tensors, protobuf_outputs(answers["chained"]))


def test_garbage_without_headers_is_still_refused_in_our_format(jvm, every_datatype: BatchServer) -> None:  # noqa: F811
    garbage = np.random.default_rng(1).bytes(300)
    answers, _ = served(jvm, every_datatype, [("garbage", garbage, None)])
    assert decode_message(answers["garbage"], 1 << 20).error.startswith("bad request: not a cluster-serving message")


def test_a_timeout_parameter_counts_from_the_record_timestamp(jvm, every_datatype: BatchServer) -> None:  # noqa: F811
    """Triton's `timeout` parameter (microseconds) from the record's timestamp, which the JVM adds
    to an OIP request's headers: past, the request is answered deadline_exceeded unrun; the
    timestamp header is not left on its dead letter."""
    import time
    tensors = batch_of(list(DATATYPES), 1)
    sent = [("cluster-serving-record-timestamp", str(int(time.time() * 1000) - 5000).encode())]
    expired = orjson.loads(json_request(tensors)) | {"parameters": {"timeout": 1_000_000}}
    fresh = orjson.loads(json_request(tensors)) | {"parameters": {"timeout": 60_000_000}}
    late_proto = ModelInferRequest.FromString(protobuf_request(tensors))
    late_proto.parameters["timeout"].int64_param = 2_000_000
    answers, letters = served(jvm, every_datatype, [
        ("expired", orjson.dumps(expired), MLSERVER + sent), ("fresh", orjson.dumps(fresh), MLSERVER + sent),
        ("late-proto", late_proto.SerializeToString(), SELDON_PROTO + sent),
        ("bad-timeout", orjson.dumps(expired | {"parameters": {"timeout": "soon"}}), MLSERVER + sent),
    ])
    assert error_of("json", answers["expired"])[0] == "deadline_exceeded"
    assert error_of("protobuf", answers["late-proto"])[0] == "deadline_exceeded"
    assert error_of("json", answers["bad-timeout"])[0] == "bad_request"
    assert_identity(tensors, json_outputs(answers["fresh"]))
    assert set(letters) == {"expired", "late-proto", "bad-timeout"}
    assert all("cluster-serving-record-timestamp" not in headers for _, headers in letters.values())


def test_a_request_without_a_key_is_answered_and_dead_lettered_by_its_id(jvm, every_datatype: BatchServer) -> None:  # noqa: F811
    """MLServer takes the body's id where the record has no key: the answer is keyed by it, and a
    failed one is still a dead letter, as it came (no key)."""
    tensors = batch_of(list(DATATYPES), 1)
    wrong = json_request(tensors, id="failing").replace(b'"in_', b'"wrong_')  # inputs the model does not have
    answers, letters = served(jvm, every_datatype, [(None, json_request(tensors, id="by-id"), MLSERVER), (None, wrong, MLSERVER)])
    assert_identity(tensors, json_outputs(answers["by-id"]))
    assert orjson.loads(answers["by-id"])["id"] == "by-id"
    assert set(answers) == {"by-id", "failing"}, answers
    assert error_of("json", answers["failing"])[0] == "bad_request"
    assert list(letters) == [None] and letters[None][0] == wrong
