"""Standard gRPC health checking (``grpc.health.v1.Health``) and reflection.

Health statuses are kept by grpcio-health-checking's asyncio servicer, on the
loop. aserve reports:

- ``""`` (the whole server) and ``inference.GRPCInferenceService``: SERVING
  when the server is ready, NOT_SERVING while starting or draining;
- ``<model>`` (its highest version) and ``<model>/<version>``: SERVING when
  that model version is ready for inference.

An unknown name answers NOT_FOUND to Check and SERVICE_UNKNOWN to Watch, as
the health protocol says.

Frontends layer, on the loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from aserve._proto import POOL

if TYPE_CHECKING:
    from aserve.loop.registry import ModelRegistry
    from aserve.loop.runtimes.base import Runtime

INFERENCE_SERVICE = "inference.GRPCInferenceService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REFLECTED_SERVICES = (INFERENCE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)


class Health:
    """The statuses the Health service answers with; call only on the loop."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self._reported: set[str] = set()  # model names and name/version reported so far
        # Each set() may wait for a watcher's write, so two updates can overlap; without
        # the lock an older one (the server not ready yet) could finish last and leave
        # NOT_SERVING behind for good. asyncio.Lock is FIFO: the newest report wins.
        self._lock = asyncio.Lock()

    async def update(self, server_ready: bool, registry: ModelRegistry) -> None:
        """Report the server's and every model version's readiness."""
        async with self._lock:
            await self._update(server_ready, registry)

    async def _update(self, server_ready: bool, registry: ModelRegistry) -> None:
        overall = SERVING if server_ready else NOT_SERVING
        await self.servicer.set(health.OVERALL_HEALTH, overall)
        await self.servicer.set(INFERENCE_SERVICE, overall)
        reported = set()
        for rt in registry:
            key = f"{rt.name}/{rt.version}"
            reported.add(key)
            await self.servicer.set(key, _status(server_ready, rt))
        for name in {rt.name for rt in registry}:
            # Without a version, the one a request without a version is routed to.
            reported.add(name)
            await self.servicer.set(name, _status(server_ready, registry.get(name)))
        for gone in self._reported - reported:  # removed by a reload or unloaded
            await self.servicer.set(gone, NOT_SERVING)
        self._reported = reported

    async def draining(self) -> None:
        """Every status turns NOT_SERVING for good; watchers are told at once."""
        await self.servicer.enter_graceful_shutdown()


def _status(server_ready: bool, runtime: Runtime) -> health_pb2.HealthCheckResponse.ServingStatus:
    return SERVING if server_ready and runtime.ready else NOT_SERVING


def reflection_pool() -> DescriptorPool:
    """The descriptor pool that server reflection answers from.

    aserve's messages live in a private pool (see ``aserve._proto``) while
    grpcio registers the health and reflection services in the default one;
    reflection reads a single pool, so their files are copied into ours.
    """
    for module in (health_pb2, reflection_pb2):
        name = module.DESCRIPTOR.name
        try:
            POOL.FindFileByName(name)
        except KeyError:
            POOL.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    return POOL
