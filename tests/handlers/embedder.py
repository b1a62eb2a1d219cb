"""A python-engine handler for the tests: a tiny real embedding model.

Not collected by pytest; tests copy it beside the config that names it, and
import it to compute the embeddings they expect (:func:`tokenize`, :func:`embed`).

A deterministic tokenizer (lower-cased words, each hashed to one of
``VOCAB`` ids) and an embedding bag: the mean of each token's row of a fixed
random table, L2-normalised. One model takes either:

- ``TEXT`` (BYTES ``[1]``), tokenized here; or
- ``IDS`` (INT64 ``[-1]``), token ids (taken modulo ``VOCAB``).

Outputs: ``EMBEDDING`` (FP32 ``[DIM]``), and ``TOKENS`` (INT64 ``[1]``) when
the model declares it: how many tokens the item had. Items are padded to
``WIDTH`` tokens in ``preprocess`` (longer ones are cut), so any two items
batch together. A text starting with ``!fail`` fails in ``preprocess``.
With ``parameters.gate`` (a folder), ``infer`` waits while
the file ``closed`` is in it, so a test can hold a batch and let others queue.
"""

from __future__ import annotations

import re
import time
import zlib
from pathlib import Path

import numpy as np

VOCAB = 997
DIM = 16
WIDTH = 64
_TABLE = np.random.default_rng(7).standard_normal((VOCAB, DIM)).astype(np.float32)
_WORD = re.compile(rb"[a-z0-9]+")


def tokenize(text: bytes) -> list[int]:
    """The token ids of ``text``: one per word, from its CRC-32."""
    return [zlib.crc32(w) % VOCAB for w in _WORD.findall(text.lower())] or [0]


def embed(ids: list[int]) -> np.ndarray:
    """The embedding of one item's token ids (the first WIDTH of them)."""
    rows = _TABLE[np.asarray(ids[:WIDTH]) % VOCAB]
    v = rows.mean(axis=0)
    return (v / np.linalg.norm(v)).astype(np.float32)


class Embedder:
    def load(self, context):
        self.input = context.inputs[0].name
        self.outputs = {s.name for s in context.outputs}
        gate = context.parameters.get("gate")
        self.closed = Path(gate) / "closed" if gate else None

    def warmup_request(self):
        if self.input == "TEXT":
            return {"TEXT": np.array([[b"warm up"]], dtype=object)}
        return {"IDS": np.array([[1, 2, 3]], dtype=np.int64)}

    def preprocess(self, request):
        items = request.inputs[self.input]
        ids = np.zeros((len(items), WIDTH), np.int64)
        count = np.zeros((len(items), 1), np.int64)
        for row, item in enumerate(items):
            if self.input == "TEXT" and item[0].startswith(b"!fail"):
                raise ValueError(f"cannot embed {item[0].decode()!r}")
            tokens = tokenize(item[0]) if self.input == "TEXT" else [int(t) for t in item]
            tokens = tokens[:WIDTH]
            ids[row, : len(tokens)] = np.asarray(tokens) % VOCAB
            count[row, 0] = len(tokens)
        return {"ids": ids, "count": count}

    def infer(self, batch):
        give_up = time.monotonic() + 60
        while self.closed is not None and self.closed.exists() and time.monotonic() < give_up:
            time.sleep(0.002)
        ids, count = batch["ids"], batch["count"]
        mask = (np.arange(WIDTH)[None, :] < count).astype(np.float32)
        v = (_TABLE[ids] * mask[:, :, None]).sum(axis=1) / count.astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        return {"embedding": v.astype(np.float32), "count": count}

    def postprocess(self, outputs, request):
        out = {"EMBEDDING": outputs["embedding"]}
        if "TOKENS" in self.outputs:
            out["TOKENS"] = outputs["count"]
        return out
