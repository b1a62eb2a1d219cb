"""What a grammar engine's token mask costs, for choosing one: xgrammar or llguidance.

    .venv/bin/python bench/grammar_mask.py --tokenizer MODEL_FOLDER [--batch 32]

``MODEL_FOLDER`` holds a ``tokenizer.json`` (SmolLM2-135M's 49,152 tokens:
``scripts/convert-smollm2``). For each JSON Schema case, each engine:

- compiles the schema (the time per compile, its cache off where it has one);
- runs ``--batch`` matchers over a valid document of the schema, tokenized by
  the model's tokenizer, each started at a different token of it so that the
  batch's states differ (a matcher that reaches the end starts again); every
  step fills the batch's masks in one call (each engine's batched, threaded
  fill) and then advances each matcher by its next token. The fill time per
  step is reported as p50/p99, and per token (a step's time / the batch).

Then a list of schema features, each compiled alone: which ones each engine
compiles, and the error of the ones it refuses. The numbers are written as a
Markdown table (``--out``, or stdout). Both packages must be installed
(``pip install xgrammar llguidance``); neither is imported by aserve here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "flat, required fields": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "admin": {"type": "boolean"},
            },
            "required": ["name", "age", "admin"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "admin": True},
    ),
    "nested objects": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "address": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string"},
                                "zip": {"type": "string"},
                            },
                            "required": ["city", "zip"],
                        },
                    },
                    "required": ["name", "address"],
                },
                "score": {"type": "number"},
            },
            "required": ["user", "score"],
        },
        {"user": {"name": "Grace", "address": {"city": "Arlington", "zip": "22201"}}, "score": 9.5},
    ),
    "array of objects, bounds": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer", "minimum": 1},
                        },
                        "required": ["sku", "qty"],
                    },
                },
            },
            "required": ["items"],
        },
        {
            "items": [
                {"sku": "A-100", "qty": 2},
                {"sku": "B-7", "qty": 11},
                {"sku": "C-42", "qty": 1},
            ]
        },
    ),
    "enums and const": (
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "size": {"enum": ["S", "M", "L", "XL"]},
                "kind": {"const": "shirt"},
            },
            "required": ["color", "size", "kind"],
        },
        {"color": "green", "size": "XL", "kind": "shirt"},
    ),
    "patterns and formats": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "email": {"type": "string", "format": "email"},
                "day": {"type": "string", "format": "date"},
            },
            "required": ["id", "email", "day"],
        },
        {"id": "ABC-1234", "email": "ada@example.com", "day": "2024-05-17"},
    ),
    "anyOf, $ref, recursion": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["value"],
                }
            },
            "$ref": "#/$defs/node",
        },
        {"value": 1, "children": [{"value": "a"}, {"value": 2, "children": [{"value": 3}]}]},
    ),
    "any JSON object (json_object)": (
        {"type": "object"},
        {"title": "Notes", "tags": ["a", "b"], "n": 3, "nested": {"ok": True, "x": None}},
    ),
}

FEATURES: dict[str, dict[str, Any]] = {
    "type string/integer/number/boolean/null": {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "n": {"type": "number"},
            "b": {"type": "boolean"},
            "z": {"type": "null"},
        },
    },
    "required": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
    "additionalProperties false": {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "additionalProperties": False,
    },
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "enum": {"enum": ["a", 1, None]},
    "const": {"const": "x"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-z]+[0-9]*$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "minimum/maximum": {"type": "integer", "minimum": 1, "maximum": 100},
    "exclusiveMinimum (number)": {"type": "number", "exclusiveMinimum": 0},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "minItems/maxItems": {
        "type": "array",
        "items": {"type": "integer"},
        "minItems": 1,
        "maxItems": 3,
    },
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {
        "allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]
    },
    "$ref/$defs": {
        "$defs": {"x": {"type": "string"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/x"}},
    },
    "recursive $ref": {
        "$defs": {
            "t": {
                "type": "object",
                "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
            }
        },
        "$ref": "#/$defs/t",
    },
    "minProperties/maxProperties": {"type": "object", "minProperties": 1, "maxProperties": 2},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "if/then/else": {
        "if": {"type": "string"},
        "then": {"minLength": 1},
        "else": {"type": "integer"},
    },
    "not": {"not": {"type": "string"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
}


# A document each feature forbids: an engine that compiles the feature but takes
# this document ignored the keyword, and its output may not validate.
VIOLATIONS: dict[str, str] = {
    "uniqueItems": "[1,1]",
    "contains": '["a"]',
    "if/then/else": "true",
    "not": '"abc"',
    "dependentRequired": '{"a":1}',
    "propertyNames": '{"A1":1}',
    "minProperties/maxProperties": "{}",
    "multipleOf": "7",
    "pattern": '"9"',
    "minItems/maxItems": "[]",
}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Engine:
    """One grammar engine behind the bench's four operations."""

    name: str

    def compile(self, schema: str) -> Any:
        raise NotImplementedError

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        raise NotImplementedError

    def fill(self, matchers: list[Any]) -> None:
        raise NotImplementedError

    def advance(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def reset(self, matcher: Any) -> None:
        raise NotImplementedError

    def accepts(self, compiled: Any, doc: str) -> bool:
        """Whether the grammar takes ``doc`` whole."""
        raise NotImplementedError


class Llguidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int], batch: int) -> None:
        import llguidance

        self.llg = llguidance
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.setup_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(num_threads=os.cpu_count())
        self.words = (vocab + 31) // 32
        self.mask = np.zeros((batch, self.words), dtype=np.int32)
        self.version = llguidance.__version__ if hasattr(llguidance, "__version__") else "?"

    def compile(self, schema: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False, "lenient": False}
        )
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers: list[Any]) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(
            pairs, self.mask.ctypes.data, self.words * 4, len(matchers)
        )

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def accepts(self, compiled: Any, doc: str) -> bool:
        m = compiled.deep_copy()
        return m.consume_tokens(self.tok.tokenize_str(doc)) and m.is_accepting()


