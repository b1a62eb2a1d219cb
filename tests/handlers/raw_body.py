"""A python-engine handler for raw bodies (``POST /predictions``) and V2 tensors alike.

Not collected by pytest; tests copy it beside the config that names it.
Each request becomes one row ``n`` (its body's length), so raw and V2
requests batch together; ``infer`` adds ``batch``, the batch's size. Raw
answers, by the request's content type:

- ``multipart/form-data``: JSON ``{"parts": [{name, filename, content_type,
  length, sha256}], "batch"}``;
- ``application/json``: JSON ``{"echo": <the body with its strings upper-cased>, "batch"}``;
- ``text/plain``: the text upper-cased (a ``str`` answer);
- ``application/x-reverse``: the bytes reversed, as ``application/x-reversed``;
- anything else: JSON ``{"length", "sha256", "content_type", "parameters", "batch"}``.

V2: ``TEXT`` (BYTES ``[1]``) -> ``LENGTH`` and ``BATCH`` (INT64 ``[1]``).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np


def _upper(doc):
    if isinstance(doc, str):
        return doc.upper()
    if isinstance(doc, list):
        return [_upper(x) for x in doc]
    if isinstance(doc, dict):
        return {k: _upper(v) for k, v in doc.items()}
    return doc


class RawBody:
    def load(self, context):
        pass

    def preprocess(self, request):
        texts = request.inputs["TEXT"].reshape(-1)
        return {"n": np.array([[len(t)] for t in texts], np.int64)}

    def preprocess_raw(self, request):
        body = request.body
        size = sum(len(p.data) for p in body) if isinstance(body, list) else len(body)
        return {"n": np.array([[size]], np.int64)}

    def infer(self, batch):
        n = batch["n"]
        return {"n": n, "batch": np.full_like(n, len(n))}

    def postprocess(self, outputs, request):
        return {"LENGTH": outputs["n"], "BATCH": outputs["batch"]}

    def postprocess_raw(self, outputs, request):
        batch = int(outputs["batch"][0, 0])
        body, kind = request.body, (request.content_type or "").split(";")[0]
        if isinstance(body, list):
            parts = [
                {
                    "name": p.name,
                    "filename": p.filename,
                    "content_type": p.content_type,
                    "length": len(p.data),
                    "sha256": hashlib.sha256(p.data).hexdigest(),
                }
                for p in body
            ]
            return {"parts": parts, "batch": batch}
        if kind == "application/json":
            return {"echo": _upper(json.loads(body)), "batch": batch}
        if kind == "text/plain":
            return body.decode().upper()
        if kind == "application/x-reverse":
            return body[::-1], "application/x-reversed"
        return {
            "length": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
            "content_type": request.content_type,
            "parameters": request.parameters,
            "batch": batch,
        }
