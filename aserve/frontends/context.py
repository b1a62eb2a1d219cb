"""What a frontend may see of the server (frontends layer: built by the server, read by
the HTTP and gRPC frontends).

:class:`FrontendContext` is built once by the server and handed to the HTTP
and gRPC frontends instead of the whole ``Server``: the model registry
(routing), the admission (``limits.max_concurrency``), the metrics, the
reloader (Triton's repository routes), the API keys, the config the server
started with, why the server is not ready, the shared devices and the memory
budget's snapshot, the registered shared memory regions. Everything in it is
used on the loop.

``config`` is a snapshot taken at start: the settings frontends read
(``limits``, ``http``, ``grpc``, ``tls``, ``auth``, ``dashboard``) change
only with a restart; a reload changes the models, which frontends find in
``registry``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aserve.frontends.shm_regions import SystemSharedMemory

if TYPE_CHECKING:
    from aserve.config import ServerConfig
    from aserve.frontends.auth import ApiKeys
    from aserve.frontends.common import Admission
    from aserve.loop.device_scheduler import Devices
    from aserve.loop.registry import ModelRegistry
    from aserve.loop.reload import Reloader
    from aserve.obs.metrics import Metrics


@dataclass(frozen=True, slots=True)
class FrontendContext:
    config: ServerConfig
    base_dir: Path  # relative paths in the config (TLS files) are relative to it
    registry: ModelRegistry
    admission: Admission
    metrics: Metrics
    reloader: Reloader
    api_keys: ApiKeys | None
    not_ready_reason: Callable[[], str | None]  # why the server is not ready, None when it is
    devices: Devices  # the shared devices' schedulers (what the dashboard shows of them)
    # The memory budget's snapshot (each device's budget and use, each model's loads);
    # None: a server without one (the dashboard shows no memory then).
    memory: Callable[[], dict[str, Any]] | None = None
    # The system shared memory regions clients registered (Triton's extension), for
    # both frontends: registered over one, named in requests over either.
    shared_memory: SystemSharedMemory = field(default_factory=SystemSharedMemory)
