"""A python-engine handler whose ``infer`` sleeps: a model that takes at least
``parameters.sleep_ms`` per batch on a machine of any speed (more when busy).

Not collected by pytest; tests copy it beside the config that names it.
``X`` (FP32 ``[2]``) -> ``Y`` (FP32 ``[1]``): the sum of each row.
"""

from __future__ import annotations

import time

import numpy as np


class Sleeper:
    def load(self, context):
        self.sleep_s = float(context.parameters.get("sleep_ms", 200)) / 1e3

    def warmup_request(self):
        return {"X": np.zeros((1, 2), np.float32)}

    def preprocess(self, request):
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        time.sleep(self.sleep_s)  # releases the GIL: the server goes on meanwhile
        return {"y": batch["x"].sum(axis=1, keepdims=True)}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}
