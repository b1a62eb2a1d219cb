"""An example python-engine handler: text in, bag-of-words features out.

Served by configs/handler.json on its own and, in configs/pipeline.json, as
the first step of a pipeline that feeds its features to a torch model. See
configs/README.md.
"""

from __future__ import annotations

import zlib
from collections import Counter

import numpy as np

DIM = 16


def words(text: bytes) -> list[str]:
    return text.decode("utf-8", errors="replace").lower().split()


def counts(text: bytes) -> np.ndarray:
    """Each word adds 1 at a slot picked by its hash."""
    out = np.zeros(DIM, np.float32)
    for word in words(text):
        out[zlib.crc32(word.encode()) % DIM] += 1
    return out


def features(text: bytes) -> np.ndarray:
    """What the model returns for one text: its counts scaled to unit length."""
    c = counts(text)[None]
    return (c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-6))[0]


class TextFeatures:
    def load(self, context):
        # context: model_name, model_version, device, instances, base_dir, path,
        # parameters (the config's "parameters"), inputs, outputs.
        self.min_norm = float(context.parameters.get("min_norm", 1e-6))

    def warmup_request(self):
        # Optional: one request's inputs, run through every stage before serving.
        return {"TEXT": np.array([[b"warm up"]], dtype=object)}

    def preprocess(self, request):
        # Per request, in a handler thread. request.inputs["TEXT"] is a [batch, 1]
        # array of bytes; request.state carries things on to postprocess.
        texts = request.inputs["TEXT"].reshape(-1)
        request.state["words"] = [words(t) for t in texts]
        return {"counts": np.stack([counts(t) for t in texts])}

    def infer(self, batch):
        # Per batch, on the model's executor: the arrays of several requests stacked.
        c = batch["counts"]
        norm = np.maximum(np.linalg.norm(c, axis=1, keepdims=True), self.min_norm)
        return {"features": c / norm}

    def postprocess(self, outputs, request):
        # Per request again: this request's rows of the batch in, the model's
        # declared outputs out (arrays, or lists numpy can turn into them).
        top = [Counter(w).most_common(1)[0][0] if w else "" for w in request.state["words"]]
        return {
            "FEATURES": outputs["features"],
            "TOP_WORD": [[t] for t in top],
            "WORDS": [[len(w)] for w in request.state["words"]],
        }
