"""The plain aiohttp handler: the model called per request on the event loop, no batching.

    python bench/peers/apps/plain_app.py --workload tiny|minilm --port N

The floor of Python HTTP overhead (shared/PEERS.md): uvloop, no access log.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import common
import orjson
from aiohttp import web


def make_app(workload: str) -> web.Application:
    model = common.load(workload)

    async def infer(request: web.Request) -> web.Response:
        try:
            item = common.parse_input(orjson.loads(await request.read()), workload)
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
            return web.Response(status=400, text=str(exc))
        row = common.run_batch(model, workload, [item])[0]
        return web.Response(body=orjson.dumps(common.response_doc(workload, row)),
                            content_type="application/json")  # fmt: skip

    app = web.Application()
    app.router.add_post("/infer", infer)
    return app


async def serve(app: web.Application, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True, choices=["tiny", "minilm"])
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    common.set_threads()
    import uvloop

    uvloop.run(serve(make_app(args.workload), args.port))


if __name__ == "__main__":
    main()
