"""A python-engine handler for the tests: text (BYTES) -> byte ids (FP32).

Not collected by pytest; tests copy it beside the config that names it.

- ``TEXT`` (BYTES ``[1]``) -> ``IDS`` (FP32 ``[16]``): the text's first 16
  bytes as numbers, zero-padded, times ``parameters.scale``;
  ``LENGTH`` (INT64 ``[1]``): the text's length in bytes;
  ``UPPER`` (BYTES ``[1]``): the text upper-cased;
  ``BATCH`` (INT64 ``[1]``): how many items ``infer`` ran together
  (``parameters.delay_s`` makes ``infer`` slower, so that requests pile up).
- A text starting with ``!pre`` fails in preprocess, ``!post`` in
  postprocess, and one of only ``#`` fails ``infer`` for its whole batch;
  one starting with ``!slow`` takes ``parameters.slow_post_s`` (0.5 s) in
  postprocess.
"""

from __future__ import annotations

import time

import numpy as np

WIDTH = 16


def tokenize(text: bytes) -> np.ndarray:
    ids = np.zeros(WIDTH, np.float32)
    raw = np.frombuffer(text[:WIDTH], np.uint8)
    ids[: len(raw)] = raw
    return ids


class ByteTokenizer:
    def load(self, context):
        self.scale = float(context.parameters.get("scale", 1.0))
        self.delay_s = float(context.parameters.get("delay_s", 0.0))
        self.slow_post_s = float(context.parameters.get("slow_post_s", 0.5))

    def warmup_request(self):
        return {"TEXT": np.array([[b"warm up"]], dtype=object)}

    def preprocess(self, request):
        texts = request.inputs["TEXT"].reshape(-1)
        for t in texts:
            if t.startswith(b"!pre"):
                raise ValueError(f"cannot tokenize {t.decode()!r}")
        request.state["texts"] = list(texts)
        return {"ids": np.stack([tokenize(t) for t in texts])}

    def infer(self, batch):
        ids = batch["ids"]
        if np.any(np.all(ids[:, :4] == ord("#"), axis=1)):
            raise RuntimeError("infer refuses a batch holding '####'")
        time.sleep(self.delay_s)
        n = len(ids)
        return {"ids": ids * self.scale, "batch": np.full((n, 1), n, np.int64)}

    def postprocess(self, outputs, request):
        texts = request.state["texts"]
        if any(t.startswith(b"!post") for t in texts):
            raise KeyError("postprocess cannot answer this one")
        if any(t.startswith(b"!slow") for t in texts):
            time.sleep(self.slow_post_s)
        return {
            "IDS": outputs["ids"],
            "LENGTH": [[len(t)] for t in texts],
            "UPPER": [[t.upper()] for t in texts],
            "BATCH": outputs["batch"],
        }


class NotAHandler:
    def load(self, context):
        pass
