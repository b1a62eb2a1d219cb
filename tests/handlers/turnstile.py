"""A python-engine handler whose batches the test lets through one at a time.

Each ``infer`` call appends a line to ``parameters.log`` (the model's name and
the batch's ``X`` values, in order; warm-up's, negative, pass at once) and then waits until the file
``parameters.gates``/``open-N`` exists, N counting the calls of every model
that shares the log (the line number), so the test decides when each batch
ends. Not collected by pytest; tests copy it beside the config that names it.
``X`` (FP32 ``[1]``) -> ``Y`` (FP32 ``[1]``): X itself.
"""

from __future__ import annotations

import fcntl
import time
from pathlib import Path

import numpy as np


class Turnstile:
    def load(self, context):
        self.name = context.parameters["name"]
        self.log = Path(context.parameters["log"])
        self.gates = Path(context.parameters["gates"])

    def warmup_request(self):
        return {"X": np.full((1, 1), -1.0, np.float32)}

    def preprocess(self, request):
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        if (batch["x"] < 0).all():  # warm-up's batch passes without a line or a gate
            return {"y": batch["x"]}
        values = " ".join(str(int(v)) for v in batch["x"].ravel())
        with self.log.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(f"{self.name} {values}\n")
            f.flush()
            f.seek(0)
        n = len(self.log.read_text().splitlines())
        gate = self.gates / f"open-{n}"
        give_up = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < give_up:
            time.sleep(0.002)
        return {"y": batch["x"]}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}
