"""Generation under overload: more streams than slots plus queue, clients that retry at once.

    python -m bench.gen_overload [--slots 4] [--queue 4] [--stormers 16 64] \
        [--max-tokens 64] [--warmup 2] [--duration 8] [--out-dir bench]

aserve serves the builtin tiny decoder (``builtin:tiny-gpt2``, as in
``configs/tiny-gpt2.json``) with ``generation.max_num_seqs`` = ``--slots``
and ``max_queue_size`` = ``--queue``. Every client streams
``POST /v1/chat/completions`` (``stream``, greedy, ``ignore_eos``, fixed
``max_tokens``) on one keep-alive connection and sends its next request the
moment the last one ended, whether it was refused (429) or streamed to the
end; a connection the server drops is opened again.

1. Unloaded: ``--slots`` clients (every slot busy, nobody queued).
2. Loaded, once per ``--stormers`` value: the same clients plus that many
   more, in a second process, so that ``slots + queue`` streams are admitted
   and the rest are refused over and over.
3. Unloaded again: the first phase repeated, after the storm.

Inter-token latency (ITL) is the time between two successive SSE events that
carry text, of one stream, as its client reads them; it is counted for every
stream that runs in the window, in both processes. Refusal latency is from
the request's last byte written to its status line read. Loop CPU per
refusal: the server's main process's CPU in the loaded window, less what
its text events cost at the unloaded phase's rate, over the refusals (and,
as an upper bound, all of it over the refusals). The
server's own ITL (between the steps that gave a sequence a token, on the
loop, before SSE) comes from its ``/metrics`` histogram, as a mean per
window.

Clients are raw asyncio protocols (no aiohttp) on uvloop, each group in its
own process, so that the stormers' loop does not delay the readers of the
first group. Prints one JSON object; ``--out-dir`` also writes
``results-gen-overload.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import re
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from bench.loadgen import Target, build_request, percentile
from bench.proctree import system_busy_seconds, tree_cpu_seconds
from bench.servers import MODEL_ENV, start_aserve

REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny-gpt2"
PROMPT = "The quick brown fox jumps over the lazy dog. A server streams tokens to many"
_perf = time.perf_counter
_CONTENT = b'"content":"'


class _Tally:
    """What one client process saw inside the window ``[t0, t1]``."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = t0, t1
        self.itl_ms: list[float] = []
        self.refusal_ms: list[float] = []
        self.statuses: dict[int, int] = {}
        self.streams_done = 0
        self.text_events = 0
        self.lost = 0
        self.errors: list[str] = []

    def inside(self, t: float) -> bool:
        return self.t0 <= t <= self.t1


