"""A python-engine handler that hands back whatever strings its request makes it.

Not collected by pytest; tests copy it beside the config that names it. What
it returns must never break ``/metrics`` or the answer's encoding.

Raw requests (``POST /predictions``):

- ``multipart/form-data``: each part's filename labels the ``uploads``
  counter (``filename``, ``field`` and ``type`` labels); the answer is JSON
  ``{"parts": [{name, filename, filename_bytes (hex), content_type}],
  "content_type"}``; with ``?answer=text`` the first filename as a ``str``.
- ``application/json``: an object read with the stdlib's parser, which turns
  ``\\udcff`` escapes into lone surrogates. Its optional keys: ``label`` (a
  value of the ``echo`` counter's label), ``metric``, ``help`` and
  ``label_name`` (a metric declared then, counted once), and ``answer`` with
  ``text``: what ``postprocess_raw`` does with ``text`` ("str": returns it,
  "json": returns ``{"text": text}``, "typed": returns ``(b"x", text)``,
  "raise": raises ``ValueError(text)``; else ``{"ok": true}``).

V2: ``TEXT`` (BYTES ``[1]``), decoded with ``surrogateescape``, labels the
``echo`` counter in ``preprocess`` and the ``inferred`` counter in ``infer``
(so with ``"executor": "process"`` in the worker), and comes back as ``ECHO``
(BYTES ``[1]``), a ``str``; with ``parameters.answer`` "bytes", as the bytes
it came as.
"""

from __future__ import annotations

import json

import numpy as np


class HostileStrings:
    def load(self, context):
        self.metrics = context.metrics
        self.uploads = self.metrics.counter(
            "uploads", "Files uploaded, by name.", ["filename", "field", "type"]
        )
        self.echo = self.metrics.counter("echo", "Strings echoed, by value.", ["value"])
        self.inferred = self.metrics.counter("inferred", "Strings inferred, by value.", ["value"])

    def preprocess(self, request):
        texts = [t.decode("utf-8", "surrogateescape") for t in request.inputs["TEXT"].reshape(-1)]
        for t in texts:
            self.echo.labels(t).inc()
        request.state["texts"] = texts
        return {
            "n": np.array([[len(t)] for t in texts], np.int64),
            "text": request.inputs["TEXT"].reshape(-1, 1),
        }

    def preprocess_raw(self, request):
        body = request.body
        if isinstance(body, list):
            for p in body:
                self.uploads.labels(p.filename, p.name, p.content_type).inc()
        else:
            doc = json.loads(body)
            request.state["doc"] = doc
            if "label" in doc:
                self.echo.labels(doc["label"]).inc()
            if "metric" in doc or "help" in doc or "label_name" in doc:
                labels = [doc["label_name"]] if "label_name" in doc else []
                metric = self.metrics.counter(
                    doc.get("metric", "declared"), doc.get("help", "Declared late."), labels
                )
                (metric.labels(doc.get("label", "x")) if labels else metric).inc()
        return {"n": np.array([[1]], np.int64)}

    def infer(self, batch):
        for t in batch.get("text", np.empty((0, 1), object)).reshape(-1):
            self.inferred.labels(t.decode("utf-8", "surrogateescape")).inc()
        return {"n": batch["n"]}

    def postprocess(self, outputs, request):
        texts = request.state["texts"]
        if request.parameters.get("answer") == "bytes":
            texts = [t.encode("utf-8", "surrogateescape") for t in texts]
        return {"ECHO": np.array([[t] for t in texts], dtype=object)}

    def postprocess_raw(self, outputs, request):
        body = request.body
        if isinstance(body, list):
            if request.parameters.get("answer") == "text":
                return body[0].filename
            parts = [
                {
                    "name": p.name,
                    "filename": p.filename,
                    "filename_bytes": None if p.filename_bytes is None else p.filename_bytes.hex(),
                    "content_type": p.content_type,
                }
                for p in body
            ]
            return {"parts": parts, "content_type": request.content_type}
        doc = request.state["doc"]
        answer, text = doc.get("answer"), doc.get("text", "")
        if answer == "str":
            return text
        if answer == "json":
            return {"text": text}
        if answer == "typed":
            return b"x", text
        if answer == "raise":
            raise ValueError(text)
        return {"ok": True}
