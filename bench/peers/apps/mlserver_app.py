"""MLServer serving a benchmark model (runs in the MLServer venv).

    mlserver start FOLDER      # FOLDER: settings.json and MODEL/model-settings.json

bench.peers writes both settings files (launch.py) with this module on
``PYTHONPATH``. The model's settings carry ``implementation``
``mlserver_app.BenchModel``, the workload in ``parameters.extra`` and
MLServer's adaptive batching (``max_batch_size`` 32, ``max_batch_time``
0.005 s). The server's: one parallel inference worker (the model in its own
process, MLServer's default), access log off (``debug`` false), 127.0.0.1
for HTTP, gRPC and metrics. MLServer speaks KServe V2, so the request body
is the one every server gets, at ``/v2/models/NAME/infer``; its batcher
stacks the requests' inputs along the first axis and splits the answer back.
"""

from __future__ import annotations

import common
import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec, StringCodec
from mlserver.types import InferenceRequest, InferenceResponse


class BenchModel(MLModel):
    async def load(self) -> bool:
        common.set_threads()
        self.workload = self.settings.parameters.extra["workload"]
        self.model = common.load(self.workload)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        head = payload.inputs[0]
        if self.workload == "tiny":
            items = list(NumpyCodec.decode_input(head).reshape(-1, common.TINY_FEATURES))
        else:
            items = [t.decode() if isinstance(t, bytes) else str(t)
                     for t in StringCodec.decode_input(head)]  # fmt: skip
        out = np.asarray(common.run_batch(self.model, self.workload, items), np.float32)
        name = common.NAMES[self.workload][1]
        return InferenceResponse(
            model_name=self.name, outputs=[NumpyCodec.encode_output(name, out)]
        )
