"""The JSON config: frozen pydantic models, loading and error formatting.

A config is immutable once loaded. Unknown keys are errors. Every error names
its JSON path (``models[0].batching.max_batch_size: must be >= 1``) so that
the CLI can print it and exit with status 2, no traceback.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from aserve.codecs.datatypes import DATATYPES

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]  # fmt: skip
assert set(Datatype.__args__) == set(DATATYPES)  # type: ignore[attr-defined]

_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$"
_DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+)$")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HttpConfig(_Frozen):
    """Where the KServe V2 REST frontend listens."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000  # 0 picks a free port


class GrpcConfig(_Frozen):
    """Where the KServe V2 gRPC frontend listens (on the same loop as HTTP)."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8001  # 0 picks a free port


class LimitsConfig(_Frozen):
    """Server-wide limits; a request over one is refused at once.

    ``max_request_bytes`` bounds an HTTP body and a gRPC message (each message
    of a stream) alike.
    """

    max_request_bytes: Annotated[int, Field(ge=1)] = 64 * 1024 * 1024


class TensorSpec(_Frozen):
    """One input or output of a model. ``shape`` excludes the batch dimension."""

    name: Annotated[str, Field(pattern=_NAME)]
    datatype: Datatype
    shape: list[int]

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        for d in shape:
            if d != -1 and d < 1:
                raise ValueError(f"dimension {d} must be >= 1, or -1 for a variable size")
        return shape


class BatchingConfig(_Frozen):
    """Dynamic batching of one model.

    ``max_delay_ms`` bounds how long a request may wait for company; with an
    instance idle the batcher waits only when the measured latencies say a
    bigger batch pays and requests arrive fast enough to fill it.
    """

    max_batch_size: Annotated[int, Field(ge=1)] = 32
    max_delay_ms: Annotated[float, Field(ge=0)] = 2.0
    preferred_batch_sizes: list[int] = []
    max_queue_size: Annotated[int, Field(ge=1)] = 1024
    timeout_ms: Annotated[float, Field(gt=0)] = 5000.0

    @model_validator(mode="after")
    def _preferred_fit(self) -> BatchingConfig:
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= self.max_batch_size:
                raise ValueError(
                    f"preferred_batch_sizes: {size} must be between 1 and "
                    f"max_batch_size ({self.max_batch_size})"
                )
        return self


class ModelConfig(_Frozen):
    """One served model version."""

    name: Annotated[str, Field(pattern=_NAME)]
    version: Annotated[str, Field(pattern=r"^[0-9]+$")] = "1"
    engine: Literal["torch", "onnx", "tensorrt"]
    path: Annotated[str, Field(min_length=1)]
    device: str = "cpu"
    instances: Annotated[int, Field(ge=1, le=64)] = 1
    cpu_threads: Annotated[int, Field(ge=1, le=256)] = 1
    inputs: Annotated[list[TensorSpec], Field(validate_default=True)] = []
    outputs: Annotated[list[TensorSpec], Field(validate_default=True)] = []
    batching: BatchingConfig = BatchingConfig()
    precision: Literal["fp32", "fp16"] = "fp32"  # tensorrt only: of an engine built from .onnx
    cuda_graphs: bool = False  # torch on CUDA only: replay captured graphs per batch size

    @field_validator("inputs", "outputs")
    @classmethod
    def _tensors_for_engine(cls, specs: list[TensorSpec], info: ValidationInfo) -> list[TensorSpec]:
        engine = info.data.get("engine")
        # An onnx model's tensors may be left out: they are read from the model file.
        if engine is not None and engine != "onnx" and not specs:
            raise ValueError(f"required with engine '{engine}': list at least one tensor")
        return specs

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if not _DEVICE.match(device):
            raise ValueError(f"'{device}' is not a device: use cpu, cuda or cuda:N")
        return device

    @model_validator(mode="after")
    def _unique_tensor_names(self) -> ModelConfig:
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [s.name for s in specs]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{kind}: duplicate tensor name(s) {', '.join(dupes)}")
        _check_accelerator_fields(self)
        return self

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.version)


def _check_accelerator_fields(m: ModelConfig) -> None:
    """``precision`` and ``cuda_graphs`` only where they mean something; TensorRT on a GPU."""
    if m.precision != "fp32" and m.engine != "tensorrt":
        raise ValueError(f"precision: only for engine 'tensorrt' (this one is '{m.engine}')")
    if m.engine == "tensorrt":
        if m.device == "cpu":
            raise ValueError("device: the tensorrt engine runs on a GPU: use cuda or cuda:N")
        for spec in (*m.inputs, *m.outputs):
            if -1 in spec.shape:
                raise ValueError(
                    f"'{spec.name}' has shape {spec.shape}: the tensorrt engine needs fixed "
                    "dimensions besides the batch"
                )
    if m.cuda_graphs:
        if m.engine != "torch" or m.device == "cpu":
            raise ValueError(
                f"cuda_graphs: only for engine 'torch' on a CUDA device "
                f"(this model: engine '{m.engine}' on '{m.device}')"
            )
        variable = [s.name for s in m.inputs if -1 in s.shape]
        if variable:
            raise ValueError(
                f"cuda_graphs: needs fixed input shapes; {', '.join(variable)} has a variable "
                "dimension"
            )


class ServerConfig(_Frozen):
    """The whole server config (the JSON file)."""

    http: HttpConfig = HttpConfig()
    grpc: GrpcConfig | None = None  # absent: no gRPC frontend
    limits: LimitsConfig = LimitsConfig()
    drain_timeout_s: Annotated[float, Field(ge=0)] = 30.0
    models: list[ModelConfig] = []

    @model_validator(mode="after")
    def _unique_models(self) -> ServerConfig:
        seen: set[tuple[str, str]] = set()
        for m in self.models:
            if m.key in seen:
                raise ValueError(f"model '{m.name}' version '{m.version}' is configured twice")
            seen.add(m.key)
        return self


class ConfigError(Exception):
    """A config that cannot be used; the message names the JSON path."""


def load_config(path: str | Path) -> tuple[ServerConfig, Path]:
    """Read and validate a config file; returns it and the folder paths resolve against."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    return parse_config(data, source=str(path)), path.resolve().parent