class Xgrammar(Engine):
    name = "xgrammar"

    def __init__(self, folder: Path, vocab: int, eos: list[int], batch: int) -> None:
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.batcher = xgrammar.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)
        self.mask = xgrammar.allocate_token_bitmask(batch, vocab)
        self.eos = eos[0]
        self.version = xgrammar.__version__ if hasattr(xgrammar, "__version__") else "?"

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(
            schema, any_whitespace=False, separators=(",", ":")
        )

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list[Any]) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, self.mask)

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def accepts(self, compiled: Any, doc: str) -> bool:
        m = self.xgr.GrammarMatcher(compiled)
        return bool(m.accept_string(doc)) and (m.is_terminated() or m.accept_token(self.eos))


def measure_case(
    engine: Engine, schema: str, tokens: list[int], batch: int, steps: int, compiles: int
) -> dict[str, float]:
    times = []
    for _ in range(compiles):
        t0 = time.perf_counter()
        compiled = engine.compile(schema)
        times.append(time.perf_counter() - t0)
    matchers = engine.matchers(compiled, batch)
    pos = []
    for i, m in enumerate(matchers):  # each matcher at its own place in the document
        start = (i * len(tokens)) // batch
        for t in tokens[:start]:
            if not engine.advance(m, t):
                raise RuntimeError(f"{engine.name}: the document's token {t} was refused")
        pos.append(start)
    fills = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.fill(matchers)
        fills.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            if pos[i] == len(tokens):
                engine.reset(m)
                pos[i] = 0
            if not engine.advance(m, tokens[pos[i]]):
                raise RuntimeError(f"{engine.name}: token {tokens[pos[i]]} was refused")
            pos[i] += 1
    return {
        "compile_ms": statistics.median(times) * 1e3,
        "fill_p50_ms": percentile(fills, 0.5) * 1e3,
        "fill_p99_ms": percentile(fills, 0.99) * 1e3,
        "per_token_us": statistics.median(fills) / batch * 1e6,
    }


def features(engine: Engine) -> dict[str, str]:
    out = {}
    for name, schema in FEATURES.items():
        try:
            compiled = engine.compile(json.dumps(schema))
            bad = VIOLATIONS.get(name)
            if bad is not None and engine.accepts(compiled, bad):
                out[name] = f"compiled, NOT enforced: takes {bad}"
            else:
                out[name] = "yes"
        except Exception as exc:  # either engine's refusal, whatever its type
            out[name] = "refused: " + " ".join(str(exc).split())[:70]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a model folder")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--compiles", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import tokenizers

    text = (args.tokenizer / "tokenizer.json").read_text(encoding="utf-8")
    tok = tokenizers.Tokenizer.from_str(text)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    config = json.loads((args.tokenizer / "config.json").read_text(encoding="utf-8"))
    eos = config.get("eos_token_id", 0)
    eos = eos if isinstance(eos, list) else [eos]
    engines: list[Engine] = [
        Llguidance(text, vocab, eos, args.batch),
        Xgrammar(args.tokenizer, vocab, eos, args.batch),
    ]
    lines = [
        f"Tokenizer {args.tokenizer.name}: {vocab} tokens; batch {args.batch}, "
        f"{args.steps} steps per case, {os.cpu_count()} CPUs.",
        "",
        "Setup (the tokenizer's tables, once per model): "
        + ", ".join(f"{e.name} {e.setup_s * 1e3:.0f} ms" for e in engines),
        "",
        "| case | engine | compile ms | fill p50 ms | fill p99 ms | per token µs |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for case, (schema, doc) in CASES.items():
        body = json.dumps(doc, separators=(",", ":"))
        tokens = tok.encode(body, add_special_tokens=False).ids
        for e in engines:
            r = measure_case(e, json.dumps(schema), tokens, args.batch, args.steps, args.compiles)
            lines.append(
                f"| {case} | {e.name} | {r['compile_ms']:.2f} | {r['fill_p50_ms']:.3f} | "
                f"{r['fill_p99_ms']:.3f} | {r['per_token_us']:.1f} |"
            )
            print(lines[-1], file=sys.stderr)
    lines += ["", "| feature | " + " | ".join(e.name for e in engines) + " |",
              "|---|" + "---|" * len(engines)]  # fmt: skip
    support = [features(e) for e in engines]
    for name in FEATURES:
        lines.append(f"| {name} | " + " | ".join(s[name] for s in support) + " |")
    report = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(report, encoding="utf-8")
    print(report)


if __name__ == "__main__":
    main()
