"""What a call costs in the protocol libraries alone: echo servers over aiohttp and grpcio.

    python -m bench.grpc_floor [--duration 4] [--warmup 1] [--concurrency 16 64]

Each server echoes a 200-byte body and does nothing else, in its own
process: aiohttp (``POST``), grpc.aio unary (a generic handler on raw bytes:
no protobuf on either side), grpcio's thread-pool server unary (the same
handler, 16 threads), and grpc.aio bidirectional streaming (one call per
caller, one message in flight on it). The clients run in this process under
uvloop, closed loop. Server CPU per call is the server process's CPU time in
the window over the calls completed in it: the floor under what any server
built on that library and call shape can spend per request. ``bench.grpc_row``
runs this after its own points and reports both.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from bench.proctree import tree_cpu_seconds

KINDS = ("http", "grpc-aio-unary", "grpc-sync-unary", "grpc-aio-stream")
BODY = b"x" * 200
_SERVICE = "floor.Echo"


async def _serve(kind: str) -> None:
    """Serve ``kind`` on a free loopback port, print the port, run until stdin closes."""
    if kind == "http":
        from aiohttp import web

        async def echo(request: web.Request) -> web.Response:
            return web.Response(body=await request.read())

        app = web.Application()
        app.router.add_post("/echo", echo)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
    else:
        import grpc

        async def unary(request: bytes, context: Any) -> bytes:
            return request

        async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async for request in requests:
                yield request

        if kind == "grpc-sync-unary":
            handlers = {"Unary": grpc.unary_unary_rpc_method_handler(lambda r, c: r)}
            server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16))
        else:
            handlers = {
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "Stream": grpc.stream_stream_rpc_method_handler(stream),
            }
            server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        started = server.start()
        if started is not None:
            await started
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def _drive(kind: str, port: int, concurrency: int, seconds: float, warmup: float) -> int:
    """Closed-loop calls for ``warmup + seconds``; the calls completed in the last ``seconds``."""
    done = [0]
    recording = [False]
    stop_at = time.perf_counter() + warmup + seconds
    if kind == "http":
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        url = f"http://127.0.0.1:{port}/echo"

        async def caller() -> None:
            while time.perf_counter() < stop_at:
                async with session.post(url, data=BODY) as r:
                    await r.read()
                done[0] += recording[0]

    else:
        import grpc

        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        unary = channel.unary_unary(f"/{_SERVICE}/Unary")
        stream = channel.stream_stream(f"/{_SERVICE}/Stream")

        async def caller() -> None:
            if kind == "grpc-aio-stream":
                call = stream()
                while time.perf_counter() < stop_at:
                    await call.write(BODY)
                    await call.read()
                    done[0] += recording[0]
                await call.done_writing()
                return
            while time.perf_counter() < stop_at:
                await unary(BODY)
                done[0] += recording[0]

    async def window() -> None:
        await asyncio.sleep(warmup)
        recording[0] = True

    try:
        await asyncio.gather(window(), *(caller() for _ in range(concurrency)))
    finally:
        await (session.close() if kind == "http" else channel.close())
    return done[0]


def measure(kind: str, concurrency: int, seconds: float, warmup: float) -> dict[str, Any]:
    """One point: ``kind``'s echo server under ``concurrency`` callers."""
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_floor", "--serve", kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        cpu = {}

        async def run() -> int:
            async def mark() -> None:
                await asyncio.sleep(warmup)
                cpu["start"], cpu["t0"] = tree_cpu_seconds(server.pid), time.perf_counter()

            marker = asyncio.create_task(mark())
            n = await _drive(kind, port, concurrency, seconds, warmup)
            await marker
            cpu["end"], cpu["t1"] = tree_cpu_seconds(server.pid), time.perf_counter()
            return n

        import uvloop

        calls = uvloop.run(run())
    finally:
        server.kill()
        server.wait()
    window = cpu["t1"] - cpu["t0"]
    return {
        "kind": kind,
        "concurrency": concurrency,
        "calls_per_s": calls / window,
        "server_cpu_ms_per_call": 1e3 * (cpu["end"] - cpu["start"]) / calls if calls else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.grpc_floor", description=__doc__.split("\n")[0]
    )
    p.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    args = p.parse_args(argv)
    if args.serve:
        import uvloop

        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        uvloop.run(_serve(args.serve))
        return 0
    for c in args.concurrency:
        for kind in KINDS:
            r = measure(kind, c, args.duration, args.warmup)
            print(
                f"c={c:<3d} {kind:16s} {r['calls_per_s']:7.0f} calls/s  "
                f"server CPU {r['server_cpu_ms_per_call']:.3f} ms/call"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
