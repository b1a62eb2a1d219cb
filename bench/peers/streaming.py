"""Workload 3: token streaming, aserve's OpenAI endpoint vs. LitServe's OpenAI spec.

Both serve the small seeded GPT-2-architecture decoder of bench/streaming.py
(greedy, float32, one torch thread) on ``/v1/chat/completions`` with
``stream: true``; the prompt is the user message as is (a chat template
that only joins the messages' contents, on both sides). aserve batches
continuously (``max_num_seqs`` 32); LitServe batches the streams that arrive
together (max batch 32, 5 ms) and generates each batch to the end. Each of
``c`` closed-loop clients (aiohttp, SSE) starts its next stream when one
ends; measured in the window: tokens/s (non-empty content chunks), time to
first token and inter-token latency. Before measuring, one stream from each
server is checked against greedy generation run in-process.
"""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.loadgen import percentile
from bench.peers import launch
from bench.peers.launch import Context, Plan, Running, StartError
from bench.proctree import system_busy_seconds, tree_cpu_seconds
from bench.streaming import GPT2_SHAPE, PROMPT, build_lm, generation_config

MODEL = "lm"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
STREAM_SERVERS = ("aserve", "litserve")


def chat_lm(cache: Path) -> Path:
    """bench.streaming's checkpoint, plus a chat template that only joins the contents."""
    shape = "-".join(f"{k}{v}" for k, v in GPT2_SHAPE.items())
    base = build_lm(cache / f"gpt2-{shape}")
    folder = cache / f"gpt2-{shape}-chat"
    if not (folder / "chat_template.jinja").is_file():
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(base, tmp)
        (tmp / "chat_template.jinja").write_text(TEMPLATE)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.replace(folder)
    return folder


def expected_text(folder: Path, max_tokens: int) -> str:
    """Greedy generation in this process (transformers), EOS ignored."""
    import torch
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = torch.tensor([tok.encode(PROMPT).ids])
    out: list[int] = []
    with torch.inference_mode():
        past = None
        x = ids
        for _ in range(max_tokens):
            o = model(input_ids=x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            nxt = int(o.logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    text: str = tok.decode(out)
    return text


def _body(max_tokens: int) -> bytes:
    return json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
    }).encode()  # fmt: skip


class _Window:
    def __init__(self) -> None:
        self.recording = False
        self.stopping = False
        self.tokens = 0
        self.ttft_ms: list[float] = []
        self.itl_ms: list[float] = []
        self.streams_done = 0
        self.errors = 0
        self.error_samples: list[str] = []


async def _one_stream(session: Any, url: str, body: bytes, window: _Window) -> str:
    sent = time.perf_counter()
    at_start = window.recording
    last: float | None = None
    text: list[str] = []
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            window.errors += 1
            if len(window.error_samples) < 3:
                window.error_samples.append(f"{r.status}: {(await r.text())[:200]}")
            return ""
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            now = time.perf_counter()
            doc = json.loads(payload)
            if "error" in doc:
                raise ValueError(f"error in stream: {doc['error']}")
            choices = doc.get("choices") or []
            piece = (choices[0].get("delta") or {}).get("content") if choices else None
            if not piece:
                continue
            text.append(piece)
            if window.recording:
                window.tokens += 1
                if last is None:
                    if at_start:
                        window.ttft_ms.append(1e3 * (now - sent))
                else:
                    window.itl_ms.append(1e3 * (now - last))
            last = now
    window.streams_done += 1
    return "".join(text)


async def _client(session: Any, url: str, body: bytes, window: _Window) -> None:
    while not window.stopping:
        try:
            await _one_stream(session, url, body, window)
        except (OSError, ValueError, asyncio.TimeoutError) as exc:
            window.errors += 1
            if len(window.error_samples) < 3:
                window.error_samples.append(repr(exc))
            await asyncio.sleep(0.05)


async def chat_stream_load(
    url: str, concurrency: int, max_tokens: int, duration_s: float, warmup_s: float, pid: int
) -> dict[str, Any]:
    import aiohttp

    body = _body(max_tokens)
    window = _Window()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
    ) as session:
        clients = [asyncio.create_task(_client(session, url, body, window))
                   for _ in range(concurrency)]  # fmt: skip
        await asyncio.sleep(warmup_s)
        srv0, busy0 = tree_cpu_seconds(pid), system_busy_seconds()
        cpu0, t0 = time.process_time(), time.perf_counter()
        window.recording = True
        await asyncio.sleep(duration_s)
        window.recording = False
        cpu1, t1 = time.process_time(), time.perf_counter()
        busy1, srv1 = system_busy_seconds(), tree_cpu_seconds(pid)
        window.stopping = True
        try:
            await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), 60)
        except asyncio.TimeoutError:
            for c in clients:
                c.cancel()
    elapsed = t1 - t0
    ttft, itl = sorted(window.ttft_ms), sorted(window.itl_ms)
    return {
        "concurrency": concurrency, "duration_s": elapsed,
        "tokens_per_s": window.tokens / elapsed, "streams_completed": window.streams_done,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "ttft_samples": len(ttft), "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99), "errors": window.errors,
        "error_samples": window.error_samples,
        "client_cpu_util": (cpu1 - cpu0) / elapsed,
        "server_cpu_util": (srv1 - srv0) / elapsed,
        "other_cpu_util": (busy1 - busy0 - (cpu1 - cpu0) - (srv1 - srv0)) / elapsed,
    }  # fmt: skip


