"""What filling the grammar masks during the model's forward buys: decode steps
of a batch held to a JSON Schema, the masks filled on the helper thread while
the forward runs (overlap on) or after it (off), beside the same batch free.

    .venv/bin/python bench/grammar_overlap.py --model MODEL_FOLDER [--batch 32]

One engine holds two batches of ``--batch`` seeded sequences: one held to a
schema (a list of at least 1,000 strings, so that none ends while it is
timed), one free. The three modes' decode steps are interleaved one by one
(free, overlap off, overlap on, again), so that a shared machine's drift
weighs on them alike: ``--warmup`` rounds, then ``--steps`` timed ones (the
engine's ``step`` alone, on this thread, as the step process runs it).
Prints each mode's p50 and p90 step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

SCHEMA = json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 1000})


def run(model: Path, batch: int, steps: int, warmup: int, threads: int) -> dict[str, list[float]]:
    """One engine, two batches of ``batch`` sequences (one held to SCHEMA, one
    free), the modes' steps interleaved one by one: a shared machine's drift
    then weighs on every mode alike."""
    from aserve.config import GenerationConfig
    from aserve.engines.decoder import DecoderEngine
    from aserve.types.generation import SamplingParams

    length = 2 * (warmup + steps) + 16
    gen = GenerationConfig(
        max_num_seqs=2 * batch, max_model_len=length, max_tokens_default=length - 8,
        max_tokens_cap=length - 8,
    )  # fmt: skip
    engine = DecoderEngine(model, gen, cpu_threads=threads)
    engine.load()
    engine.create_instance(0)

    def batch_of(schema: str | None) -> list[Any]:
        params = [SamplingParams(seed=i, ignore_eos=True, json_schema=schema) for i in range(batch)]
        seqs = [engine.new_sequence(f"r{i}", "A list:", p) for i, p in enumerate(params)]
        engine.step(seqs, [])
        return seqs

    held, free = batch_of(SCHEMA), batch_of(None)
    got: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(warmup + steps):
        for mode in MODES:
            seqs = free if mode == "free" else held
            engine.grammars.overlap = mode == "overlap on"
            assert all(not s.finished for s in seqs), "a sequence ended: the batch would shrink"
            t0 = time.perf_counter()
            engine.step([], seqs)
            if i >= warmup:
                got[mode].append(time.perf_counter() - t0)
    engine.unload()
    return got


MODES = ("free", "overlap off", "overlap on")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="the engine's cpu_threads")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.model.name}: batch {args.batch}, {args.steps} decode steps, "
          f"cpu_threads {args.threads}")  # fmt: skip
    print("| mode | step p50 ms | step p90 ms |\n|---|---:|---:|")
    got: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode, times in run(
            args.model, args.batch, args.steps, args.warmup, args.threads
        ).items():
            got[mode] += times
    for mode in MODES:
        times = sorted(got[mode])
        p90 = times[int(0.9 * len(times))]
        print(f"| {mode} | {statistics.median(times) * 1e3:.2f} | {p90 * 1e3:.2f} |")


if __name__ == "__main__":
    main()
