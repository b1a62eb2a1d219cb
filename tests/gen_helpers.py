"""Helpers for the generation tests: the decoder test server's models and its statistics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lm_models

# The generic statistics pollers, under the names the generation tests use.
from helpers import stats as gen_stats  # noqa: F401
from helpers import wait_for_stats as wait_gen  # noqa: F401

# The prompt whose greedy continuation on "gpt2-eos" ends with an end token.
EOS_PROMPT = "The quick brown fox"
GENERATION = {
    "max_num_seqs": 8,
    "max_model_len": 128,
    "max_tokens_default": 64,
    "max_tokens_cap": 120,
}


def build_decoder_models(root: Path, lms: Path) -> dict[str, Any]:
    """gpt2, llama, and "gpt2-eos": gpt2 with an end token that greedy decoding
    of :data:`EOS_PROMPT` produces (as a chat model's end-of-turn token).

    Returns the config's model entries and what the eos model will do.
    """
    from aserve.config import GenerationConfig
    from aserve.engines.decoder import DecoderEngine
    from aserve.types.generation import SamplingParams

    gpt2 = lm_models.tiny_model("gpt2", lms)
    llama = lm_models.tiny_model("llama", lms)
    engine = DecoderEngine(gpt2, GenerationConfig(max_num_seqs=1, max_model_len=128))
    engine.load()
    seq = engine.new_sequence("r", EOS_PROMPT, SamplingParams(temperature=0, max_tokens=16))
    while not seq.finished:
        engine.step([seq] if not seq.output_ids else [], [seq] if seq.output_ids else [])
    ids = seq.output_ids
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    eos_dir = shutil.copytree(gpt2, root / "gpt2-eos")
    eos = engine.tokenizer.inner.token_to_id("<|endoftext|>")
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, ids[k]]}))
    models = [
        {"name": name, "engine": "decoder", "path": str(path), "generation": GENERATION}
        for name, path in (("gpt2", gpt2), ("llama", llama), ("gpt2-eos", eos_dir))
    ]
    return {"models": models, "eos_tokens": k + 1, "eos_text": engine.tokenizer.decode(ids[:k])}


def start_gpt2_server(tmp_path_factory: Any, folder_name: str, **generation: Any) -> Any:
    """A server (HTTP and gRPC) of the tiny gpt2 alone, as ``gpt2``, with
    :data:`GENERATION` and the given overrides."""
    from conftest import start_server, write_config

    gpt2 = lm_models.tiny_model("gpt2", tmp_path_factory.getbasetemp() / "lms")
    folder = tmp_path_factory.mktemp(folder_name)
    model = {
        "name": "gpt2", "engine": "decoder", "path": str(gpt2),
        "generation": {**GENERATION, **generation},
    }  # fmt: skip
    return start_server(write_config(folder, {"grpc": {"port": 0}, "models": [model]}))


def idle(s: dict[str, Any]) -> bool:
    g = s["generation"]
    return (g["running_sequence_count"], g["waiting_sequence_count"], g["kv_slots_in_use"]) == (
        0, 0, 0,
    )  # fmt: skip
