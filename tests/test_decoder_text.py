"""Text in and out: incremental detokenization, stop strings, chat templates, end tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lm_models
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models

from aserve.engines.decoder import CheckpointError, Tokenizer
from aserve.engines.decoder.detokenizer import IncrementalDetokenizer
from aserve.engines.decoder.stop import StopMatcher
from aserve.errors import InvalidArgument

MULTIBYTE = "héllo wörld, 日本語 and 🙂!"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lm_models.tiny_model("gpt2", tmp_path_factory.getbasetemp() / "lms")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lm_models.tiny_model("llama", tmp_path_factory.getbasetemp() / "lms")


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(t) for t in ids]


# --- incremental detokenization -------------------------------------------------


def test_byte_level_pieces_never_split_a_character(gpt2_dir: Path) -> None:
    tok = Tokenizer.load(gpt2_dir)
    ids = tok.encode(MULTIBYTE)
    assert (
        len(ids) > len(MULTIBYTE.encode()) // 2
    )  # the ASCII-trained BPE splits the non-ASCII bytes
    pieces = stream(tok.detokenizer(tok.encode("A prompt:")), ids)
    assert "".join(pieces) == MULTIBYTE
    assert all("\ufffd" not in p for p in pieces)
    # Some tokens ended inside a character and had to wait for the next one.
    assert "" in pieces
    assert "🙂" in pieces or any(p.startswith("🙂") for p in pieces)


def _byte_fallback_tokenizer() -> RustTokenizer:
    """SentencePiece-style: unknown characters fall back to <0xNN> byte tokens."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for ch in "abcdefghijklmnopqrstuvwxyz ,!":
        vocab[ch] = len(vocab)
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tok


def test_byte_fallback_pieces_never_split_a_character() -> None:
    inner = _byte_fallback_tokenizer()
    ids = inner.encode(MULTIBYTE).ids
    assert inner.decode(ids) == MULTIBYTE
    pieces = stream(IncrementalDetokenizer(inner, []), ids)
    assert "".join(pieces) == MULTIBYTE
    assert all("\ufffd" not in p for p in pieces)
    # Every byte but a character's last waits: é and ö (1 each), 日本語 (2 each), 🙂 (3).
    assert pieces.count("") == 1 + 1 + 3 * 2 + 3


def test_flush_releases_an_incomplete_character() -> None:
    inner = _byte_fallback_tokenizer()
    first_byte_of_e_acute = inner.token_to_id("<0xC3>")
    detok = IncrementalDetokenizer(inner, [])
    assert detok.push(inner.token_to_id("a")) == "a"
    assert detok.push(first_byte_of_e_acute) == ""
    assert detok.flush() == "\ufffd"


def test_leading_space_depends_on_the_prompt(llama_dir: Path) -> None:
    # Metaspace decoders drop the space of a text's first word; a continuation keeps it.
    tok = Tokenizer.load(llama_dir)
    prompt = tok.encode("The quick")
    continuation = tok.encode("The quick brown fox", add_special_tokens=False)[len(prompt) - 1 :]
    assert tok.decode(continuation).startswith("brown")  # decoded alone: space lost
    assert "".join(stream(tok.detokenizer(prompt), continuation)) == " brown fox"


def test_special_tokens_are_not_emitted(llama_dir: Path) -> None:
    tok = Tokenizer.load(llama_dir)
    ids = tok.encode("Hello world", add_special_tokens=False)
    bos = tok.inner.token_to_id("<s>")
    assert "".join(stream(tok.detokenizer([]), [bos, *ids])) == "Hello world"


# --- stop strings ---------------------------------------------------------------------


def feed(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_string_is_not_emitted() -> None:
    m = StopMatcher(["STOP"])
    out, stopped = feed(m, ["hello ", "wor", "ld ST", "OP and more"])
    assert stopped and m.matched == "STOP"
    assert out == ["hello ", "wor", "ld ", ""]


def test_possible_stop_text_is_held_then_released() -> None:
    out, stopped = feed(StopMatcher(["STOP"]), ["a S", "T", "x", " b"])
    assert not stopped
    assert out == ["a ", "", "STx", " b", ""]


def test_held_text_is_released_when_the_sequence_ends() -> None:
    out, stopped = feed(StopMatcher(["</end>"]), ["done </e"])
    assert not stopped
    assert out == ["done ", "</e"]


def test_earliest_of_several_stop_strings_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    out, stopped = feed(m, ["hello", " world"])
    assert stopped and m.matched == "lo w"
    assert "".join(out) == "hel"


def test_overlapping_stop_prefixes() -> None:
    out, stopped = feed(StopMatcher(["aab"]), ["a", "a", "a", "b"])
    assert stopped and "".join(out) == "a"


def test_stop_inside_a_single_piece() -> None:
    m = StopMatcher(["\n\n"])
    out, stopped = feed(m, ["one\n\ntwo"])
    assert stopped and out == ["one"]


def test_no_stop_strings_passes_text_through() -> None:
    assert feed(StopMatcher([]), ["a", "b"]) == (["a", "b", ""], False)


# --- chat templates and end tokens ----------------------------------------------------------

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_chat_template_from_tokenizer_config(llama_dir: Path) -> None:
    tok = Tokenizer.load(llama_dir)
    assert tok.has_chat_template
    assert tok.apply_chat_template(CHAT) == "<s><|system|>Be brief.</s><|user|>Hi</s><|assistant|>"
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False).endswith("Hi</s>")


def test_default_chat_format_without_a_template(gpt2_dir: Path) -> None:
    tok = Tokenizer.load(gpt2_dir)
    assert not tok.has_chat_template
    assert tok.apply_chat_template(CHAT) == "system: Be brief.\nuser: Hi\nassistant:"


def test_chat_template_errors_are_invalid_arguments(llama_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(llama_dir, tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(folder)
    with pytest.raises(InvalidArgument, match="chat template failed: user first"):
        tok.apply_chat_template(CHAT)
    with pytest.raises(InvalidArgument, match=r"messages\[0\]: a message needs a 'role'"):
        tok.apply_chat_template([{"content": "x"}])
    config["chat_template"] = "{% for %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="chat_template does not compile"):
        Tokenizer.load(folder)


def test_chat_template_jinja_file(gpt2_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(gpt2_dir, tmp_path / "m")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    assert Tokenizer.load(folder).apply_chat_template(CHAT) == "[Be brief.][Hi]"


def test_eos_ids_are_the_union_of_configs_and_tokenizer(llama_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(llama_dir, tmp_path / "m")
    tok = Tokenizer.load(folder)
    eos = tok.inner.token_to_id("</s>")
    assert tok.eos_token_ids == {eos}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 17]}))
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = 23
    (folder / "config.json").write_text(json.dumps(config))
    assert Tokenizer.load(folder).eos_token_ids == {eos, 17, 23}


def test_missing_tokenizer_is_named(gpt2_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(gpt2_dir, tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"no tokenizer\.json"):
        Tokenizer.load(folder)
