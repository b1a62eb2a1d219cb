"""The decoder engine: causal language models (GPT-2, Llama) for token streaming.

Everything in this package runs on the engine's one executor thread (or, for
loading, in a worker thread during startup); nothing here touches asyncio.

- ``engine.DecoderEngine``: load/unload, ``new_sequence``, ``step``, ``free``
- ``model.DecoderModel``: our forward pass (``prefill``, ``decode``)
- ``kv_cache.KVCache``: the preallocated cache and its slots
- ``sampling``: the per-sequence sampler (its settings, ``SamplingParams``, and
  the step's ``StepOutput`` are torch-free: :mod:`aserve.types.generation`)
- ``tokenizer``, ``detokenizer``, ``stop``: text in and out
- ``checkpoint``, ``gpt2``, ``llama``, ``spec``, ``rope``: reading model folders
"""

from __future__ import annotations

from aserve.config import GenerationConfig
from aserve.engines.decoder.engine import DecoderEngine
from aserve.engines.decoder.kv_cache import CacheFull, KVCache, SequenceTooLong
from aserve.engines.decoder.model import DecoderModel
from aserve.engines.decoder.sequence import Sequence
from aserve.engines.decoder.spec import CheckpointError
from aserve.engines.decoder.tokenizer import Tokenizer

__all__ = [
    "CacheFull",
    "CheckpointError",
    "DecoderEngine",
    "DecoderModel",
    "GenerationConfig",
    "KVCache",
    "Sequence",
    "SequenceTooLong",
    "Tokenizer",
]
