"""A prompt is measured from what the request declares, before any tokenizing."""

from __future__ import annotations

import pytest

from aserve.config import PROMPT_BYTES_PER_TOKEN, GenerationConfig
from aserve.engines.decoder.kv_cache import SequenceTooLong
from aserve.errors import InvalidArgument, TooLarge
from aserve.loop.prompt_size import MESSAGE_BYTES, body_limit, check_prompt_size

GEN = GenerationConfig(max_model_len=128)
LIMIT = PROMPT_BYTES_PER_TOKEN * 128


def test_the_limit_derives_from_max_model_len_unless_set() -> None:
    assert GEN.prompt_bytes_limit == LIMIT
    assert GenerationConfig(max_model_len=128, max_prompt_bytes=10).prompt_bytes_limit == 10
    assert body_limit(GEN) == 8 * LIMIT + 64 * 1024


def test_text_is_measured_in_utf8_bytes() -> None:
    check_prompt_size(GEN, prompt="x" * LIMIT)
    check_prompt_size(GEN, prompt=["x" * LIMIT])  # OpenAI's list of one prompt
    with pytest.raises(TooLarge, match=f"prompt: at least {LIMIT + 2} bytes.*max_prompt_bytes"):
        check_prompt_size(GEN, prompt="é" * (LIMIT // 2 + 1))
    with pytest.raises(TooLarge, match="max_prompt_bytes 10"):
        check_prompt_size(GenerationConfig(max_prompt_bytes=10), prompt="\ud800" * 4)


def test_token_ids_by_their_count() -> None:
    check_prompt_size(GEN, prompt=[1] * 127)
    with pytest.raises(SequenceTooLong, match="128 tokens"):
        check_prompt_size(GEN, prompt=[1] * 128)
    with pytest.raises(SequenceTooLong):
        check_prompt_size(GEN, prompt=["not checked here"] * 10**6)


def test_a_chat_by_its_text_and_its_messages() -> None:
    check_prompt_size(GEN, messages=[{"role": "user", "content": "x" * (LIMIT - MESSAGE_BYTES)}])
    with pytest.raises(TooLarge, match="messages: 1 message"):
        check_prompt_size(
            GEN, messages=[{"role": "user", "content": "x" * (LIMIT - MESSAGE_BYTES + 1)}]
        )
    with pytest.raises(
        InvalidArgument,
        match=r"1000000 messages, over the limit generation\.max_chat_messages 1024",
    ):
        check_prompt_size(GEN, messages=[{}] * 10**6)  # refused from the count alone
    with pytest.raises(TooLarge, match="messages: 300 message"):  # 16 bytes each: 4800
        check_prompt_size(GEN, messages=[{}] * 300)
    parts = [{"type": "text", "text": ""}] * (LIMIT // MESSAGE_BYTES)
    with pytest.raises(TooLarge, match="messages: 1 message"):
        check_prompt_size(GEN, messages=[{"role": "user", "content": parts}])
    check_prompt_size(GEN, messages="not a list: the route's own validation refuses it")


def test_a_grpc_chat_is_counted_as_it_comes() -> None:
    from aserve._proto import aserve_pb2 as apb

    request = apb.GenerateRequest()
    request.messages.add(role="user", content="x" * LIMIT)
    with pytest.raises(TooLarge, match="messages: 1 message"):
        check_prompt_size(GEN, messages=request.messages)


def test_the_size_returned_counts_a_chats_structure() -> None:
    """What the generation runtime compares with its inline budget (2 KiB): a
    chat of empty messages is not free to render and tokenize."""
    assert check_prompt_size(GEN, prompt="héllo") == 6
    assert check_prompt_size(GEN, prompt=[1, 2, 3]) == 3
    assert check_prompt_size(GEN, messages=[{"role": "user", "content": ""}] * 200) == 3200
    assert (
        check_prompt_size(
            GEN, messages=[{"role": "user", "content": [{"type": "text", "text": "ab"}]}]
        )
        == 34
    )
    wide = GenerationConfig(max_model_len=128, max_chat_messages=2)
    check_prompt_size(wide, messages=[{}] * 2)
    with pytest.raises(
        InvalidArgument, match=r"3 messages, over the limit generation\.max_chat_messages 2"
    ):
        check_prompt_size(wide, messages=[{}] * 3)