class _Client(asyncio.Protocol):
    """One keep-alive connection, one request in flight, resent at once when it ends.

    Reads HTTP/1.1 responses with either a Content-Length body (a refusal) or
    a chunked one (a stream, whose SSE events are timed as they arrive).
    """

    def __init__(
        self, request: bytes, tally: _Tally, stop: asyncio.Event, again: Callable[[], None]
    ):
        self._request = request
        self._tally = tally
        self._stop = stop
        self._again = again
        self._transport: asyncio.Transport | None = None
        self._reset()

    def _reset(self) -> None:
        self._buf = b""
        self._status = 0
        self._head_done = False
        self._chunked = False
        self._need = 0  # Content-Length body bytes still to come
        self._sse = b""
        self._last_text: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._send()

    def _send(self) -> None:
        assert self._transport is not None
        self._reset()
        self._sent = _perf()
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        now = _perf()
        buf = self._buf + data
        if not self._head_done:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return
            head = buf[:end].lower()
            self._status = int(buf[9:12])
            self._head_done = True
            t = self._tally
            if t.inside(now):
                t.statuses[self._status] = t.statuses.get(self._status, 0) + 1
                if self._status in (429, 503):
                    t.refusal_ms.append(1e3 * (now - self._sent))
            self._chunked = b"transfer-encoding: chunked" in head
            if not self._chunked:
                m = re.search(rb"content-length: *(\d+)", head)
                self._need = int(m.group(1)) if m else 0
            buf = buf[end + 4 :]
        if not self._chunked:
            self._need -= len(buf)
            self._buf = b""
            if self._need <= 0:
                self._finished(now)
            return
        # Chunked: "<hex>\r\n<bytes>\r\n" ... "0\r\n\r\n".
        while True:
            nl = buf.find(b"\r\n")
            if nl < 0:
                break
            size = int(buf[:nl].split(b";")[0], 16)
            if size == 0:
                if len(buf) < nl + 4:
                    break
                self._finished(now)
                return
            if len(buf) < nl + 2 + size + 2:
                break
            self._events(buf[nl + 2 : nl + 2 + size], now)
            buf = buf[nl + 2 + size + 2 :]
        self._buf = buf

    def _events(self, body: bytes, now: float) -> None:
        sse = self._sse + body
        *events, self._sse = sse.split(b"\n\n")
        t = self._tally
        for ev in events:
            i = ev.find(_CONTENT)
            if i < 0 or ev[i + len(_CONTENT) : i + len(_CONTENT) + 1] == b'"':
                continue  # no text: the role chunk, the finish chunk, usage, [DONE]
            if t.inside(now):
                t.text_events += 1
                if self._last_text is not None:
                    t.itl_ms.append(1e3 * (now - self._last_text))
            self._last_text = now

    def _finished(self, now: float) -> None:
        if self._status == 200 and self._tally.inside(now):
            self._tally.streams_done += 1
        if self._stop.is_set():
            if self._transport is not None:
                self._transport.close()
            return
        self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stop.is_set():
            return
        if self._tally.inside(_perf()):
            self._tally.lost += 1
        self._again()


async def _clients(url: str, body: bytes, n: int, t0: float, t1: float) -> dict[str, Any]:
    target = Target.parse(url)
    request = build_request(target, body)
    loop = asyncio.get_running_loop()
    tally = _Tally(t0, t1)
    stop = asyncio.Event()
    protos: list[_Client] = []
    pending: set[asyncio.Task[None]] = set()

    async def connect() -> None:
        try:
            _, p = await loop.create_connection(
                lambda: _Client(request, tally, stop, again), target.host, target.port
            )
            protos.append(p)
        except OSError as exc:
            if len(tally.errors) < 3:
                tally.errors.append(repr(exc))

    def again() -> None:
        task = loop.create_task(connect())
        pending.add(task)
        task.add_done_callback(pending.discard)

    await asyncio.gather(*(connect() for _ in range(n)))
    cpu0 = time.process_time()
    await asyncio.sleep(max(0.0, t1 - _perf()))
    cpu = time.process_time() - cpu0
    stop.set()
    for p in protos:
        if p._transport is not None:
            p._transport.close()
    for task in list(pending):
        task.cancel()
    return {
        "clients": n,
        "itl_ms": tally.itl_ms,
        "refusal_ms": tally.refusal_ms,
        "statuses": tally.statuses,
        "streams_done": tally.streams_done,
        "text_events": tally.text_events,
        "lost": tally.lost,
        "errors": tally.errors,
        "client_cpu_s": cpu,
    }


def _client_process(url: str, body: bytes, n: int, t0: float, t1: float, conn: Any) -> None:
    """In its own process: ``n`` clients until ``t1``; the tally goes back over ``conn``."""
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    conn.send(runner(_clients(url, body, n, t0, t1)))
    conn.close()


