"""The line in front of a model's chat-template thread is bounded like its queue.

A model's own chat template renders on one thread of that model's; a chat whose
template runs to its bound holds it for ``chat_template_timeout_ms``. Chats
being prepared count toward ``generation.max_queue_size`` (with the free slots,
as queued sequences do), so a crowd of them is refused with 429 at once instead
of lining up behind each other without limit.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import aiohttp
import lm_models
import pytest
from conftest import start_server, write_config

LOOPING = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{{ messages[0]['content'] }}"
)
QUEUE, SLOTS, CHATS = 2, 1, 12


@pytest.mark.timeout(180)
async def test_chats_waiting_for_the_template_thread_are_refused_past_the_queue(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = Path(shutil.copytree(
        lm_models.tiny_model("llama", tmp_path_factory.getbasetemp() / "lms"), tmp_path / "m"
    ))  # fmt: skip
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": LOOPING}))
    # Each render runs to its time bound: long enough that every chat below has
    # arrived while the first ones still hold the thread, on any machine.
    generation = {"max_num_seqs": SLOTS, "max_queue_size": QUEUE, "max_model_len": 128,
                  "max_chat_template_steps": 10**12, "chat_template_timeout_ms": 3000}  # fmt: skip
    config = write_config(tmp_path, {"models": [
        {"name": "loop", "engine": "decoder", "path": str(folder), "generation": generation}
    ]})  # fmt: skip
    server = start_server(config)
    body = {"model": "loop", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as session:

            async def chat() -> tuple[int, str]:
                async with session.post(f"{server.base}/v1/chat/completions", json=body) as r:
                    return r.status, await r.text()

            answers = await asyncio.gather(*(chat() for _ in range(CHATS)))
        statuses = sorted(status for status, _ in answers)
        assert set(statuses) <= {400, 429}, answers
        # At most queue + free slots were ever being prepared; the rest were refused.
        assert statuses.count(400) <= QUEUE + SLOTS, answers
        refused = [text for status, text in answers if status == 429]
        assert refused and all("being prepared" in text for text in refused), answers
    finally:
        server.stop()
