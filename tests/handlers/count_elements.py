"""A python-engine handler for the tests: how many elements a BYTES tensor has.

Not collected by pytest; tests copy it beside the config that names it.
``ITEMS`` (BYTES ``[-1]``) -> ``COUNT`` (INT64 ``[1]``): the elements of the
request's row, and ``TOTAL`` (INT64 ``[1]``) their bytes. Nothing here costs
per element on the loop (nor, for ``COUNT``, at all): the hostile-input tests
send it millions of elements to see what decoding them costs.
"""

from __future__ import annotations

import numpy as np


class CountElements:
    def load(self, context):
        pass

    def warmup_request(self):
        return {"ITEMS": np.array([[b"a", b"bc"]], dtype=object)}

    def preprocess(self, request):
        items = request.inputs["ITEMS"]
        # Counting bytes walks the elements: only for small tensors.
        total = sum(map(len, items.reshape(-1))) if items.size <= 1 << 16 else -1
        return {"counts": np.array([[items[0].size, total]], np.int64)}

    def infer(self, batch):
        return {"counts": batch["counts"]}

    def postprocess(self, outputs, request):
        counts = outputs["counts"]
        return {"COUNT": counts[:, :1], "TOTAL": counts[:, 1:]}
