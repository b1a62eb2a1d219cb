"""aserve's python handler for all-MiniLM-L6-v2: tokenize per request, the model per batch.

``preprocess`` tokenizes one request's text in a handler thread (so it
overlaps the model running on the executor); ``infer`` runs the transformer,
mean pooling and normalisation on the batch the batcher stacked. Requests
batch together when their token counts are equal (the batcher's shape key).
Served with ``"executor": "process"``: ``infer`` runs in a worker process
(role "infer", which loads the weights) and the rest in the server (role
"front", which needs the tokenizer only).
"""

from __future__ import annotations

import os

import common
import numpy as np


class MiniLMHandler:
    def load(self, context):
        os.environ.setdefault("BENCH_MINILM_DIR", context.parameters["model_dir"])
        common.set_threads()
        weights = getattr(context, "role", "both") != "front"
        self.model = common.MiniLM(context.parameters["model_dir"], weights=weights)

    def warmup_request(self):
        return {"TEXT": np.array([[common.SENTENCE.encode()]], dtype=object)}

    def preprocess(self, request):
        texts = [t.decode() for t in request.inputs["TEXT"].reshape(-1)]
        return self.model.tokenize(texts)

    def infer(self, batch):
        return {"embedding": self.model.forward(batch["input_ids"], batch["attention_mask"])}

    def postprocess(self, outputs, request):
        return {"EMBEDDING": outputs["embedding"]}