def _itl_hist(base_url: str) -> tuple[float, int]:
    """The server's inter-token histogram: (sum seconds, count) over all its series."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total, count = 0.0, 0
    for line in text.splitlines():
        if line.startswith("aserve_inter_token_latency_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("aserve_inter_token_latency_seconds_count"):
            count += int(float(line.rsplit(" ", 1)[1]))
    return total, count


def phase(
    server: Any, body: bytes, groups: list[int], warmup_s: float, duration_s: float
) -> dict[str, Any]:
    """Client groups (one process each) for warm-up + window; the window's numbers."""
    ctx = multiprocessing.get_context("spawn")
    url = server.base_url + "/v1/chat/completions"
    # Processes start in ~1 s each; the window is set far enough ahead.
    t0 = _perf() + 2.0 + warmup_s
    t1 = t0 + duration_s
    procs, pipes = [], []
    for n in groups:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_client_process, args=(url, body, n, t0, t1, child), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        pipes.append(parent)
    time.sleep(max(0.0, t0 - _perf()))
    cpu0, main0, busy0 = tree_cpu_seconds(server.pid), _main_cpu(server.pid), system_busy_seconds()
    hist0 = _itl_hist(server.base_url)
    time.sleep(max(0.0, t1 - _perf()))
    cpu1, main1, busy1 = tree_cpu_seconds(server.pid), _main_cpu(server.pid), system_busy_seconds()
    hist1 = _itl_hist(server.base_url)
    outs = [pipe.recv() for pipe in pipes]
    for p in procs:
        p.join(15)
    itl = sorted(x for o in outs for x in o["itl_ms"])
    first_itl = sorted(outs[0]["itl_ms"])
    refusals = sorted(x for o in outs for x in o["refusal_ms"])
    statuses: dict[str, int] = {}
    for o in outs:
        for k, v in o["statuses"].items():
            statuses[str(k)] = statuses.get(str(k), 0) + v
    n_ref = len(refusals)
    server_itl = (hist1[0] - hist0[0]) / max(1, hist1[1] - hist0[1])
    return {
        "groups": groups,
        "duration_s": duration_s,
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "itl_max_ms": itl[-1] if itl else math.nan,
        "itl_samples": len(itl),
        "first_group_itl_p50_ms": percentile(first_itl, 50),
        "first_group_itl_p99_ms": percentile(first_itl, 99),
        "first_group_itl_samples": len(first_itl),
        "server_itl_mean_ms": 1e3 * server_itl,
        "refusals": n_ref,
        "refusals_per_s": n_ref / duration_s,
        "refusal_p50_ms": percentile(refusals, 50),
        "refusal_p99_ms": percentile(refusals, 99),
        "refusal_max_ms": refusals[-1] if refusals else math.nan,
        "statuses": statuses,
        "streams_done": sum(o["streams_done"] for o in outs),
        "text_events": sum(o["text_events"] for o in outs),
        "text_events_per_s": sum(o["text_events"] for o in outs) / duration_s,
        "lost": sum(o["lost"] for o in outs),
        "errors": [e for o in outs for e in o["errors"]][:3],
        "server_cpu_util": (cpu1 - cpu0) / duration_s,
        "server_main_cpu_s": main1 - main0,
        "server_main_cpu_util": (main1 - main0) / duration_s,
        "client_cpu_util": sum(o["client_cpu_s"] for o in outs) / duration_s,
        "machine_busy_cores": (busy1 - busy0) / duration_s,
        # What else kept the machine busy (the machine is shared).
        "other_cpu_util": (busy1 - busy0 - (cpu1 - cpu0) - sum(o["client_cpu_s"] for o in outs))
        / duration_s,
    }


