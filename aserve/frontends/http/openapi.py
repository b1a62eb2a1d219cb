"""``GET /openapi.json``: an OpenAPI 3.1 description of the HTTP API.

Written by hand, beside the routes; ``tests/test_auth_tls_openapi.py``
checks that every route the aiohttp app serves is described here and that
nothing else is. The document is built once and served as bytes.

Frontends layer: built once when the routes are added, served from the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from aserve import __version__

if TYPE_CHECKING:
    from aserve.frontends.http.kit import RouteKit

_ERROR = {"$ref": "#/components/schemas/Error"}
_JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _op(
    summary: str,
    ok: dict[str, Any] | None = None,
    body: dict[str, Any] | None = None,
    errors: tuple[int, ...] = (),
    ok_type: str = _JSON,
) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {
            "description": "OK",
            "content": {ok_type: {"schema": ok or {"type": "object"}}},
        }
    }
    for status in errors:
        responses[str(status)] = {
            "description": _REASONS[status],
            "content": {_JSON: {"schema": _ERROR}},
        }
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {_JSON: {"schema": body}}}
    return op


_REASONS = {
    400: "Invalid request (names the field, tensor or value)",
    401: "Missing or invalid API key",
    404: "Unknown model or version",
    413: "Over limits.max_request_bytes or limits.max_tensor_elements",
    429: "Queue full or server limit reached; see Retry-After",
    500: "The model failed",
    501: "A protocol feature aserve does not offer",
    503: "Not ready, or the deadline cannot be met",
    504: "The deadline passed",
}
_INFER_ERRORS = (400, 401, 404, 413, 429, 500, 501, 503, 504)

_SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
    "Tensor": {
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "datatype": {
                "type": "string",
                "enum": [
                    "BOOL",
                    "UINT8",
                    "UINT16",
                    "UINT32",
                    "UINT64",
                    "INT8",
                    "INT16",
                    "INT32",
                    "INT64",
                    "FP16",
                    "FP32",
                    "FP64",
                    "BYTES",
                ],
            },
            "parameters": {"type": "object"},
            "data": {"type": "array", "description": "Row-major, flat or nested"},
        },
    },
    "InferRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {
                "type": "object",
                "description": "timeout_ms (or Triton's timeout in µs), binary_data_output",
            },
            "inputs": {"type": "array", "items": _ref("Tensor")},
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
                },
            },
        },
    },
    "InferResponse": {
        "type": "object",
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "outputs": {"type": "array", "items": _ref("Tensor")},
        },
    },
    "ModelMetadata": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": _ref("Tensor")},
            "outputs": {"type": "array", "items": _ref("Tensor")},
        },
    },
    "GenerateRequest": {
        "type": "object",
        "required": ["text_input"],
        "properties": {
            "id": {"type": "string"},
            "text_input": {"type": "string"},
            "parameters": {"type": "object"},
            "max_tokens": {"type": "integer"},
            "temperature": {"type": "number"},
            "top_p": {"type": "number"},
            "top_k": {"type": "integer"},
            "seed": {"type": "integer"},
            "stop": {"type": "array", "items": {"type": "string"}},
        },
    },
    "GenerateResponse": {
        "type": "object",
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "text_output": {"type": "string"},
            "finish_reason": {"type": "string", "enum": ["stop", "length"]},
            "usage": {"type": "object"},
        },
    },
    "OpenAIRequest": {
        "type": "object",
        "required": ["model"],
        "description": "OpenAI's completions / chat completions request (its fields: docs/reference/openai.md)",
        "properties": {"model": {"type": "string"}, "stream": {"type": "boolean"}},
    },
    "OpenAIEmbeddingRequest": {
        "type": "object",
        "required": ["model", "input"],
        "description": "OpenAI's embeddings request (its fields: docs/reference/openai.md)",
        "properties": {"model": {"type": "string"}, "encoding_format": {"type": "string"}},
    },
}


def _version_params(versioned: bool) -> list[dict[str, Any]]:
    params = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    if versioned:
        params.append(
            {"name": "version", "in": "path", "required": True, "schema": {"type": "string"}}
        )
    return params


def _predictions(versioned: bool) -> dict[str, Any]:
    op = _op(
        "TorchServe's raw body route: the body (or multipart/form-data parts) goes to a "
        "python handler's preprocess_raw; the answer is of the type the handler chose",
        {},
        errors=_INFER_ERRORS,
        ok_type="*/*",
    )
    op["requestBody"] = {
        "required": True,
        "content": {"*/*": {"schema": {}}, "multipart/form-data": {"schema": {"type": "object"}}},
    }
    return {"post": op, "parameters": _version_params(versioned)}


def _shared_memory_paths() -> dict[str, Any]:
    """Triton's system and CUDA shared memory extensions (CUDA: register refused)."""
    region = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    status = {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "key": {"type": "string"},
                "offset": {"type": "integer"},
                "byte_size": {"type": "integer"},
            },
        },
    }
    register = {
        "type": "object",
        "required": ["key", "byte_size"],
        "properties": {
            "key": {"type": "string", "description": "a shared memory object: /name"},
            "offset": {"type": "integer", "minimum": 0},
            "byte_size": {"type": "integer", "minimum": 1},
        },
    }
    paths: dict[str, Any] = {}
    for base, what in (("/v2/systemsharedmemory", "system"), ("/v2/cudasharedmemory", "CUDA")):
        paths[base + "/status"] = {"get": _op(f"Every {what} shared memory region", status)}
        paths[base + "/region/{name}/status"] = {
            "get": _op(f"One {what} shared memory region", status, errors=(400,)),
            "parameters": [region],
        }
        paths[base + "/region/{name}/register"] = {
            "post": _op(
                f"Register a {what} shared memory region"
                + (" (refused: this server has no GPU)" if what == "CUDA" else ""),
                body=register if what == "system" else {"type": "object"},
                errors=(400,),
            ),
            "parameters": [region],
        }
        paths[base + "/unregister"] = {"post": _op(f"Unregister every {what} region")}
        paths[base + "/region/{name}/unregister"] = {
            "post": _op(f"Unregister a {what} shared memory region"),
            "parameters": [region],
        }
    return paths


