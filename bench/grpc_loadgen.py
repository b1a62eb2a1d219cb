"""Closed-loop gRPC load generator (grpc.aio ``ModelInfer``, uvloop when installed).

``concurrency`` coroutines each keep exactly one ``ModelInfer`` in flight
over ``channels`` shared channels (coroutine ``i`` uses channel ``i %
channels``). With ``stream`` (``--stream``), each coroutine opens one
``ModelStreamInfer`` call instead and keeps one request in flight on it: the
same closed loop, without a call per request (how a high-rate client, or
tritonclient's ``start_stream``/``async_stream_infer``, talks to a server). The request message is built once (inputs as
``raw_input_contents``) and sent again as soon as its answer arrives, so the
per-request client work is grpc's own: serialising a prebuilt message and
parsing the reply.

Run shape as :mod:`bench.loadgen`: warm up for ``warmup_s`` (nothing
recorded), then record for ``duration_s``. A reply counts when it completes
inside the window; latency percentiles are over the successful replies; every
RPC error counts as an error (by status code).

As a library: :func:`run_load`, :func:`infer_once`, :func:`build_request`,
:func:`decode_fp32`. As a program::

    python -m bench.grpc_loadgen HOST:PORT --model NAME --values JSON \
        [--concurrency N] [--duration S] [--warmup S] [--channels K] [--stream] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from aserve._proto import grpc_service_pb2 as pb
from aserve._proto import grpc_service_pb2_grpc as pb_grpc
from bench.loadgen import LoadResult, percentile, timed_window

_perf_ns = time.perf_counter_ns

CHANNEL_OPTIONS = [
    # Separate channels must really be separate HTTP/2 connections.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", -1),
]


def build_request(
    model: str, values: Sequence[float], input_name: str = "INPUT0", output_name: str = "OUTPUT0"
) -> pb.ModelInferRequest:
    """A one-item FP32 ``ModelInfer`` request with its input as raw little-endian bytes."""
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = input_name, "FP32"
    tensor.shape.extend([1, len(values)])
    request.outputs.add().name = output_name
    request.raw_input_contents.append(struct.pack(f"<{len(values)}f", *values))
    return request


def decode_fp32(response: pb.ModelInferResponse) -> list[float]:
    """The first output of a reply as floats (raw or typed contents)."""
    if response.raw_output_contents:
        raw = response.raw_output_contents[0]
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return list(response.outputs[0].contents.fp32_contents)


def _channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


async def infer_once(
    target: str, request: pb.ModelInferRequest, timeout_s: float = 30.0
) -> pb.ModelInferResponse:
    """Send ``request`` once on a fresh channel; raises ``grpc.aio.AioRpcError`` on failure."""
    async with _channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        response: pb.ModelInferResponse = await stub.ModelInfer(request, timeout=timeout_s)
        return response


class _Window:
    __slots__ = ("errors", "latencies_ns", "recording", "statuses", "stopping")

    def __init__(self) -> None:
        self.recording = False
        self.stopping = False
        self.latencies_ns: list[int] = []
        self.errors = 0
        self.statuses: dict[str, int] = {}


async def _worker(infer: Any, request: pb.ModelInferRequest, window: _Window) -> None:
    latencies = window.latencies_ns
    while not window.stopping:
        sent = _perf_ns()
        try:
            await infer(request)
        except grpc.aio.AioRpcError as exc:
            if window.recording:
                window.errors += 1
                name = exc.code().name
                window.statuses[name] = window.statuses.get(name, 0) + 1
            continue
        if window.recording:
            latencies.append(_perf_ns() - sent)


async def _stream_worker(stub: Any, request: pb.ModelInferRequest, window: _Window) -> None:
    latencies = window.latencies_ns
    call = stub.ModelStreamInfer()
    try:
        while not window.stopping:
            sent = _perf_ns()
            try:
                await call.write(request)
                reply = await call.read()
            except grpc.aio.AioRpcError as exc:
                if window.recording:
                    window.errors += 1
                    name = exc.code().name
                    window.statuses[name] = window.statuses.get(name, 0) + 1
                call = stub.ModelStreamInfer()  # the call is over: a new one
                continue
            if reply is grpc.aio.EOF or reply.error_message:
                if window.recording:
                    window.errors += 1
                    name = "EOF" if reply is grpc.aio.EOF else "error_message"
                    window.statuses[name] = window.statuses.get(name, 0) + 1
                if reply is grpc.aio.EOF:
                    call = stub.ModelStreamInfer()
                continue
            if window.recording:
                latencies.append(_perf_ns() - sent)
    finally:
        call.cancel()


async def run_load(
    target: str,
    request: pb.ModelInferRequest,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 2.0,
    *,
    channels: int = 1,
    stream: bool = False,
    on_window_start: Callable[[], None] | None = None,
    on_window_end: Callable[[], None] | None = None,
) -> LoadResult:
    """Drive ``target`` (HOST:PORT) with ``concurrency`` closed-loop ``ModelInfer`` callers
    (one ``ModelStreamInfer`` call each with ``stream``).

    Returns :class:`bench.loadgen.LoadResult` (``error_statuses`` keyed by
    gRPC status name instead of HTTP code; ``connections_lost`` is always 0).
    """
    if concurrency < 1 or duration_s <= 0 or warmup_s < 0 or channels < 1:
        raise ValueError("need concurrency >= 1, channels >= 1, duration_s > 0, warmup_s >= 0")
    chans = [_channel(target) for _ in range(min(channels, concurrency))]
    for chan in chans:
        await asyncio.wait_for(chan.channel_ready(), 10)
    stubs = [pb_grpc.GRPCInferenceServiceStub(chan) for chan in chans]
    window = _Window()
    if stream:
        workers = [
            asyncio.create_task(_stream_worker(stubs[i % len(stubs)], request, window))
            for i in range(concurrency)
        ]
    else:
        workers = [
            asyncio.create_task(_worker(stubs[i % len(stubs)].ModelInfer, request, window))
            for i in range(concurrency)
        ]
    try:
        elapsed, cpu = await timed_window(
            window, warmup_s, duration_s, on_window_start, on_window_end
        )
        # Each worker finishes the call it has in flight, then stops.
        await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), 30)
    finally:
        window.stopping = True
        for task in workers:
            task.cancel()
        for chan in chans:
            await chan.close()

    lat = sorted(ns / 1e6 for ns in window.latencies_ns)
    ok = len(lat)
    return LoadResult(
        concurrency=concurrency,
        duration_s=elapsed,
        requests=ok + window.errors,
        errors=window.errors,
        error_statuses=dict(sorted(window.statuses.items())),  # type: ignore[arg-type]
        connections_lost=0,
        rps=ok / elapsed,
        p50_ms=percentile(lat, 50),
        p90_ms=percentile(lat, 90),
        p99_ms=percentile(lat, 99),
        mean_ms=sum(lat) / ok if ok else math.nan,
        max_ms=lat[-1] if lat else math.nan,
        client_cpu_util=cpu / elapsed,
    )


def check_outputs(
    response: pb.ModelInferResponse,
    expected: Sequence[float],
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> None:
    """Raise ``ValueError`` unless the reply's first output matches ``expected``."""
    got = decode_fp32(response)
    if len(got) != len(expected):
        raise ValueError(f"output has {len(got)} values, expected {len(expected)}")
    for i, (g, w) in enumerate(zip(got, expected, strict=True)):
        if not abs(g - w) <= atol + rtol * abs(w):
            raise ValueError(f"output[{i}] = {g}, expected {w}")


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    values = json.loads(args.values)
    request = build_request(args.model, values)
    first = await infer_once(args.target, request)
    if args.expect is not None:
        check_outputs(first, json.loads(args.expect))
    result = await run_load(
        args.target, request, args.concurrency, args.duration, args.warmup,
        channels=args.channels, stream=args.stream,
    )  # fmt: skip
    return result.as_dict()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.grpc_loadgen", description=__doc__.split("\n")[0]
    )
    p.add_argument("target", help="HOST:PORT of the gRPC server")
    p.add_argument("--model", required=True)
    p.add_argument("--values", required=True, help="JSON list of the FP32 input values")
    p.add_argument("--expect", help="JSON list the first reply's output must match")
    p.add_argument("--concurrency", "-c", type=int, default=1)
    p.add_argument("--channels", type=int, default=1)
    p.add_argument("--duration", "-d", type=float, default=10.0)
    p.add_argument("--warmup", "-w", type=float, default=2.0)
    p.add_argument("--stream", action="store_true", help="one ModelStreamInfer call per caller")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        runner: Callable[..., Any] = asyncio.run
    else:
        runner = uvloop.run
    out = runner(_main(args))
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"c={out['concurrency']} {out['rps']:.0f} req/s  p50 {out['p50_ms']:.3f} ms  "
            f"p99 {out['p99_ms']:.3f} ms  errors {out['errors']}  "
            f"client cpu {out['client_cpu_util']:.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
