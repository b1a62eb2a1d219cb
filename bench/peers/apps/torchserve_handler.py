"""TorchServe handler for the benchmark models (packed into the .mar by bench.peers).

The workload comes from the archive's ``setup.json`` (written at archive time).
TorchServe's frontend batches (``batchSize`` 32, ``maxBatchDelay`` 5 ms) and
hands ``handle`` the list of requests of one batch.
"""

from __future__ import annotations

import json
import os

import common


class BenchHandler:
    def __init__(self) -> None:
        self.model = None
        self.workload = "tiny"

    def initialize(self, context) -> None:
        folder = context.system_properties.get("model_dir")
        with open(os.path.join(folder, "setup.json")) as f:
            setup = json.load(f)
        for key, value in setup.get("env", {}).items():
            os.environ.setdefault(key, value)
        self.workload = setup["workload"]
        common.set_threads()
        self.model = common.load(self.workload)

    def handle(self, data, context):
        items = []
        for row in data:
            body = row.get("body") if row.get("body") is not None else row.get("data")
            if isinstance(body, (bytes, bytearray)):
                body = json.loads(body)
            items.append(common.parse_input(body, self.workload))
        out = common.run_batch(self.model, self.workload, items)
        return [common.response_doc(self.workload, r) for r in out]


_service = BenchHandler()


def handle(data, context):
    if _service.model is None:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
