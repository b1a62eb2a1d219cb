"""A python-engine handler that shows where each of its methods runs.

Not collected by pytest; tests copy it beside the config that names it.
``X`` (FP32 ``[2]``) -> ``Y`` = 2 * X, and ``PID`` (INT64 ``[1]``): the
process that ran ``infer``. Each method checks that its handler was loaded
for a role that includes it (``context.role``), so a server that sent a
method to the wrong process fails the request. A batch holding -999 raises
``SystemExit`` in ``infer``; one holding -777 kills its process outright.
``parameters["fail_in"]`` names a role whose ``load`` raises; while the file
``parameters["hold_load_while"]`` exists, ``load`` in a worker waits (a test
holds a restarting worker back with it). With ``parameters["front_gate"]``
(a FIFO), the front's ``load`` first blocks opening it until the test opens
its other end (before it raises for ``fail_in``).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

EXIT, KILL = -999.0, -777.0


class Probe:
    def load(self, context):
        self.role = context.role
        gate = context.parameters.get("front_gate")
        if gate and self.role == "front":
            with open(gate, "rb"):  # returns once the test opens the FIFO for writing
                pass
        if context.parameters.get("fail_in") == self.role:
            raise RuntimeError(f"cannot load in role {self.role}")
        hold = context.parameters.get("hold_load_while")
        if hold and self.role == "infer":
            deadline = time.monotonic() + 60  # never hold a test run forever
            while os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.01)
        # The "weights": only where infer runs.
        self.scale = None if self.role == "front" else np.float32(2.0)

    def _check(self, method, roles):
        if self.role not in roles:
            raise RuntimeError(f"{method} called on a handler loaded for role {self.role}")

    def warmup_request(self):
        return {"X": np.zeros((1, 2), np.float32)}

    def preprocess(self, request):
        self._check("preprocess", ("front", "both"))
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        self._check("infer", ("infer", "both"))
        x = batch["x"]
        if np.any(x == EXIT):
            raise SystemExit("exit on purpose")
        if np.any(x == KILL):
            os.kill(os.getpid(), signal.SIGKILL)
        pid = np.full((x.shape[0], 1), os.getpid(), np.int64)
        return {"y": x * self.scale, "pid": pid}

    def postprocess(self, outputs, request):
        self._check("postprocess", ("front", "both"))
        return {"Y": outputs["y"], "PID": outputs["pid"]}
