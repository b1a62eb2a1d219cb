"""Streaming row: tokens/s of aserve's OpenAI streaming vs. the decoder engine's own loop.

    python -m bench.streaming [--duration 15] [--warmup 3] [--concurrency 1 8 32] \
        [--max-tokens 128] [--ceiling-seconds 8]

A seeded GPT-2-architecture checkpoint (4 layers, 256 wide, 4 heads, a small
BPE vocabulary trained on a fixed text; cached under the bench cache) is
served by aserve (engine "decoder", float32, ``cpu_threads`` 1,
``max_num_seqs`` 32). Each of ``c`` closed-loop clients streams
``POST /v1/completions`` (``stream``, greedy, ``ignore_eos``, fixed
``max_tokens``) over raw aiohttp SSE and starts the next stream as soon as
one ends. Measured in the window: aggregate tokens/s, time to first token
(p50/p99, streams started in the window) and inter-token latency (gaps
between successive text chunks of one stream, p50/p99).

Ceiling: :class:`aserve.engines.decoder.DecoderEngine` in this process, one
torch thread, the same dtype: ``c`` sequences prefilled together then
stepped until ``max_tokens`` each, repeated; generated tokens over wall time
(prefill, sampling and detokenisation included, as in the server).

Writes ``RESULTS-streaming.md`` and ``results-streaming.json`` into
``--out-dir`` (default: bench/). Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.loadgen import percentile
from bench.models import default_cache_dir
from bench.proctree import system_busy_seconds, tree_cpu_seconds
from bench.report import row_facts
from bench.run import wait_for_quiet
from bench.servers import MODEL_ENV, start_aserve

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "lm"
PROMPT = "The quick brown fox jumps over the lazy dog. A server streams tokens to many"
GPT2_SHAPE = {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 512}
MAX_NUM_SEQS = 32
MAX_MODEL_LEN = 256
TARGET = 0.9  # served tokens/s over the engine's own loop, at each point (issue 17)


# --- the model ---------------------------------------------------------------------------


def build_lm(folder: Path) -> Path:
    """A seeded GPT-2 checkpoint in the Hugging Face layout, built once into ``folder``.

    The tokenizer is a Metaspace BPE over the text's own characters (as the
    test suite's Llama tokenizer): every token decodes to whole characters, so
    each generated token becomes one streamed chunk.
    """
    if (folder / "config.json").is_file():
        return folder
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel

    from aserve.engines.decoder.tiny import train_bpe

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    train_bpe(tok, 512, ["<unk>", "<|endoftext|>"], [])  # on the builtin tiny-gpt2's text
    eos = tok.token_to_id("<|endoftext|>")
    config = GPT2Config(
        vocab_size=tok.get_vocab_size(),
        initializer_range=0.5,  # greedy decoding wanders instead of repeating one token
        bos_token_id=eos,
        eos_token_id=eos,
        **GPT2_SHAPE,
    )
    torch.manual_seed(2024)
    model = GPT2LMHeadModel(config).eval()
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tmp.replace(folder)
    return folder


def generation_config() -> dict[str, Any]:
    return {
        "max_num_seqs": MAX_NUM_SEQS,
        "max_model_len": MAX_MODEL_LEN,
        "max_tokens_default": 128,
        "max_tokens_cap": MAX_MODEL_LEN,
    }


# --- the ceiling -------------------------------------------------------------------------


def ceiling(path: Path, batch: int, max_tokens: int, seconds: float) -> dict[str, Any]:
    """The engine's own generate loop at ``batch`` sequences: tokens/s and ms per decode step."""
    from aserve.config import GenerationConfig
    from aserve.engines.decoder import DecoderEngine
    from aserve.types.generation import SamplingParams

    engine = DecoderEngine(
        path, GenerationConfig(**generation_config()), dtype="float32", cpu_threads=1
    )
    engine.load()
    engine.create_instance(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens, decode_s, decode_steps, rounds = 0, 0.0, 0, 0
    t0 = time.perf_counter()
    while rounds < 1 or time.perf_counter() - t0 < seconds:
        seqs = [engine.new_sequence(f"r{rounds}-{i}", PROMPT, params) for i in range(batch)]
        tokens += len(engine.step(seqs, []))
        running = [s for s in seqs if not s.finished]
        while running:
            s0 = time.perf_counter()
            tokens += len(engine.step([], running))
            decode_s += time.perf_counter() - s0
            decode_steps += 1
            running = [s for s in running if not s.finished]
        rounds += 1
    elapsed = time.perf_counter() - t0
    engine.unload()
    return {
        "batch": batch,
        "tokens_per_s": tokens / elapsed,
        "decode_step_ms": 1e3 * decode_s / decode_steps,
        "decode_only_tokens_per_s": batch * decode_steps / decode_s,
        "rounds": rounds,
        "prompt_tokens": len(seqs[0].prompt_ids),
    }


# --- the streaming load ------------------------------------------------------------------


class _Window:
    def __init__(self) -> None:
        self.recording = False
        self.stopping = False
        self.chunks = 0  # text chunks received inside the window
        self.ttft_ms: list[float] = []
        self.itl_ms: list[float] = []
        self.streams_done = 0
        self.stream_tokens = 0  # usage.completion_tokens of streams that ended
        self.stream_chunks = 0  # text chunks of those streams
        self.errors = 0
        self.error_samples: list[str] = []


async def _one_stream(session: Any, url: str, body: bytes, window: _Window) -> None:
    sent = time.perf_counter()
    recording_at_start = window.recording
    last: float | None = None
    chunks, tokens = 0, 0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            window.errors += 1
            if len(window.error_samples) < 3:
                window.error_samples.append(f"{r.status}: {(await r.text())[:200]}")
            return
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            doc = json.loads(payload)
            if doc.get("usage"):
                tokens = doc["usage"]["completion_tokens"]
            if not doc["choices"] or not doc["choices"][0]["text"]:
                continue
            chunks += 1
            if window.recording:
                window.chunks += 1
                if last is None:
                    if recording_at_start:
                        window.ttft_ms.append(1e3 * (now - sent))
                else:
                    window.itl_ms.append(1e3 * (now - last))
            last = now
    window.streams_done += 1
    window.stream_tokens += tokens
    window.stream_chunks += chunks


async def _client(session: Any, url: str, body: bytes, window: _Window) -> None:
    while not window.stopping:
        try:
            await _one_stream(session, url, body, window)
        except (OSError, ValueError, asyncio.TimeoutError) as exc:
            window.errors += 1
            if len(window.error_samples) < 3:
                window.error_samples.append(repr(exc))


async def _engine_counters(session: Any, base_url: str) -> tuple[int, int, int]:
    """The model's step time (ns, as the step process measured it), steps, and
    steps run ahead (0 where the server does not count them)."""
    async with session.get(f"{base_url}/v2/models/{MODEL_NAME}/stats") as r:
        doc = (await r.json())["model_stats"][0]
    gen = doc.get("generation", {})
    return (
        doc["inference_stats"]["compute_infer"]["ns"],
        gen.get("step_count", 0),
        gen.get("ahead_step_count", 0),
    )


async def stream_load(
    base_url: str,
    concurrency: int,
    max_tokens: int,
    duration_s: float,
    warmup_s: float,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """``concurrency`` closed-loop SSE clients on ``/v1/completions``; the window's numbers.

    With ``server_pid``, the server process tree's CPU time in the window is
    reported too; ``other_cpu_util`` is what else kept the machine busy.
    """
    import aiohttp

    body = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    url = f"{base_url}/v1/completions"
    window = _Window()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        clients = [
            asyncio.create_task(_client(session, url, body, window)) for _ in range(concurrency)
        ]
        await asyncio.sleep(warmup_s)
        eng0 = await _engine_counters(session, base_url)
        srv0 = tree_cpu_seconds(server_pid) if server_pid else 0.0
        busy0 = system_busy_seconds()
        cpu0, t0 = time.process_time(), time.perf_counter()
        window.recording = True
        await asyncio.sleep(duration_s)
        window.recording = False
        cpu1, t1 = time.process_time(), time.perf_counter()
        busy1 = system_busy_seconds()
        srv1 = tree_cpu_seconds(server_pid) if server_pid else 0.0
        eng1 = await _engine_counters(session, base_url)
        window.stopping = True
        await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), 120)
    elapsed = t1 - t0
    per_chunk = window.stream_tokens / window.stream_chunks if window.stream_chunks else 1.0
    ttft, itl = sorted(window.ttft_ms), sorted(window.itl_ms)
    return {
        "concurrency": concurrency,
        "duration_s": elapsed,
        "tokens_per_s": window.chunks * per_chunk / elapsed,
        "chunks_in_window": window.chunks,
        "tokens_per_chunk": per_chunk,
        "streams_completed": window.streams_done,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_samples": len(ttft),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "itl_samples": len(itl),
        "errors": window.errors,
        "error_samples": window.error_samples,
        # Of the window, the share the step process spent inside engine steps:
        # what is left is it waiting for the loop (or for nothing to do).
        "engine_busy": (eng1[0] - eng0[0]) / 1e9 / elapsed,
        "steps": eng1[1] - eng0[1],
        "ahead_steps": eng1[2] - eng0[2],
        "client_cpu_util": (cpu1 - cpu0) / elapsed,
        "server_cpu_util": (srv1 - srv0) / elapsed,
        "other_cpu_util": (busy1 - busy0 - (cpu1 - cpu0) - (srv1 - srv0)) / elapsed,
    }


