"""A python-engine handler for the tests: a stateful model that sums per sequence.

Not collected by pytest; tests copy it beside the config that names it.
``INPUT`` (INT32 ``[1]``) -> ``OUTPUT`` (INT32 ``[1]``): the running sum of
the sequence's inputs, kept in ``request.sequence.state``. ``SLOT`` (INT32
``[1]``) is the sequence's slot. ``infer`` fails a batch that holds two
requests of one sequence, which the server must never cut.
"""

from __future__ import annotations

import numpy as np


class Accumulator:
    def load(self, context):
        pass

    def preprocess(self, request):
        seq = request.sequence
        if seq is None:
            raise ValueError("a request of a sequence model came without its sequence")
        if seq.start:
            if "sum" in seq.state:
                raise ValueError("a new sequence's state is not empty")
            seq.state["sum"] = 0
        key = str(seq.id).encode()
        return {"INPUT": request.inputs["INPUT"], "KEY": np.array([key], dtype=object)}

    def infer(self, batch):
        keys = list(batch["KEY"])
        if len(set(keys)) != len(keys):
            raise ValueError(f"a batch holds two requests of one sequence: {keys}")
        return {"INPUT": batch["INPUT"]}

    def postprocess(self, outputs, request):
        seq = request.sequence
        seq.state["sum"] += int(outputs["INPUT"][0, 0])
        return {
            "OUTPUT": np.array([[seq.state["sum"]]], dtype=np.int32),
            "SLOT": np.array([[seq.slot]], dtype=np.int32),
        }
