"""A python-engine handler that holds a known amount of memory, and whose requests
the test can hold.

``load`` fills ``parameters.mib`` MiB of memory (touched, so resident); with
``parameters.load_gate`` it then touches ``parameters.began``-load and waits
until the file ``load_gate`` exists. Each
request with ``X`` >= 0 touches ``parameters.began``-N (N its value) and then
waits until the file ``parameters.gate`` exists (warm-up's, negative, passes
at once), so the test decides when the model stops being busy. Not collected
by pytest; tests copy it beside the config that names it. ``X`` (FP32 ``[1]``)
-> ``Y`` (FP32 ``[1]``): X itself.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


class Ballast:
    def load(self, context):
        params = context.parameters
        self.ballast = np.ones(int(params["mib"]) * (1 << 20) // 8, np.float64)
        self.began = params.get("began")
        self.gate = Path(params["gate"]) if params.get("gate") else None
        if params.get("load_gate"):
            Path(f"{self.began}-load").touch()
            _wait_for(Path(params["load_gate"]))

    def warmup_request(self):
        return {"X": np.full((1, 1), -1.0, np.float32)}

    def preprocess(self, request):
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        x = batch["x"]
        if self.gate is not None and (x >= 0).any():
            for v in x.ravel():
                Path(f"{self.began}-{int(v)}").touch()
            _wait_for(self.gate)
        return {"y": x}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}


def _wait_for(path: Path) -> None:
    give_up = time.monotonic() + 60
    while not path.exists() and time.monotonic() < give_up:
        time.sleep(0.002)
