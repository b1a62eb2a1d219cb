"""A tiny GPT-2 and its tokenizer, built from a fixed seed with torch and tokenizers only.

The folder it writes is the Hugging Face layout the decoder engine loads
(``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with a chat template), so every route a real model
takes runs on it with nothing downloaded. Its weights are random: the text it
writes is gibberish.

- Tokenizer: a byte-level BPE (every byte has a token, so any text encodes)
  trained on :data:`TEXT`, ``<|endoftext|>`` as BOS/EOS. BPE training is
  deterministic for a given ``tokenizers`` version.
- Weights: ``torch.randn`` from seeded generators, in GPT-2's ``Conv1D``
  layout and names. Standard deviation 0.5 (not GPT-2's 0.02), so greedy
  decoding wanders instead of repeating one token. Embedding rows of tokens
  that are not printable ASCII are zero: with tied embeddings their logit is
  then 0 while the best token's is far above, so generated text is
  (practically always) printable and streamed pieces join cleanly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = """\
The quick brown fox jumps over the lazy dog. A server streams tokens to many clients,
one step at a time, and every client reads its own words as they arrive. When a client
goes away, its sequence leaves the batch and the cache slot is free again. Small models
say strange things, but they say them quickly: seven silver spoons, eleven green lamps,
a river of numbers 0 1 2 3 4 5 6 7 8 9 and the letters of the alphabet from A to Z.
Hello world! Does it stop? Yes, it stops when it sees the end, or when it runs out of room.
"""

END = "<|endoftext|>"

# Each turn as "role: content" ended by the end token, then "assistant:".
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# The shape of builtin:tiny-gpt2: 0.7M parameters, 2.8 MB, loads in
# milliseconds; 2048 positions: the generation block's default max_model_len fits.
VOCAB_SIZE = 400
HIDDEN = 128
LAYERS = 2
HEADS = 4
POSITIONS = 2048
INIT_STD = 0.5
SEED = 20240


def train_bpe(
    tok: Tokenizer, vocab_size: int, special: list[str], alphabet: list[str], text: str = TEXT
) -> None:
    """Train ``tok``'s BPE on ``text`` (repeated, so its pairs count more than once)."""
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator([text] * 4, trainer=trainer)


def byte_level_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """GPT-2's kind of tokenizer: byte-level BPE, ``<|endoftext|>`` its only special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    train_bpe(tok, vocab_size, [END], pre_tokenizers.ByteLevel.alphabet())
    return tok


def _printable(text: str) -> bool:
    return text.isascii() and all(c.isprintable() or c == "\n" for c in text)


def gpt2_state(tok: Tokenizer, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Seeded GPT-2 weights under the names ``GPT2LMHeadModel`` saves (embeddings tied)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * INIT_STD

    d = HIDDEN
    wte = randn(VOCAB_SIZE, d)
    end_id = tok.token_to_id(END)
    for i in range(VOCAB_SIZE):
        if i != end_id and not _printable(tok.decode([i], skip_special_tokens=False)):
            wte[i] = 0.0
    state = {"transformer.wte.weight": wte, "transformer.wpe.weight": randn(POSITIONS, d)}
    for layer in range(LAYERS):
        h = f"transformer.h.{layer}."
        state |= {
            h + "ln_1.weight": torch.ones(d),
            h + "ln_1.bias": torch.zeros(d),
            h + "attn.c_attn.weight": randn(d, 3 * d),  # Conv1D: (in, out)
            h + "attn.c_attn.bias": torch.zeros(3 * d),
            h + "attn.c_proj.weight": randn(d, d),
            h + "attn.c_proj.bias": torch.zeros(d),
            h + "ln_2.weight": torch.ones(d),
            h + "ln_2.bias": torch.zeros(d),
            h + "mlp.c_fc.weight": randn(d, 4 * d),
            h + "mlp.c_fc.bias": torch.zeros(4 * d),
            h + "mlp.c_proj.weight": randn(4 * d, d),
            h + "mlp.c_proj.bias": torch.zeros(d),
        }
    state["transformer.ln_f.weight"] = torch.ones(d)
    state["transformer.ln_f.bias"] = torch.zeros(d)
    return state


def build_tiny_gpt2(folder: Path) -> None:
    """Write the tiny GPT-2 into ``folder`` (which exists and is empty)."""
    tok = byte_level_tokenizer()
    if tok.get_vocab_size() != VOCAB_SIZE:  # the trainer stops early on too short a text
        raise RuntimeError(f"tiny-gpt2: the tokenizer has {tok.get_vocab_size()} tokens")
    end_id = tok.token_to_id(END)
    save_file(gpt2_state(tok), str(folder / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": VOCAB_SIZE,
        "n_embd": HIDDEN,
        "n_layer": LAYERS,
        "n_head": HEADS,
        "n_positions": POSITIONS,
        "n_ctx": POSITIONS,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": True,
        "bos_token_id": end_id,
        "eos_token_id": end_id,
    }
    tok_config = {"bos_token": END, "eos_token": END, "chat_template": CHAT_TEMPLATE}
    for name, data in (("config.json", config), ("tokenizer_config.json", tok_config)):
        (folder / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
