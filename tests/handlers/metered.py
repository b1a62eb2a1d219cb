"""A python-engine handler that keeps custom metrics (``context.metrics``) in every method.

Not collected by pytest; tests copy it beside the config that names it.
``X`` (FP32 ``[2]``) -> ``Y`` (FP32 ``[1]``): the sum of each row. Each
request's ``parameters.tag`` labels the requests counter (the cardinality
test sends many); ``infer`` counts items and observes their sums, so with
``"executor": "process"`` those cross from the worker process.
"""

from __future__ import annotations

import os


class Metered:
    def load(self, context):
        m = context.metrics
        self.requests = m.counter("requests", "Requests preprocessed, by tag.", ["tag"])
        self.items = m.counter("items_total", "Items inferred, by role of the handler.", ["role"])
        self.sums = m.histogram("row_sums", "Row sums.", buckets=[1, 10, 100])
        self.loaded = m.gauge("loaded", "Handler instances loaded, by role.", ["role"])
        self.loaded.labels(role=context.role).inc()
        self.role = context.role
        self.pid = m.gauge("infer_pid", "The process that ran the last infer.")

    def preprocess(self, request):
        self.requests.labels(str(request.parameters.get("tag", "none"))).inc()
        return {"x": request.inputs["X"]}

    def infer(self, batch):
        y = batch["x"].sum(axis=1, keepdims=True)
        self.items.labels(role=self.role).inc(len(y))
        for v in y[:, 0]:
            self.sums.observe(float(v))
        self.pid.set(os.getpid())
        return {"y": y}

    def postprocess(self, outputs, request):
        return {"Y": outputs["y"]}
