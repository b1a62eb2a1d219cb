"""A python-engine handler whose ``load`` the test controls.

``load`` touches ``parameters.began`` (the test sees that a load started), then,
with ``parameters.gate`` (a FIFO), blocks opening it until the test opens its
other end. Not collected by pytest; tests copy it beside the config that names it.
``X`` (FP32 ``[2]``) -> ``Y`` (FP32 ``[1]``): the sum of each row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class Gated:
    def load(self, context):
        Path(context.parameters["began"]).touch()
        gate = context.parameters.get("gate")
        if gate:
            with open(gate, "rb"):  # a FIFO: returns once the test opens it for writing
                pass

    def warmup_request(self):
        return {"X": np.zeros((1, 2), np.float32)}

    def preprocess(self, request):
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        return {"y": batch["x"].sum(axis=1, keepdims=True)}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}