# --- report ------------------------------------------------------------------------------


def render(results: dict[str, Any]) -> str:
    f = results["facts"]
    lines = [
        "# Streaming row: OpenAI streaming tokens/s vs. the decoder engine's own loop",
        "",
        f"Generated by `{f['command']}` on {f['date']} ({f['cpu']}, {f['cores']} cores; "
        f"Python {f['python']}, torch {f['torch']}). Load average before "
        f"{f['loadavg_before']}, after {f['loadavg_after']}.",
        "",
        f"Model: {results['model']}. aserve: engine decoder, float32, cpu_threads 1, "
        f"max_num_seqs {MAX_NUM_SEQS}, max_model_len {MAX_MODEL_LEN}. Each stream: "
        f"`POST /v1/completions` with stream, greedy, ignore_eos, max_tokens "
        f"{results['max_tokens']}, a {results['prompt_tokens']}-token prompt; closed loop (a "
        f"client starts its next stream when one ends), raw aiohttp SSE in the bench process "
        f"on the same cores as the server. {results['warmup_s']} s warm-up, then "
        f"{results['duration_s']} s measured per point.",
        "",
        "| streams | aserve tokens/s | ceiling tokens/s | aserve / ceiling | TTFT p50 ms | "
        "TTFT p99 ms | ITL p50 ms | ITL p99 ms | engine busy | steps run ahead | streams done | "
        "errors | server CPU | client CPU | other CPU |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, s in results["served"].items():
        ceil = results["ceiling"][c]["tokens_per_s"]
        lines.append(
            f"| {c} | {s['tokens_per_s']:.0f} | {ceil:.0f} | {s['tokens_per_s'] / ceil:.2f} | "
            f"{s['ttft_p50_ms']:.1f} | {s['ttft_p99_ms']:.1f} | {s['itl_p50_ms']:.1f} | "
            f"{s['itl_p99_ms']:.1f} | {s['engine_busy']:.2f} | "
            f"{s['ahead_steps'] / max(s['steps'], 1):.2f} | {s['streams_completed']} | {s['errors']} | "
            f"{s['server_cpu_util']:.2f} | {s['client_cpu_util']:.2f} | "
            f"{s['other_cpu_util']:.2f} |"
        )
    lines += [
        "",
        "Engine busy: the share of the window the step process spent inside engine steps "
        "(the rest it waited for the loop or had nothing to run); steps run ahead: the "
        "share of the window's steps the step process ran without being asked. "
        "CPU columns are cores (CPU seconds per wall second in the window): the aserve "
        "process tree, the bench process (the SSE clients), and everything else on the "
        "machine. Each point and each ceiling first waits (up to 60 s) for the machine to "
        "be quiet (other load under 0.15 cores).",
        "",
        "Ceiling (in process, one torch thread): the engine prefilling `c` copies of the "
        "prompt together and stepping them to max_tokens, repeated.",
        "",
        "| batch | tokens/s (generate loop) | decode step ms | decode-only tokens/s |",
        "|---:|---:|---:|---:|",
    ]
    for c, k in results["ceiling"].items():
        lines.append(
            f"| {c} | {k['tokens_per_s']:.0f} | {k['decode_step_ms']:.2f} | "
            f"{k['decode_only_tokens_per_s']:.0f} |"
        )
    fracs = {
        c: s["tokens_per_s"] / results["ceiling"][c]["tokens_per_s"]
        for c, s in results["served"].items()
    }
    verdict = "meets" if min(fracs.values()) >= TARGET else "misses"
    lines += [
        "",
        "aserve / ceiling at the same batch: "
        + ", ".join(f"{c} streams **{f:.2f}**" for c, f in fracs.items())
        + f" ({verdict} the {TARGET} target at every point).",
        "",
    ]
    if results.get("notes"):
        lines += ["## Notes", "", *results["notes"], ""]
    return "\n".join(lines)


def prepare(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[float]:
    """Check the stream counts and set up this process as every streaming bench
    runs (model env, one torch thread); returns the load average before the run."""
    if max(args.concurrency) > MAX_NUM_SEQS:
        p.error(f"--concurrency is at most max_num_seqs ({MAX_NUM_SEQS})")
    os.environ.update(MODEL_ENV)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.streaming", description=__doc__.split("\n")[0]
    )
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ceiling-seconds", type=float, default=6.0, help="per batch size")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="serve this model folder instead of the seeded GPT-2 (e.g. SmolLM2-135M "
        "from scripts/convert-smollm2)",
    )
    args = p.parse_args(argv)
    loadavg_before = prepare(p, args)
    cache = args.cache_dir or default_cache_dir()
    shape = "-".join(f"{k}{v}" for k, v in GPT2_SHAPE.items())
    if args.model_dir is not None:
        path = args.model_dir.resolve()
    else:
        path = build_lm(cache / f"gpt2-{shape}")

    print("streaming: in-process ceilings", file=sys.stderr, flush=True)
    ceilings: dict[str, Any] = {}
    for c in args.concurrency:
        wait_for_quiet(0.15, 60.0)
        ceilings[str(c)] = ceiling(path, c, args.max_tokens, args.ceiling_seconds)
        k = ceilings[str(c)]
        print(
            f"  ceiling batch {c}: {k['tokens_per_s']:.0f} tokens/s, decode step "
            f"{k['decode_step_ms']:.2f} ms",
            file=sys.stderr,
            flush=True,
        )

    config = {
        "http": {"host": "127.0.0.1", "port": 0},
        "models": [
            {
                "name": MODEL_NAME,
                "engine": "decoder",
                "path": str(path) if args.model_dir is not None else path.name,
                "device": "cpu",
                "dtype": "float32",
                "cpu_threads": 1,
                "generation": generation_config(),
            }
        ],
    }
    cfg_path = cache / "streaming-aserve.json"
    cfg_path.write_text(json.dumps(config, indent=2))
    try:
        import uvloop
    except ImportError:
        runner: Callable[..., Any] = asyncio.run
    else:
        runner = uvloop.run
    served: dict[str, Any] = {}
    with start_aserve(cfg_path, REPO) as server:
        for c in args.concurrency:
            wait_for_quiet(0.15, 60.0)
            served[str(c)] = out = runner(
                stream_load(
                    server.base_url, c, args.max_tokens, args.duration, args.warmup, server.pid
                )
            )
            print(
                f"  aserve {c:2d} streams: {out['tokens_per_s']:.0f} tokens/s, TTFT p50 "
                f"{out['ttft_p50_ms']:.1f} ms p99 {out['ttft_p99_ms']:.1f} ms, ITL p50 "
                f"{out['itl_p50_ms']:.1f} ms p99 {out['itl_p99_ms']:.1f} ms, engine busy "
                f"{out['engine_busy']:.2f}, errors "
                f"{out['errors']}, other load {out['other_cpu_util']:.2f} cores",
                file=sys.stderr,
                flush=True,
            )
    results = {
        "facts": row_facts("bench.streaming", argv, loadavg_before),
        "model": _describe(path)
        if args.model_dir is not None
        else (
            "GPT-2 architecture, "
            + ", ".join(f"{k} {v}" for k, v in GPT2_SHAPE.items())
            + f", vocabulary {_vocab(path)} (seeded, Metaspace BPE)"
        ),
        "max_tokens": args.max_tokens,
        "prompt_tokens": ceilings[str(args.concurrency[0])]["prompt_tokens"],
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "ceiling": ceilings,
        "served": served,
        "aserve_config": config,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results-streaming.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out_dir / "RESULTS-streaming.md").write_text(render(results))
    print(f"streaming: wrote {args.out_dir / 'RESULTS-streaming.md'}", file=sys.stderr)
    return 0


def _describe(path: Path) -> str:
    """A served model folder, as the report names it (from its config.json)."""
    c = json.loads((path / "config.json").read_text())
    layers = c.get("num_hidden_layers", c.get("n_layer"))
    width = c.get("hidden_size", c.get("n_embd"))
    return (
        f"{path.name} ({c.get('model_type')}, {layers} layers, width {width}, "
        f"vocabulary {c['vocab_size']})"
    )


def _vocab(path: Path) -> int:
    vocab: int = json.loads((path / "config.json").read_text())["vocab_size"]
    return vocab


if __name__ == "__main__":
    sys.exit(main())
