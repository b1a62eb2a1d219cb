"""The reloader tells the server of each swap through the hook the server fills.

:class:`aserve.loop.reload.Reloader` is handed the routing table and an
``on_swapped`` hook, not the server: once a change is applied, the server's
config names the models now served and gRPC health says so, by the time the
change returns (not at the readiness watcher's next look).
"""

from __future__ import annotations

from pathlib import Path

import grpc
from conftest import model_entry, spec
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inprocess import in_process

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _affine(name: str) -> dict:
    io = ([spec("INPUT0", "FP32", [16])], [spec("OUTPUT0", "FP32", [16])])
    return model_entry(name, "affine.pt", *io)


async def test_a_repository_change_updates_the_servers_config_and_grpc_health(
    model_dir: Path,
) -> None:
    config = {"grpc": {"host": "127.0.0.1", "port": 0}, "models": [_affine("a"), _affine("b")]}
    async with in_process(config, model_dir) as srv:
        server = srv.server
        port = server.grpc.addresses[0][1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def status(service: str) -> int:
                request = health_pb2.HealthCheckRequest(service=service)
                return (await health.Check(request, timeout=30)).status

            assert await status("b") == SERVING
            await server.reloader.unload_model("b")
            assert [m.name for m in server.config.models] == ["a"]
            assert await status("b") == NOT_SERVING
            assert await status("a") == SERVING

            await server.reloader.load_model("b")
            assert sorted(m.name for m in server.config.models) == ["a", "b"]
            assert await status("b") == SERVING
