"""The "plain aiohttp handler" peer: one TorchScript model called per request, no batching.

The floor of Python HTTP overhead: the handler decodes the KServe V2 JSON
body, runs the model right on the event loop (so requests are strictly one at
a time, as a naive server would) and answers V2 JSON. It speaks just enough of
the protocol for the benchmark: ``POST /v2/models/{name}/infer`` with one
input, and ``GET /v2/health/ready``. Settings follow shared/PEERS.md: uvloop,
no access log, one torch thread.

    python -m bench.baseline_aiohttp --model FILE.pt --name NAME [--port 0]

Like aserve it logs ``listening on http://HOST:PORT`` to stderr once serving, and
stops on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
from aiohttp import web

log = logging.getLogger("bench.baseline")


def load_model(path: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice
        module = torch.jit.load(path, map_location="cpu")
    return module.eval()


def make_app(module: Any, name: str, output_name: str = "OUTPUT0") -> web.Application:
    """The aiohttp app serving ``module`` as model ``name``."""

    async def infer(request: web.Request) -> web.Response:
        if request.match_info["model"] != name:
            return web.json_response({"error": f"unknown model '{name}'"}, status=404)
        try:
            doc = orjson.loads(await request.read())
            item = doc["inputs"][0]
            x = np.asarray(item["data"], dtype=np.float32).reshape(item["shape"])
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
            return web.Response(status=400, body=orjson.dumps({"error": str(exc)}))
        with torch.inference_mode():
            y = module(torch.from_numpy(x)).numpy()
        out = {
            "model_name": name,
            "model_version": "1",
            "outputs": [
                {"name": output_name, "datatype": "FP32", "shape": list(y.shape), "data": y.ravel()}
            ],
        }
        body = orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY)
        return web.Response(body=body, content_type="application/json")

    return _app(infer)


def make_floor_app(answer: bytes) -> web.Application:
    """An aiohttp app that reads each request's body and sends ``answer``, with no
    parsing and no model: what one aiohttp loop answers at most on this
    machine, the floor under any server built on it."""

    async def infer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    return _app(infer)


def _app(infer: Any) -> web.Application:
    """The app: ``infer`` on the V2 infer route, and a readiness route."""

    async def ready(request: web.Request) -> web.Response:
        return web.Response(body=b'{"ready":true}', content_type="application/json")

    app = web.Application()
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_get("/v2/health/ready", ready)
    return app


async def serve(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)  # per-request logging costs more than the model
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    for sock in server.sockets:  # type: ignore[attr-defined]
        bound_host, bound_port = sock.getsockname()[:2]
        log.info("listening on http://%s:%d", bound_host, bound_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Explicit handlers: a process started in the background by a shell inherits
    # SIGINT as ignored, and the default SIGTERM action skips the cleanup.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.baseline_aiohttp")
    p.add_argument("--model", required=True, help="TorchScript .pt file")
    p.add_argument("--name", required=True, help="model name in the URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--floor", metavar="BODY", help="answer the model's answer to this request "
                   "body (a V2 JSON file) to every request, without parsing or running anything")  # fmt: skip
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    module = load_model(args.model)
    import uvloop

    if args.floor:
        doc = orjson.loads(Path(args.floor).read_bytes())["inputs"][0]
        x = np.asarray(doc["data"], dtype=np.float32).reshape(doc["shape"])
        with torch.inference_mode():
            y = module(torch.from_numpy(x)).numpy()
        answer = orjson.dumps({"model_name": args.name, "model_version": "1", "outputs": [
            {"name": "OUTPUT0", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel()}
        ]}, option=orjson.OPT_SERIALIZE_NUMPY)  # fmt: skip
        app = make_floor_app(answer)
    else:
        app = make_app(module, args.name)
    uvloop.run(serve(app, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