def _main_cpu(pid: int) -> float:
    """CPU seconds of the server's main process alone (its loop and threads, no children)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def config(slots: int, queue: int, max_tokens: int) -> dict[str, Any]:
    return {
        "http": {"host": "127.0.0.1", "port": 0},
        "logging": {"access_log": False},
        "models": [
            {
                "name": MODEL,
                "engine": "decoder",
                "path": "builtin:tiny-gpt2",
                "device": "cpu",
                "cpu_threads": 1,
                "generation": {
                    "max_num_seqs": slots,
                    "max_queue_size": queue,
                    "max_model_len": 1024,
                    "max_tokens_default": max_tokens,
                    "max_tokens_cap": 512,
                },
            }
        ],
    }


def versus(unloaded: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    """A loaded phase against the unloaded one: ITL ratios, and the loop's CPU per refusal.

    The main process's CPU in the loaded window, less what streaming its text
    events cost at the unloaded phase's rate, over the refusals; the upper
    bound charges all of it to the refusals.
    """
    per_event = unloaded["server_main_cpu_s"] / max(1, unloaded["text_events"])
    refusals = loaded["refusals"]
    main_s = loaded["server_main_cpu_s"]
    return {
        "itl_p50_ratio": loaded["itl_p50_ms"] / unloaded["itl_p50_ms"],
        "itl_p99_ratio": loaded["itl_p99_ms"] / unloaded["itl_p99_ms"],
        "server_itl_mean_ratio": loaded["server_itl_mean_ms"] / unloaded["server_itl_mean_ms"],
        "text_events_ratio": loaded["text_events"] / max(1, unloaded["text_events"]),
        "loop_cpu_us_per_refusal": (
            1e6 * (main_s - per_event * loaded["text_events"]) / refusals if refusals else math.nan
        ),
        "loop_cpu_us_per_refusal_upper": 1e6 * main_s / refusals if refusals else math.nan,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gen_overload", description=__doc__.split("\n")[0]
    )
    p.add_argument("--slots", type=int, default=4, help="generation.max_num_seqs")
    p.add_argument("--queue", type=int, default=4, help="generation.max_queue_size")
    p.add_argument(
        "--stormers", type=int, nargs="+", default=[16, 64],
        help="extra clients, one loaded phase each",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per phase")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.update(MODEL_ENV)
    body = json.dumps({
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }).encode()  # fmt: skip
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    cfg = config(args.slots, args.queue, args.max_tokens)
    cache = Path(os.environ.get("ASERVE_BENCH_CACHE", Path.home() / ".cache/aserve/bench"))
    cache.mkdir(parents=True, exist_ok=True)
    cfg_path = cache / f"gen-overload-{os.getpid()}.json"
    cfg_path.write_text(json.dumps(cfg))
    loaded: dict[str, Any] = {}
    try:
        with start_aserve(cfg_path, REPO) as server:
            unloaded = phase(server, body, [args.slots], args.warmup, args.duration)
            print(f"unloaded:       {_line(unloaded)}", file=sys.stderr, flush=True)
            for m in args.stormers:
                r = phase(server, body, [args.slots, m], args.warmup, args.duration)
                r.update(versus(unloaded, r))
                loaded[str(m)] = r
                print(f"loaded +{m:3d}:   {_line(r)}", file=sys.stderr, flush=True)
            # Once more alone: the storm left nothing behind, and a second
            # sample of the unloaded numbers on a shared machine.
            after = phase(server, body, [args.slots], args.warmup, args.duration)
            print(f"unloaded again: {_line(after)}", file=sys.stderr, flush=True)
    finally:
        cfg_path.unlink(missing_ok=True)
    out = {
        "command": " ".join(["python -m bench.gen_overload", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": len(os.sched_getaffinity(0)),
        "loadavg_before": loadavg_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "slots": args.slots,
        "queue": args.queue,
        "max_tokens": args.max_tokens,
        "unloaded": unloaded,
        "loaded": loaded,
        "unloaded_again": after,
    }
    print(json.dumps(out, indent=2))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "results-gen-overload.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _line(r: dict[str, Any]) -> str:
    return (
        f"ITL p50 {r['itl_p50_ms']:.2f} p99 {r['itl_p99_ms']:.2f} ms ({r['itl_samples']}), "
        f"server ITL mean {r['server_itl_mean_ms']:.2f} ms, refusals {r['refusals']} "
        f"(p50 {r['refusal_p50_ms']:.2f} p99 {r['refusal_p99_ms']:.2f} ms), "
        f"statuses {r['statuses']}, server CPU {r['server_cpu_util']:.2f} "
        f"(loop {r['server_main_cpu_util']:.2f}), tokens/s {r['text_events_per_s']:.0f}, "
        f"clients CPU {r['client_cpu_util']:.2f}, other {r['other_cpu_util']:.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
