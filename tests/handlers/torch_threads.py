"""A python-engine handler that reports torch's intra-op threads where each method runs.

Not collected by pytest; tests copy it beside the config that names it.
``X`` (FP32 ``[1]``) -> ``PRE``, ``INFER``, ``POST`` (INT64 ``[1]``): what
``torch.get_num_threads()`` said in ``preprocess`` (a handler thread),
``infer`` (an executor thread or a worker process) and ``postprocess``.
With ``parameters["torch"]`` false it never imports torch and reports
instead whether torch is imported in the process that ran ``infer``
(``INFER`` 1 or 0; ``PRE`` and ``POST`` -1).
"""

from __future__ import annotations

import sys

import numpy as np


class TorchThreads:
    def load(self, context):
        self.torch = None
        if context.parameters.get("torch", True):
            import torch  # as a handler that uses torch would, in its load

            self.torch = torch

    def _threads(self):
        return -1 if self.torch is None else self.torch.get_num_threads()

    def _column(self, value, n):
        return np.full((n, 1), value, np.int64)

    def warmup_request(self):
        return {"X": np.zeros((1, 1), np.float32)}

    def preprocess(self, request):
        request.state["pre"] = self._threads()
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        n = batch["x"].shape[0]
        if self.torch is None:
            return {"infer": self._column(int("torch" in sys.modules), n)}
        return {"infer": self._column(self._threads(), n)}

    def postprocess(self, outputs, request):
        n = request.batch_size
        return {
            "PRE": self._column(request.state["pre"], n),
            "INFER": outputs["infer"],
            "POST": self._column(self._threads(), n),
        }
