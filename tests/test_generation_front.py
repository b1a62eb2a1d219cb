"""What preparing a generation request costs on the server's side of a step process.

The loop tokenizes and validates a request (``load_front`` + ``new_sequence``);
the sampler's random stream, the detokenizer and the stop matcher belong to
the steps and are made where they run. A profile hook records which aserve
files preparing one request enters.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lm_models
import pytest

import aserve
from aserve.config import GenerationConfig
from aserve.engines.decoder import DecoderEngine
from aserve.types.generation import SamplingParams

ROOT = str(Path(aserve.__file__).parent)


def _files_entered(fn: Any, *args: Any) -> tuple[Any, set[str]]:
    seen: set[str] = set()

    def prof(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(ROOT):
            seen.add(name[len(ROOT) + 1 :])

    sys.setprofile(prof)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return result, seen


@pytest.mark.timeout(120)
def test_preparing_a_request_builds_no_step_state(tmp_path: Path) -> None:
    folder = lm_models.tiny_model("gpt2", tmp_path / "lms")
    front = DecoderEngine(folder, GenerationConfig(max_num_seqs=2, max_model_len=64))
    front.load_front()
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=4, stop=("x",))
    seq, files = _files_entered(front.new_sequence, "r", "Hello there", params)
    assert seq.max_tokens == 4 and seq.prompt_ids
    step_side = {f"engines/decoder/{m}.py" for m in ("sampling", "stop", "detokenizer")}
    assert not files & step_side, sorted(files)

    # The steps still get them, and the seed still decides the tokens.
    engine = DecoderEngine(folder, GenerationConfig(max_num_seqs=2, max_model_len=64))
    engine.load()
    engine.create_instance(0)

    def run() -> list[int]:
        s = engine.new_sequence("r", "Hello there", params)
        ids = []
        while not s.finished:
            (out,) = engine.step([s] if not s.output_ids else [], [s] if s.output_ids else [])
            ids.append(out.token_id)
        return ids

    assert run() == run()
