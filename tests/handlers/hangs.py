"""A python-engine handler whose ``load`` never returns, in the roles the test names.

``load`` first touches ``parameters.began`` + ``-`` + its role ("both" on a
thread executor; "front" in the server and "infer" in each worker process
with ``"executor": "process"``), so that a test sees the load under way; then,
if its role is in ``parameters.hang_in``, it waits on an event nobody sets.
Not collected by pytest; tests copy it beside the config that names it.
``X`` (FP32 ``[2]``) -> ``Y`` (FP32 ``[1]``): the sum of each row.
"""

from __future__ import annotations

import threading
from pathlib import Path


class Hangs:
    def load(self, context):
        Path(f"{context.parameters['began']}-{context.role}").touch()
        if context.role in context.parameters.get("hang_in", ["both", "front", "infer"]):
            threading.Event().wait()  # never set: a load that never returns

    def preprocess(self, request):
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        return {"y": batch["x"].sum(axis=1, keepdims=True)}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}
