"""What chat's tool-call grammar costs per step, against a JSON Schema's.

    .venv/bin/python bench/tool_grammar_mask.py --tokenizer MODEL_FOLDER [--batch 32] [--threads 1]

``MODEL_FOLDER`` holds a ``tokenizer.json`` (SmolLM2-135M's 49,152 tokens:
``scripts/convert-smollm2``). The grammars are the server's own: two tools'
``tool_choice`` "auto" (free text, or text then calls, each call's JSON held
to a tool's parameters) from :func:`aserve.frontends.http.openai_tools.tool_plan`,
and one tool's parameters alone as a ``response_format`` schema. ``--batch``
matchers walk a valid answer of each (a paragraph of text and two calls; the
arguments alone), each started at a different token of it, so that the
batch's states differ; every step fills the batch's masks in one call, as the
engine does, and advances each matcher by its next token. Prints the
compile time and the fill's p50 and p99 per step, and per sequence.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import llguidance
import numpy as np

from aserve.engines.decoder.grammar import JSON_OPTIONS
from aserve.frontends.http.openai_tools import tool_plan

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
ANSWER = (
    "Let me look that up for you, the forecast is below. "
    * 3
    + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
ARGUMENTS = '{"city": "Paris", "days": 3}'
STEPS = 200


def measure(tok: llguidance.LLTokenizer, grammar: str, text: str, batch: int, threads: int) -> str:
    started = time.perf_counter()
    base = llguidance.LLMatcher(tok, grammar, log_level=0)
    compiled = time.perf_counter() - started
    assert not base.is_error(), base.get_error()
    ids = tok.tokenize_str(text)
    matchers, at = [], []
    for i in range(batch):
        m = base.deep_copy()
        k = i * len(ids) // batch
        assert m.consume_tokens(ids[:k]), m.get_error()
        matchers.append(m)
        at.append(k)
    words = (tok.vocab_size + 31) // 32
    bits = np.zeros((batch, words), dtype=np.int32)
    executor = llguidance.LLExecutor(num_threads=threads)
    times = []
    for _ in range(STEPS):
        t = time.perf_counter()
        executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bits.ctypes.data, words * 4, batch
        )
        times.append(time.perf_counter() - t)
        for i in range(batch):
            if at[i] >= len(ids) or matchers[i].is_stopped():
                matchers[i], at[i] = base.deep_copy(), 0
            assert matchers[i].consume_token(ids[at[i]]), matchers[i].get_error()
            at[i] += 1
    times.sort()
    p50, p99 = times[STEPS // 2], times[STEPS * 99 // 100]
    return (
        f"compile {compiled * 1e3:.1f} ms; fill p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms "
        f"a step; {p50 / batch * 1e6:.0f} us a sequence"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    text = (args.tokenizer / "tokenizer.json").read_text(encoding="utf-8")
    tok = llguidance.LLTokenizer(text)
    plan, _ = tool_plan(TOOLS, "auto")
    assert plan is not None
    schema = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(WEATHER), overrides=JSON_OPTIONS
    )
    print(f"batch {args.batch}, {args.threads} thread(s), vocabulary {tok.vocab_size}")
    print(
        "tool_choice auto, two tools:", measure(tok, plan.grammar, ANSWER, args.batch, args.threads)
    )
    print("a JSON Schema alone:", measure(tok, schema, ARGUMENTS, args.batch, args.threads))


if __name__ == "__main__":
    main()
