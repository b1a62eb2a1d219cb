"""A python-engine handler whose ``preprocess`` waits for the test.

``preprocess`` touches ``parameters.began`` (the test sees that a request is
being served), then opens ``parameters.gate`` (a FIFO) for reading, which
returns once the test opens its other end. Not collected by pytest; tests copy
it beside the config that names it. ``X`` (FP32 ``[2]``) -> ``Y`` (FP32
``[1]``): the sum of each row.
"""

from __future__ import annotations

from pathlib import Path


class Held:
    def load(self, context):
        self.began = Path(context.parameters["began"])
        self.gate = context.parameters["gate"]

    def preprocess(self, request):
        self.began.touch()
        with open(self.gate, "rb"):  # a FIFO: returns once the test opens it for writing
            pass
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        return {"y": batch["x"].sum(axis=1, keepdims=True)}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}
