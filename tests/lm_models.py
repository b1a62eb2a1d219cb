"""Tiny seeded causal LMs and tokenizers, built on the fly in the Hugging Face layout.

Weights use ``initializer_range`` 0.5 so that greedy decoding wanders instead
of repeating one token; tokenizers are BPEs trained on a short ASCII text
(the package's, :mod:`aserve.engines.decoder.tiny`, which builds
``builtin:tiny-gpt2`` with the same tokenizer and no transformers).

- GPT-2: byte-level BPE (every byte has a token, so multi-byte characters
  split across tokens), ``<|endoftext|>`` as BOS/EOS, no chat template.
- Llama (grouped-query attention, 4 heads / 2 KV heads): Metaspace BPE over
  the text's own characters, ``<s>`` added by the post-processor, ``</s>`` as
  EOS, and a Jinja chat template in ``tokenizer_config.json``.
- Hermes: the GPT-2 with Hermes' tool-call markers ``<tool_call>`` and
  ``</tool_call>`` as tokens of their own (as Qwen2.5's), 1,024 positions
  (room for tools in the prompt), and a chat template that renders ``tools``
  and each assistant message's ``tool_calls`` (whose arguments it requires
  to be objects).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from aserve.engines.decoder.tiny import byte_level_tokenizer, train_bpe

LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def gpt2_tokenizer() -> Tokenizer:
    return byte_level_tokenizer(400)


def llama_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    train_bpe(tok, 300, ["<unk>", "<s>", "</s>"], [])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def build_gpt2(folder: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = gpt2_tokenizer()
    eos = tok.token_to_id("<|endoftext|>")
    config = GPT2Config(
        vocab_size=tok.get_vocab_size(),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        initializer_range=0.5,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {"eos_token": "<|endoftext|>"})
    return folder


HERMES_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}"
    "{%- if c.function.arguments is not mapping %}"
    "{{ raise_exception('tool call arguments must be an object') }}{% endif %}"
    "\n<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_hermes(folder: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = gpt2_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    eos = tok.token_to_id("<|endoftext|>")
    config = GPT2Config(
        vocab_size=tok.get_vocab_size(),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=1024,
        initializer_range=0.5,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        {"eos_token": "<|endoftext|>", "chat_template": HERMES_CHAT_TEMPLATE},
    )
    return folder


def build_llama(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = llama_tokenizer()
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        initializer_range=0.5,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(4321)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        {
            "bos_token": "<s>",
            "eos_token": {"content": "</s>"},
            "chat_template": LLAMA_CHAT_TEMPLATE,
        },
    )
    return folder


def load_reference(folder: Path) -> torch.nn.Module:
    """The same checkpoint through transformers: the reference we compare against."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2))


_BUILDERS = {"gpt2": build_gpt2, "llama": build_llama, "hermes": build_hermes}
_BUILT: dict[str, Path] = {}


def tiny_model(kind: str, root: Path) -> Path:
    """The tiny ``kind`` model's folder under ``root``, built once per test session."""
    if kind not in _BUILT:
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        _BUILT[kind] = _BUILDERS[kind](folder)
    return _BUILT[kind]


def greedy_reference(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation (stops at the config's EOS, as we do)."""
    eos = model.generation_config.eos_token_id
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=eos,
    )
    return out[0, len(prompt) :].tolist()
