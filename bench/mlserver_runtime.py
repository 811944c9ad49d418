"""An MLServer runtime serving an ONNX model with ONNX Runtime (MLServer ships none), as a user
would write one: NumpyCodec in, one session.run on one thread, NumpyCodec out. Loaded by MLServer
in the peers' environment (.venv-peers) for `python -m bench.peers`; imports nothing of
cluster_serving."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxRuntime(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self._session = ort.InferenceSession(self.settings.parameters.uri, options, providers=["CPUExecutionProvider"])
        self._input = self._session.get_inputs()[0].name
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        features = NumpyCodec.decode_input(payload.inputs[0])
        outputs = self._session.run(None, {self._input: features.astype(np.float32)})
        return InferenceResponse(model_name=self.name, id=payload.id,
                                 outputs=[NumpyCodec.encode_output("probabilities", outputs[0])])