def check_model_files(config: ServerConfig, base_dir: Path) -> None:
    """Every model's ``path`` must exist (relative paths resolve against ``base_dir``)."""
    from aserve import builtin_models
    from aserve.engines.requirements import engine_problem

    problems = []
    for i, m in enumerate(config.models):
        if m.path.startswith(builtin_models.PREFIX):
            name = m.path[len(builtin_models.PREFIX) :]
            if name not in builtin_models.BUILDERS:
                known = ", ".join(sorted(builtin_models.BUILDERS))
                problems.append(
                    f"models[{i}].path: unknown builtin model '{name}' (known: {known})"
                )
        elif not (base_dir / m.path).is_file():
            problems.append(f"models[{i}].path: file not found: {base_dir / m.path}")
        problem = engine_problem(m.engine, m.device)
        if problem:
            problems.append(f"models[{i}].engine: {problem}")
    if problems:
        raise ConfigError("invalid config\n  " + "\n  ".join(problems))


def parse_config(data: Any, source: str = "config") -> ServerConfig:
    """Validate decoded JSON into a :class:`ServerConfig`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{_json_path(e['loc'])}: {_message(e)}" for e in exc.errors()]
        raise ConfigError(f"{source}: invalid config\n  " + "\n  ".join(lines)) from None


def _json_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _message(err: Any) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']} (got {err['input']!r})"
    if kind == "greater_than":
        return f"must be > {ctx['gt']} (got {err['input']!r})"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']} (got {err['input']!r})"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind == "string_pattern_mismatch":
        return f"{err['input']!r} is not a valid name (letters, digits, '_', '.', '-')"
    msg: str = err["msg"]
    return msg.removeprefix("Value error, ")