def _plan(name: str, ctx: Context, folder: Path, max_wait_ms: float) -> Plan:
    port = launch.free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**ctx.base_env(), "BENCH_LM_DIR": str(folder)}
    if name == "aserve":
        cfg = ctx.scratch / "aserve-lm.json"
        gen = {**generation_config(), "max_num_seqs": ctx.max_batch}
        cfg.write_text(json.dumps({
            "http": {"host": "127.0.0.1", "port": port},
            "models": [{"name": MODEL, "engine": "decoder", "path": str(folder),
                        "device": "cpu", "dtype": "float32",
                        "cpu_threads": ctx.torch_threads, "generation": gen}],
        }))  # fmt: skip
        argv = [sys.executable, "-m", "aserve", "--config", str(cfg), "--port", str(port),
                "--log-level", "WARNING"]  # fmt: skip
        return Plan("aserve", argv, f"{base}/v1/chat/completions", env,
                    health_url=f"{base}/v2/health/ready")  # fmt: skip
    argv = [str(ctx.venv_python["litserve"]), str(launch.APPS / "litserve_app.py"),
            "--workload", "lm", "--port", str(port), "--max-batch", str(ctx.max_batch),
            "--max-wait-ms", str(max_wait_ms)]  # fmt: skip
    return Plan("litserve", argv, f"{base}/v1/chat/completions", env,
                health_url=f"{base}/health")  # fmt: skip


def _runner() -> Callable[..., Any]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def run(servers: list[str], ctx: Context, args: Any, log: Callable[[str], None]) -> dict[str, Any]:
    folder = chat_lm(ctx.cache)
    want = expected_text(folder, args.max_tokens)
    concurrency = [int(c) for c in str(args.stream_concurrency).split(",")]
    section: dict[str, Any] = {
        "description": (
            f"Model: GPT-2 architecture {GPT2_SHAPE}, seeded, float32; greedy, "
            f"{args.max_tokens} tokens per stream (EOS ignored), closed loop. Prompt: "
            f"{PROMPT!r}. aserve: engine decoder, continuous batching, max_num_seqs "
            f"{ctx.max_batch}. LitServe: OpenAISpec, max_batch_size {ctx.max_batch}, "
            f"batch_timeout {ctx.max_wait_ms} ms, each batch generated to the end (static "
            "batching, KV cache, left padding)."
        ),
        "expected_text": want,
        "servers": {},
    }
    runner = _runner()
    for name in [s for s in servers if s in STREAM_SERVERS]:
        if name == "litserve" and "litserve" not in ctx.venv_python:
            continue
        plan = _plan(name, ctx, folder, ctx.max_wait_ms)
        body = _body(args.max_tokens)
        out: dict[str, Any] = {"server": name}
        try:
            first = functools.partial(_first_stream, plan.url, args.max_tokens)
            with Running(plan, body, ctx.scratch / f"{name}-lm.log", first) as run_:
                out["cold_start_s"] = round(run_.cold_start_s, 2)
                got = run_.first_reply.decode()
                if "".join(got.split()) != "".join(want.split()):
                    raise RuntimeError(f"streamed text differs from in-process greedy:\n"
                                       f"got  {got[:200]!r}\nwant {want[:200]!r}")  # fmt: skip
                out["checked"] = True
                log(f"  {name}: up in {run_.cold_start_s:.1f} s, streamed text checked")
                out["points"] = {}
                for c in concurrency:
                    p = runner(chat_stream_load(plan.url, c, args.max_tokens, args.duration,
                                                args.point_warmup + 1.0, run_.pid))  # fmt: skip
                    out["points"][str(c)] = p
                    log(f"  {name:10s} {c:2d} streams: {p['tokens_per_s']:.0f} tokens/s, TTFT "
                        f"p50 {p['ttft_p50_ms']:.0f} p99 {p['ttft_p99_ms']:.0f} ms, ITL p50 "
                        f"{p['itl_p50_ms']:.1f} p99 {p['itl_p99_ms']:.1f} ms, errors "
                        f"{p['errors']}")  # fmt: skip
                out["peak_rss_mb"] = round(run_.peak_rss / 2**20, 1)
        except (StartError, RuntimeError, OSError, ValueError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
            log(f"  {name}: FAILED: {str(exc)[-400:]}")
        section["servers"][name] = out
    return section


async def _first_stream(url: str, max_tokens: int) -> tuple[int, bytes]:
    """One whole stream: ``(200, its text)``, or the status that refused it."""
    import aiohttp

    window = _Window()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        try:
            text = await _one_stream(session, url, _body(max_tokens), window)
        except aiohttp.ClientError as exc:
            raise OSError(repr(exc)) from None
    if window.errors:
        return 500, window.error_samples[0].encode()
    return 200, text.encode()
