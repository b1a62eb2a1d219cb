"""A python-engine handler whose ``infer`` kills its executor thread on demand.

Not collected by pytest; tests copy it beside the config that names it.
``X`` (FP32 ``[2]``) -> ``Y`` = 2 * X. A batch holding the value -999
raises ``SystemExit`` in ``infer``: a BaseException that the executor's
per-batch error handling does not catch, so the thread dies.
"""

from __future__ import annotations

import numpy as np

MAGIC = -999.0


class Killer:
    def load(self, context):
        pass

    def warmup_request(self):
        return {"X": np.zeros((1, 2), np.float32)}

    def preprocess(self, request):
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        if np.any(batch["x"] == MAGIC):
            raise SystemExit("killed on purpose")
        return {"y": batch["x"] * 2}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}