def build_document() -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/v2/health/live": {"get": _op("Liveness")},
        "/v2/health/ready": {"get": _op("Readiness (503 when not ready)")},
        "/v2": {"get": _op("Server metadata")},
        "/v2/models": {"get": _op("Every model version served, with its state and platform")},
        "/v2/models/stats": {"get": _op("Statistics of every model")},
        "/v2/config/status": {"get": _op("The config in force and the last reload")},
        "/v2/repository/index": {"post": _op("Every model of the config, with its state")},
        "/v2/repository/models/{model}/load": {
            "post": _op(
                "Load a model as the config describes it, or with a config override "
                '(body {"parameters": {"config": "<JSON text>"}})',
                errors=(400, 404, 500),
            ),
            "parameters": _version_params(False),
        },
        "/v2/repository/models/{model}/unload": {
            "post": _op("Unload a model", errors=(400, 404)),
            "parameters": _version_params(False),
        },
        **_shared_memory_paths(),
        "/v1/models": {"get": _op("OpenAI: the decoder models and the models that embed")},
        "/v1/models/{model}": {
            "get": _op("OpenAI: one decoder or embedding model", errors=(404,)),
            "parameters": _version_params(False),
        },
        "/v1/completions": {
            "post": _op(
                "OpenAI completions (SSE when stream; NDJSON with Accept: application/x-ndjson)",
                body=_ref("OpenAIRequest"),
                errors=_INFER_ERRORS,
            ),
        },
        "/v1/chat/completions": {
            "post": _op(
                "OpenAI chat completions (SSE when stream; NDJSON with Accept: "
                "application/x-ndjson)",
                body=_ref("OpenAIRequest"),
                errors=_INFER_ERRORS,
            ),
        },
        "/v1/embeddings": {
            "post": _op(
                "OpenAI embeddings, of a model whose config has openai.embeddings",
                body=_ref("OpenAIEmbeddingRequest"),
                errors=_INFER_ERRORS,
            ),
        },
        "/predictions/{model}": _predictions(False),
        "/predictions/{model}/{version}": _predictions(True),
        "/metrics": {"get": _op("Prometheus metrics", ok={"type": "string"}, ok_type="text/plain")},
        "/openapi.json": {"get": _op("This document")},
        "/": {"get": _op("The live dashboard", {"type": "string"}, ok_type="text/html")},
        "/v2/dashboard/stats": {
            "get": _op("What the dashboard polls: counters and gauges per model, process, GPUs")
        },
    }
    for versioned in (False, True):
        base = "/v2/models/{model}" + ("/versions/{version}" if versioned else "")
        params = _version_params(versioned)
        paths[base] = {
            "get": _op("Model metadata", _ref("ModelMetadata"), errors=(404,)),
            "parameters": params,
        }
        paths[base + "/config"] = {
            "get": _op("Triton's model config (ModelConfig as JSON)", errors=(404,)),
            "parameters": params,
        }
        paths[base + "/ready"] = {
            "get": _op("Model readiness", errors=(404, 503)),
            "parameters": params,
        }
        paths[base + "/stats"] = {
            "get": _op("Model statistics", errors=(404,)),
            "parameters": params,
        }
        paths[base + "/infer"] = {
            "post": _op(
                "Inference (JSON, or the binary tensor extension with the "
                "Inference-Header-Content-Length header)",
                _ref("InferResponse"),
                _ref("InferRequest"),
                _INFER_ERRORS,
            ),
            "parameters": params,
        }
        paths[base + "/generate"] = {
            "post": _op(
                "Triton generate (decoder models)",
                _ref("GenerateResponse"),
                _ref("GenerateRequest"),
                _INFER_ERRORS,
            ),
            "parameters": params,
        }
        paths[base + "/generate_stream"] = {
            "post": _op(
                "Triton generate, as server-sent events (or, with Accept: "
                "application/x-ndjson, one JSON object per line)",
                {"type": "string"},
                _ref("GenerateRequest"),
                _INFER_ERRORS,
                "text/event-stream",
            ),
            "parameters": params,
        }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "aserve",
            "version": __version__,
            "description": "KServe V2 / Open Inference Protocol REST, Triton's extensions, "
            "and an OpenAI-compatible API.",
        },
        "paths": paths,
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
    }


def add_openapi_route(kit: RouteKit) -> None:
    body = orjson.dumps(build_document())

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=_JSON)

    kit.route("GET", "/openapi.json", openapi)
