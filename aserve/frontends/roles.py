"""Which role of API key each route needs (frontends layer; pure, looked up on the loop).

Two roles: an *inference* key (``auth.api_keys_env`` / ``auth.api_keys_file``,
the keys every config had before roles) may infer, generate and read
metadata, statistics and health; an *admin* key (``auth.admin_keys_env`` /
``auth.admin_keys_file``) may do that and also change or inspect what is
served: the model repository API, the config routes, and, reserved for when
they are built, shared-memory registration (built), trace and log settings. With no
``"auth"`` in the config no key is asked for at all.

The tables name every route of both frontends: :data:`HTTP_ROUTES` by the
aiohttp resource's path template, :data:`GRPC_METHODS` by the full method
name. A route that is in neither needs an admin key (a route added without a
role is closed, not open), and ``tests/test_roles.py`` fails for it until
it is given one. Paths and methods that no route serves yet but that would
change the server (:data:`ADMIN_PATH_PREFIXES`, the reserved gRPC methods)
are admin's already, so that a later route there cannot be reached with an
inference key.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final


class Role(enum.Enum):
    INFERENCE = "inference"
    ADMIN = "admin"

    def allows(self, needed: Role) -> bool:
        """Whether a key of this role may use a route that needs ``needed``
        (an admin key may do all that an inference key may)."""
        return self is Role.ADMIN or needed is Role.INFERENCE


_I, _A = Role.INFERENCE, Role.ADMIN
_MODEL_ROUTES = ("", "/infer", "/config", "/ready", "/stats", "/generate", "/generate_stream")

# By the aiohttp resource's template (``resource.canonical``).
HTTP_ROUTES: Final[Mapping[str, Role]] = {
    "/v2/health/live": _I,
    "/v2/health/ready": _I,
    "/v2": _I,
    "/v2/": _I,
    "/v2/models": _I,
    "/v2/models/stats": _I,
    **{f"/v2/models/{{model}}{tail}": _I for tail in _MODEL_ROUTES},
    **{f"/v2/models/{{model}}/versions/{{version}}{tail}": _I for tail in _MODEL_ROUTES},
    "/v1/models": _I,
    "/v1/models/{model}": _I,
    "/v1/completions": _I,
    "/v1/chat/completions": _I,
    "/v1/embeddings": _I,
    "/predictions/{model}": _I,
    "/predictions/{model}/{version}": _I,
    "/metrics": _I,
    "/openapi.json": _I,
    "/": _I,  # the dashboard page
    "/v2/dashboard/stats": _I,
    "/v2/config/status": _A,
    "/v2/repository/index": _A,
    "/v2/repository/models/{model}/load": _A,
    "/v2/repository/models/{model}/unload": _A,
    # Triton's shared memory extensions: registering maps a client's memory.
    **{
        f"{base}{tail}": _A
        for base in ("/v2/systemsharedmemory", "/v2/cudasharedmemory")
        for tail in (
            "/status",
            "/region/{name}/status",
            "/region/{name}/register",
            "/unregister",
            "/region/{name}/unregister",
        )
    },
}
# The catch-all that answers 404 for any other path.
NOT_FOUND_ROUTE: Final = "/{tail}"
# Paths that are admin's wherever they are served: the config and repository
# routes, Triton's shared-memory extensions, and its trace and logging ones (not built).
ADMIN_PATH_PREFIXES: Final = (
    "/v2/config",
    "/v2/repository",
    "/v2/systemsharedmemory",
    "/v2/cudasharedmemory",
    "/v2/trace",
    "/v2/logging",
)

_KSERVE = "/inference.GRPCInferenceService/"
GRPC_METHODS: Final[Mapping[str, Role]] = {
    **{
        _KSERVE + m: _I
        for m in (
            "ServerLive",
            "ServerReady",
            "ModelReady",
            "ServerMetadata",
            "ModelMetadata",
            "ModelInfer",
            "ModelStreamInfer",
            "ModelConfig",
            "ModelStatistics",
        )
    },
    _KSERVE + "RepositoryIndex": _A,
    # Triton's RPCs that change the server (shared memory, repository load/unload; trace, logging not yet).
    **{
        _KSERVE + m: _A
        for m in (
            "RepositoryModelLoad",
            "RepositoryModelUnload",
            "SystemSharedMemoryStatus",
            "SystemSharedMemoryRegister",
            "SystemSharedMemoryUnregister",
            "CudaSharedMemoryStatus",
            "CudaSharedMemoryRegister",
            "CudaSharedMemoryUnregister",
            "TraceSetting",
            "LogSettings",
        )
    },
    "/aserve.v1.Generation/Generate": _I,
    "/grpc.health.v1.Health/Check": _I,
    "/grpc.health.v1.Health/Watch": _I,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": _I,
}


def is_admin_path(path: str) -> bool:
    """Whether ``path`` lies under one of :data:`ADMIN_PATH_PREFIXES`."""
    return any(path == p or path.startswith(p + "/") for p in ADMIN_PATH_PREFIXES)


def http_role(template: str, path: str) -> Role:
    """The role the route of ``template`` needs for a request to ``path``."""
    role = HTTP_ROUTES.get(template)
    if role is not None:
        return role
    if template == NOT_FOUND_ROUTE:  # no route: 404 for an inference key, but not where
        return _A if is_admin_path(path) else _I  # an admin route will be
    return _A  # a route without a role is closed


def grpc_role(method: str, served: bool) -> Role:
    """The role gRPC method ``method`` needs; ``served``: whether the server has a
    handler for it (one it does not have answers UNIMPLEMENTED to any valid key)."""
    role = GRPC_METHODS.get(method)
    if role is not None:
        return role
    return _A if served else _I


def forbidden(route: str, needed: Role, has_admin_keys: bool) -> str:
    """Why a valid key of the wrong role is refused ``route``, and what to do."""
    if has_admin_keys:
        return f"{route} needs an {needed.value} API key; this key is an inference key"
    return (
        f"{route} needs an {needed.value} API key, and none is configured: "
        "set auth.admin_keys_env or auth.admin_keys_file (inference keys may not use it)"
    )
