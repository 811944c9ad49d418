"""Batch inference on real ONNX models: grouping, casting, and isolation of failing requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cluster_serving.runtime.infer import predict
from cluster_serving.runtime.model import ModelError, OnnxModel
from cluster_serving.runtime.outcomes import as_messages
from cluster_serving.wire.codec import Message, decode_message, encode_message
from tests.onnx_models import graph_model

TABLE = np.arange(30, dtype=np.float32).reshape(10, 3)


@pytest.fixture(scope="module")
def lookup_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """row int64 [batch] -> Gather(TABLE) -> values float32 [batch, 3]; an index >= 10 makes
    ONNX Runtime raise at run time, which no input check can see beforehand."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "row"], ["values"], axis=0)],
        "lookup",
        [helper.make_tensor_value_info("row", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("values", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(TABLE, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("lookup") / "lookup.onnx"
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def lookup_model(lookup_path: Path) -> OnnxModel:
    return OnnxModel(lookup_path, "cpu")


def by_uri(results: list[Message]) -> dict[str, Message]:
    assert len({result.uri for result in results}) == len(results)
    return {result.uri: result for result in results}


class RecordingSession:
    """A real session that notes how many rows each run had."""

    def __init__(self, session: object):
        self.session, self.rows = session, []

    def run(self, names: list[str], feeds: dict[str, np.ndarray], options: object = None) -> list[np.ndarray]:
        self.rows.append(len(next(iter(feeds.values()))))
        return self.session.run(names, feeds, options)


@pytest.mark.parametrize("run_size", [0, 2])
def test_a_failing_request_does_not_fail_its_batch(lookup_model: OnnxModel, run_size: int) -> None:
    rows = [3, 99, 0, 7]  # 99 is out of range
    requests = [Message(f"r{i}", {"row": np.array(row)}) for i, row in enumerate(rows)]
    results = by_uri(as_messages(predict(lookup_model, requests, run_size)))
    assert "inference failed" in results["r1"].error and results["r1"].error_code == "inference_failed"
    for i in (0, 2, 3):
        np.testing.assert_array_equal(results[f"r{i}"].tensors["values"], TABLE[rows[i]])
        assert results[f"r{i}"].batch_size == 1  # re-run alone after the stacked run failed


def test_requests_are_stacked_and_checked(lookup_model: OnnxModel) -> None:
    requests = [Message(f"ok{i}", {"row": np.array(i, dtype=np.int32)}) for i in range(5)]  # int32 -> int64
    requests += [
        Message("float", {"row": np.array(1.0)}),
        Message("matrix", {"row": np.zeros((2, 2), np.int64)}),
        Message("missing", {}),
        Message("extra", {"row": np.array(1), "other": np.array(2)}),
    ]
    results = by_uri(as_messages(predict(lookup_model, requests)))
    for i in range(5):
        assert results[f"ok{i}"].batch_size == 5
        np.testing.assert_array_equal(results[f"ok{i}"].tensors["values"], TABLE[i])
    assert "expects int64, got float64" in results["float"].error
    assert "shape (2, 2) does not fit ()" in results["matrix"].error
    assert "missing input 'row'" in results["missing"].error
    assert "unknown input 'other'" in results["extra"].error
    assert {results[uri].error_code for uri in ("float", "matrix", "missing", "extra")} == {"bad_request"}


def test_a_batch_runs_in_runs_of_at_most_run_batch_size(lookup_path: Path) -> None:
    model = OnnxModel(lookup_path, "cpu")
    model.session = RecordingSession(model.session)
    requests = [Message(f"r{i}", {"row": np.array(i % 10)}) for i in range(7)]
    results = by_uri(as_messages(predict(model, requests, run_size=3)))
    assert model.session.rows == [3, 3, 1]
    for i in range(7):
        np.testing.assert_array_equal(results[f"r{i}"].tensors["values"], TABLE[i % 10])
        assert results[f"r{i}"].batch_size == 7  # the batch it was served in, whatever its runs
    predict(model, requests)
    assert model.session.rows[3:] == [7]  # run_size 0: the whole batch in one run


def test_configured_names_must_match_the_model(lookup_path: Path) -> None:
    path = lookup_path
    with pytest.raises(ModelError, match="model.inputs \\['x'\\] do not match the model's inputs \\['row'\\]"):
        OnnxModel(path, "cpu", inputs=("x",))
    with pytest.raises(ModelError, match="model.outputs: the model has no output 'probs'"):
        OnnxModel(path, "cpu", outputs=("probs",))
    with pytest.raises(ModelError, match="cannot load model"):
        OnnxModel(path.with_name("absent.onnx"), "cpu")


@pytest.fixture(scope="module")
def kinds_model(tmp_path_factory: pytest.TempPathFactory) -> OnnxModel:
    """One input per kind the cast rule tells apart, each passed through: f float32, i int64, b bool."""
    inputs = [("f", TensorProto.FLOAT, [2]), ("i", TensorProto.INT64, [2]), ("b", TensorProto.BOOL, [2])]
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name, _, _ in inputs]
    outputs = [(f"{name}_out", kind, shape) for name, kind, shape in inputs]
    return OnnxModel(graph_model(tmp_path_factory.mktemp("kinds") / "kinds.onnx", inputs, nodes, outputs), "cpu")


GOOD = {"f": np.array([1.5, -2.0], np.float32), "i": np.array([3, 4], np.int64), "b": np.array([True, False])}


@pytest.mark.parametrize(
    ("name", "value"),
    [("f", np.array([1.5, -2.0])), ("f", np.array([1.5, -2.0], np.float16)), ("i", np.array([3, 4], np.int32)),
     ("i", np.array([3, 4], np.uint8)), ("i", np.array([3, 4], np.uint32))],
)
def test_casts_within_a_kind_are_served(kinds_model: OnnxModel, name: str, value: np.ndarray) -> None:
    result = as_messages(predict(kinds_model, [Message("u", {**GOOD, name: value})]))[0]
    assert result.error is None
    assert result.tensors[f"{name}_out"].dtype == GOOD[name].dtype
    np.testing.assert_array_equal(result.tensors[f"{name}_out"], GOOD[name])


@pytest.mark.parametrize(
    ("name", "value", "got"),
    [("f", np.array([3, 4], np.int32), "int32"), ("f", np.array([True, False]), "bool"),
     ("f", np.array([3, 4], np.uint64), "uint64"), ("i", np.array([1.0, 2.0]), "float64"),
     ("i", np.array([3, 4], np.uint64), "uint64"), ("i", np.array([True, False]), "bool"),
     ("b", np.array([1, 0], np.int8), "int8"), ("b", np.array([1.0, 0.0], np.float32), "float32"),
     ("f", np.array(["1.5", "2"], object), "strings")],
)
def test_casts_across_kinds_are_refused(kinds_model: OnnxModel, name: str, value: np.ndarray, got: str) -> None:
    """numpy's "same_kind" would take int32, bool and uint64 as float32; the README promises not."""
    result = as_messages(predict(kinds_model, [Message("u", {**GOOD, name: value})]))[0]
    want = GOOD[name].dtype
    assert result.error == f"invalid input: input {name!r}: expects {want}, got {got}"


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    ("name", "value", "got"),
    [("f", np.array([3, 4], np.int32), "int32"), ("i", np.array([1.0, 2.0], np.float32), "float32"),
     ("b", np.array([1, 0], np.uint8), "uint8")],
)
def test_casts_across_kinds_are_refused_in_either_wire_format(
    kinds_model: OnnxModel, version: int, name: str, value: np.ndarray, got: str
) -> None:
    """As enqueue sends them: decoded from the wire, several per batch. Version 2 requests of one
    layout are checked once for all, so every one of them must get the refusal, and a request of
    another layout in the same batch its result."""
    def wire(uri: str, tensors: dict[str, np.ndarray]) -> Message:
        return decode_message(encode_message(Message(uri, tensors), version=version), 1 << 20)

    batch = [wire(f"bad{i}", {**GOOD, name: value}) for i in range(3)] + [wire("good", GOOD)]
    assert all((message.layout_key is not None) == (version == 2) for message in batch)
    results = by_uri(as_messages(predict(kinds_model, batch)))
    for i in range(3):
        assert results[f"bad{i}"].error == f"invalid input: input {name!r}: expects {GOOD[name].dtype}, got {got}"
    assert results["good"].error is None


@pytest.fixture(scope="module")
def narrow_model(tmp_path_factory: pytest.TempPathFactory) -> OnnxModel:
    """A float32 and an int32 input, passed through: the targets of narrowing casts."""
    inputs = [("f", TensorProto.FLOAT, [2]), ("i", TensorProto.INT32, [2])]
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name, _, _ in inputs]
    outputs = [(f"{name}_out", kind, shape) for name, kind, shape in inputs]
    return OnnxModel(graph_model(tmp_path_factory.mktemp("narrow") / "narrow.onnx", inputs, nodes, outputs), "cpu")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    ("name", "fits", "overflows", "want"),
    [("f", np.array([1.5, 1e38]), np.array([1.5, 1e39]), "float32"),
     ("i", np.array([3, 2**31 - 1], np.int64), np.array([3, 2**40], np.int64), "int32")],
)
def test_casts_within_a_kind_that_would_change_a_value_are_refused(
    narrow_model: OnnxModel, version: int, name: str, fits: np.ndarray, overflows: np.ndarray, want: str
) -> None:
    """float64 1e39 into float32 would be infinity, int64 2**40 into int32 would wrap: refused per
    request, even among requests of one version 2 layout that was checked once; values that fit
    are served beside them."""
    other = {"f": np.zeros(2, np.float32), "i": np.zeros(2, np.int32)}

    def wire(uri: str, value: np.ndarray) -> Message:
        return decode_message(encode_message(Message(uri, {**other, name: value}), version=version), 1 << 20)

    batch = [wire("fits", fits), wire("overflows", overflows), wire("fits-again", fits)]
    results = by_uri(as_messages(predict(narrow_model, batch)))
    assert results["overflows"].error == f"invalid input: input {name!r}: values outside the range of {want}"
    assert results["fits"].error is None and results["fits-again"].error is None
    np.testing.assert_array_equal(results["fits"].tensors[f"{name}_out"], fits.astype(want))


def test_an_unexpected_exception_preparing_one_request_fails_only_that_request(
    lookup_model: OnnxModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = lookup_model.prepare

    def prepare(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if tensors["row"] == 5:
            raise IndexError("a bug in preparing")
        return real(tensors)

    monkeypatch.setattr(lookup_model, "prepare", prepare)
    results = by_uri(as_messages(predict(lookup_model, [Message(f"r{row}", {"row": np.array(row)}) for row in (4, 5, 6)])))
    assert results["r5"].error == "invalid input: IndexError: a bug in preparing"
    for row in (4, 6):
        np.testing.assert_array_equal(results[f"r{row}"].tensors["values"], TABLE[row])
        assert results[f"r{row}"].batch_size == 2
