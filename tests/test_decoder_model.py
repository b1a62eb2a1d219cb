"""Our GPT-2 / Llama forward pass against transformers, and checkpoint errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import lm_models
import pytest
import torch
from safetensors.torch import load_file, save_file

from aserve.engines.decoder import CacheFull, CheckpointError, DecoderModel, SequenceTooLong

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40],
    [44],
]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def lm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lm_models.tiny_model(request.param, tmp_path_factory.getbasetemp() / "lms")


@pytest.fixture(scope="module")
def pair(lm_dir: Path) -> tuple[DecoderModel, torch.nn.Module]:
    return DecoderModel.load(lm_dir), lm_models.load_reference(lm_dir)


def reference_last_logits(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0, -1]


def test_prefill_of_ragged_prompts_matches_transformers(pair: tuple) -> None:
    ours, ref = pair
    cache = ours.new_cache(8, 64)
    slots = [cache.alloc() for _ in PROMPTS]
    logits = ours.prefill(cache, slots, PROMPTS)
    assert logits.shape == (len(PROMPTS), ours.spec.vocab_size)
    for row, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(
            logits[row], reference_last_logits(ref, prompt), atol=1e-4, rtol=1e-4
        )
    # The same prompt alone gives the same logits as inside the padded batch.
    alone = ours.prefill(cache, [slots[1]], [PROMPTS[1]])
    torch.testing.assert_close(alone[0], logits[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["scattered", "contiguous"])
def test_decode_steps_match_transformers(pair: tuple, layout: str) -> None:
    ours, ref = pair
    cache = ours.new_cache(6, 64)
    taken = [cache.alloc() for _ in range(6)]
    if layout == "scattered":  # slots out of order with holes: decode must gather
        for s in (1, 3):
            cache.free(s)
        slots = [5, 0, 2, 4]
    else:  # slots 0..3 in order: decode reads a view of the cache
        for s in taken[4:]:
            cache.free(s)
        slots = [0, 1, 2, 3]
    seqs = [list(p) for p in PROMPTS]
    logits = ours.prefill(cache, slots, seqs)
    for step in range(6):
        for seq, token in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            seq.append(token)
        # Sequences sit at different positions: each attends to its own length only.
        logits = ours.decode(cache, slots, [s[-1] for s in seqs], [len(s) - 1 for s in seqs])
        for row, seq in enumerate(seqs):
            want = reference_last_logits(ref, seq)
            torch.testing.assert_close(logits[row], want, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_decode_is_independent_of_batch_neighbours(pair: tuple) -> None:
    ours, _ = pair
    cache = ours.new_cache(4, 32)
    slots = [cache.alloc() for _ in range(3)]
    ours.prefill(cache, slots, PROMPTS[:3])
    both = ours.decode(cache, slots, [1, 2, 3], [7, 3, 11])
    alone = ours.decode(cache, [slots[2]], [3], [11])
    torch.testing.assert_close(alone[0], both[2], atol=1e-4, rtol=1e-4)


def test_kv_cache_full_and_too_long(pair: tuple) -> None:
    ours, _ = pair
    cache = ours.new_cache(2, 16)
    a, b = cache.alloc(), cache.alloc()
    assert cache.num_free == 0
    with pytest.raises(CacheFull, match="all 2 KV-cache slots"):
        cache.alloc()
    with pytest.raises(SequenceTooLong, match="17 tokens exceeds max_model_len \\(16\\)"):
        ours.prefill(cache, [a], [list(range(1, 18))])
    ours.prefill(cache, [a], [list(range(1, 17))])  # exactly full is fine
    with pytest.raises(SequenceTooLong, match="max_model_len"):
        ours.decode(cache, [a], [5], [16])
    cache.free(b)
    with pytest.raises(ValueError, match="slot 1 is not allocated"):
        cache.free(b)
    with pytest.raises(ValueError, match="not allocated"):
        ours.decode(cache, [b], [5], [0])
    assert cache.alloc() == b


def test_cache_longer_than_the_model_context_is_refused(pair: tuple) -> None:
    ours, _ = pair
    with pytest.raises(ValueError, match="exceeds the model's context length \\(128"):
        ours.new_cache(1, 129)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unsupported_model_type_is_refused(lm_dir: Path, tmp_path: Path) -> None:
    folder = _copy(lm_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "mamba"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model_type 'mamba' is not supported.*gpt2, llama"):
        DecoderModel.load(folder)


def test_missing_files_are_named(lm_dir: Path, tmp_path: Path) -> None:
    folder = _copy(lm_dir, tmp_path / "m")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only pickled weights"):
        DecoderModel.load(folder)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        DecoderModel.load(folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        DecoderModel.load(folder)


def test_missing_weight_is_named(lm_dir: Path, tmp_path: Path) -> None:
    folder = _copy(lm_dir, tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    victim = next(n for n in tensors if n.endswith(("ln_f.weight", "model.norm.weight")))
    del tensors[victim]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(f"weight '{victim}' is missing")):
        DecoderModel.load(folder)


def test_sharded_weights_load(lm_dir: Path, tmp_path: Path) -> None:
    folder = _copy(lm_dir, tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / file))
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.testing.assert_close(_first_logits(folder), _first_logits(lm_dir))


def _first_logits(folder: Path) -> torch.Tensor:
    model = DecoderModel.load(folder)
    cache = model.new_cache(1, 16)
    return model.prefill(cache, [cache.alloc()], [PROMPTS[0]])
