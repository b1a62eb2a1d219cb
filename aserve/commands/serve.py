"""``aserve serve FILE [flags]``: serve one model file with no config file.

FILE is a TorchScript ``.pt``, a ``torch.export`` ``.pt2``, an ``.onnx``, a
TensorRT ``.plan``/``.engine``, a decoder model folder (``config.json``
inside), a handler class ``module:Class`` (imported from the current
folder), or an ``.aserve`` archive. The flags build the same JSON config a
user would write (``--print-config`` shows it), which is validated by the
config's own models: an error names the flag that set the bad value and
exits with status 2, as a bad config file does.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

TORCH_SUFFIXES = (".pt", ".pth", ".ts")
TENSORRT_SUFFIXES = (".plan", ".engine")
# Formats whose files say what their inputs and outputs are.
SELF_DESCRIBING = ("onnx", "tensorrt", "export")
_SPEC_EXAMPLE = "e.g. INPUT0:FP32:16, or IMAGE:UINT8:3,-1,-1 (no batch dimension; -1 is variable)"

# The flag that sets each config key, by JSON path (models[i] as models[0]).
FLAGS: dict[tuple[Any, ...], str] = {
    ("http", "host"): "--host",
    ("grpc", "host"): "--host",
    ("http", "port"): "--port",
    ("grpc", "port"): "--grpc-port",
    ("limits", "max_connections"): "--max-connections",
    ("limits", "max_concurrency"): "--max-concurrency",
    ("gpu", "mem_limit_mib"): "--gpu-mem-limit-mib",
    ("gpu", "empty_cache_interval_s"): "--empty-cache-interval-s",
    ("auth",): "--api-key-file",
    ("auth", "admin_keys_file"): "--admin-key-file",
    ("models", 0, "name"): "--name",
    ("models", 0, "device"): "--device",
    ("models", 0, "instances"): "--instances",
    ("models", 0, "executor"): "--executor",
    ("models", 0, "cpu_threads"): "--cpu-threads",
    ("models", 0, "inputs"): "--input",
    ("models", 0, "outputs"): "--output",
    ("models", 0, "batching", "max_batch_size"): "--max-batch-size",
    ("models", 0, "batching", "max_delay_ms"): "--max-delay-ms",
    ("models", 0, "batching", "preferred_batch_sizes"): "--preferred-batch-sizes",
    ("models", 0, "batching", "max_queue_size"): "--max-queue-size",
    ("models", 0, "batching", "timeout_ms"): "--timeout-ms",
    ("models", 0, "generation", "max_num_seqs"): "--max-batch-size",
    ("models", 0, "generation", "max_queue_size"): "--max-queue-size",
    ("models", 0, "generation", "timeout_ms"): "--timeout-ms",
    ("models", 0, "generation", "max_model_len"): "--max-model-len",
}


class UsageError(Exception):
    """A command line that cannot be served; the message names the flag."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve one model file, no config needed",
        description="Serve one model file with no config file. Tensors are read from .pt2, "
        ".onnx and .plan files and given with --input/--output otherwise; a flag left out "
        "keeps the config's default. --print-config shows the config the flags make.",
    )
    p.add_argument(
        "file", metavar="FILE",
        help="a .pt, .pt2, .onnx, .plan/.engine file, a decoder model folder, a handler "
        "module:Class, or an .aserve archive",
    )  # fmt: skip
    io = p.add_argument_group("tensors (read from .pt2, .onnx, .plan files; required otherwise)")
    io.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME:DTYPE:SHAPE",
        help=f"a model input, repeated in forward's order ({_SPEC_EXAMPLE})",
    )
    io.add_argument(
        "--output",
        action="append",
        default=[],
        metavar="NAME:DTYPE:SHAPE",
        help="a model output, repeated in the order the model returns them",
    )
    net = p.add_argument_group("listeners")
    net.add_argument("--host", help="HTTP and gRPC host (default 127.0.0.1)")
    net.add_argument("--port", type=int, help="HTTP port (default 8000; 0 picks a free one)")
    grpc = net.add_mutually_exclusive_group()
    grpc.add_argument("--grpc-port", type=int, help="gRPC port (default 8001; 0 picks a free one)")
    grpc.add_argument("--no-grpc", action="store_true", help="no gRPC frontend")
    m = p.add_argument_group("model")
    m.add_argument("--name", help="the model's name (default: from FILE)")
    m.add_argument("--device", help="cpu, cuda or cuda:N (default cpu; cuda for .plan)")
    m.add_argument("--instances", type=int, help="executor instances (default 1)")
    m.add_argument("--executor", choices=["thread", "process"], help="where instances run")
    m.add_argument("--cpu-threads", type=int, help="intra-op threads per instance (default 1)")
    b = p.add_argument_group("batching and limits")
    b.add_argument("--max-batch-size", type=int, help="largest batch (decoder: sequences at once)")
    b.add_argument("--max-delay-ms", type=float, help="longest wait for company")
    b.add_argument("--preferred-batch-sizes", metavar="N,N,...", help="e.g. 8,16")
    b.add_argument("--max-queue-size", type=int, help="requests waiting, past it refused")
    b.add_argument("--timeout-ms", type=float, help="default request deadline")
    b.add_argument("--max-model-len", type=int, help="decoder: longest sequence, in tokens")
    b.add_argument("--max-connections", type=int, help="HTTP connections / gRPC calls at once")
    b.add_argument("--max-concurrency", type=int, help="inference requests served at once")
    a = p.add_argument_group("archives (an .aserve FILE)")
    a.add_argument(
        "--max-archive-bytes", type=int, metavar="N",
        help="most bytes the archive may extract (default 4 GiB, or $ASERVE_ARCHIVE_MAX_BYTES)",
    )  # fmt: skip
    a.add_argument(
        "--max-archive-ratio", type=float, metavar="R",
        help="most times a member may expand its compressed size (default 100)",
    )  # fmt: skip
    g = p.add_argument_group("GPU memory and auth")
    g.add_argument("--gpu-mem-limit-mib", type=int, help="most memory torch holds per device")
    g.add_argument(
        "--empty-cache-interval-s", type=float, help="release cached GPU memory so often"
    )
    g.add_argument(
        "--api-key-file",
        type=Path,
        metavar="FILE",
        help="API keys, one a line: requests need 'Authorization: Bearer KEY'",
    )
    g.add_argument(
        "--admin-key-file",
        type=Path,
        metavar="FILE",
        help="admin API keys, one a line: the repository API and /v2/config need one",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the equivalent JSON config (for aserve --config) and exit; an archive "
        "is checked and its config read, not extracted",
    )
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the least severe log lines written (default INFO)",
    )  # fmt: skip
    p.add_argument(
        "--log-format", default="text", choices=["text", "json"],
        help="text or JSON lines (default text)",
    )  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aserve.obs import logs

    logs.configure(args.log_level, args.log_format)
    try:
        plan = build(args)
        # An archive's files are extracted only to serve it: --print-config checks the config.
        config = validate(plan, check_files=not (args.print_config and plan.target is None))
        if args.print_config:
            print(orjson.dumps(plan.data, option=orjson.OPT_INDENT_2).decode())
            return 0
    except UsageError as exc:
        print(f"aserve serve: error: {exc}", file=sys.stderr)
        return 2
    from aserve.commands.run import run_server

    return run_server(config, plan.base_dir, None, args.file)


@dataclass
class Plan:
    """The config a command line stands for, and what its error messages need."""

    data: dict[str, Any]
    base_dir: Path
    specs: dict[str, list[str]] = field(default_factory=dict)  # --input/--output as given
    target: str | None = None  # FILE, when it is one model (not an archive)


def build(args: argparse.Namespace) -> Plan:
    """The config dict for ``args`` (tensors read from the file where it has them)."""
    target = args.file
    base_dir = Path.cwd()
    if target.endswith(".aserve"):
        data, base_dir = _archive(Path(target), _archive_limits(args), not args.print_config)
        model_keys = _model_keys(args, "archive")
        for model in data.get("models", []):
            _merge(model, model_keys)
    else:
        for flag, value in (("--max-archive-bytes", args.max_archive_bytes),
                            ("--max-archive-ratio", args.max_archive_ratio)):  # fmt: skip
            if value is not None:
                raise UsageError(f"{flag}: only for an .aserve archive (FILE is {target})")
        engine, model = _model_of(target)
        _merge(model, _model_keys(args, engine))
        if model["engine"] == "tensorrt":
            model.setdefault("device", "cuda")
        if engine == "decoder":
            _fit_context(model, args.max_model_len)
        if engine in SELF_DESCRIBING and not (args.input and args.output):
            _read_tensors(model, engine, target)
        data = {"models": [model]}
    server: dict[str, Any] = {k: v for k, v in data.items() if k != "models"}
    _server_keys(args, server)
    data = {**server, "models": data.get("models", [])}
    specs = {"inputs": args.input, "outputs": args.output}
    return Plan(data, base_dir, specs, None if target.endswith(".aserve") else target)


def validate(plan: Plan, check_files: bool = True) -> Any:
    """The :class:`ServerConfig` of ``plan``, its files checked (unless not
    ``check_files``); errors name the flags."""
    from pydantic import ValidationError

    from aserve.config import ConfigError, ServerConfig
    from aserve.config.load import _message
    from aserve.config.pipelines import check_pipelines
    from aserve.engines.checks import check_model_files

    try:
        config = ServerConfig.model_validate(plan.data)
    except ValidationError as exc:
        lines = [": ".join(_where(e["loc"], _message(e), plan)) for e in exc.errors()]
        raise UsageError("\n  ".join(lines)) from None
    problems = check_pipelines(config)
    if problems:
        raise UsageError("\n  ".join(problems))
    if not check_files:
        return config
    try:
        check_model_files(config, plan.base_dir)
    except ConfigError as exc:
        text = str(exc).removeprefix("invalid config\n  ")
        if plan.target is not None:  # one model, from FILE: its path and handler are FILE
            text = re.sub(r"models\[0\]\.(path|handler|engine):", f"{plan.target}:", text)
        raise UsageError(text) from None
    return config


def _where(loc: tuple[Any, ...], message: str, plan: Plan) -> tuple[str, str]:
    """``(where, message)``: the flag behind the error at ``loc`` (with the value given),
    else its JSON path."""
    from aserve.config.load import _json_path

    key = tuple(0 if i == 1 and loc and loc[0] == "models" else p for i, p in enumerate(loc))
    # A check across keys (of a model, of its batching) starts its message with the key.
    word, _, rest = message.partition(": ")
    if rest and (*key, word) in FLAGS:
        key, message = (*key, word), rest
    best = max((k for k in FLAGS if key[: len(k)] == k), key=len, default=None)
    if best is not None:
        flag = FLAGS[best]
        kind = best[-1] if best[-1] in ("inputs", "outputs") else None
        if kind is not None and len(key) > len(best) and isinstance(key[len(best)], int):
            given = plan.specs.get(kind, [])
            index = key[len(best)]
            if index < len(given):
                return f"{flag} {given[index]}", message
        return flag, message
    under = sorted(
        {f for k, f in FLAGS.items() if len(key) > 2 and k[: len(key)] == key and _given(plan, k)}
    )
    if under:
        return "/".join(under), message
    return _json_path(loc), message


def _given(plan: Plan, key: tuple[Any, ...]) -> bool:
    node: Any = plan.data
    for part in key:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False
    return True


def _model_of(target: str) -> tuple[str, dict[str, Any]]:
    """``(format, model entry)`` for FILE; format is an engine name or "export" (.pt2)."""
    from aserve.config.schema import _HANDLER

    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(
                f"{target}: a folder to serve is a decoder model (no config.json in it)"
            )
        return "decoder", {
            "name": _name(path.name),
            "engine": "decoder",
            "path": str(path.absolute()),
        }
    if not path.exists() and re.match(_HANDLER, target):
        module = target.partition(":")[0]
        return "python", {
            "name": _name(module.rsplit(".", 1)[-1]),
            "engine": "python",
            "handler": target,
        }
    if not path.is_file():
        raise UsageError(f"{target}: no such file (nor a handler 'module:Class')")
    suffix = path.suffix.lower()
    entry = {"name": _name(path.stem), "path": str(path.absolute())}
    if suffix in TORCH_SUFFIXES:
        return "torch", {**entry, "engine": "torch"}
    if suffix == ".pt2":
        return "export", {**entry, "engine": "torch"}
    if suffix == ".onnx":
        return "onnx", {**entry, "engine": "onnx"}
    if suffix in TENSORRT_SUFFIXES:
        return "tensorrt", {**entry, "engine": "tensorrt"}
    known = ", ".join((*TORCH_SUFFIXES, ".pt2", ".onnx", *TENSORRT_SUFFIXES, ".aserve"))
    raise UsageError(f"{target}: unknown kind of model file '{suffix}' (known: {known})")


def _name(stem: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.\-]", "_", stem)
    return name if re.match(r"^[A-Za-z0-9_]", name) else f"m{name}"


def _model_keys(args: argparse.Namespace, engine: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("name", "device", "instances", "executor", "cpu_threads"):
        value = getattr(args, key)
        if value is not None and not (key == "name" and engine == "archive"):
            out[key] = value
    if args.input:
        out["inputs"] = [_spec("--input", s) for s in args.input]
    if args.output:
        out["outputs"] = [_spec("--output", s) for s in args.output]
    batching: dict[str, Any] = {}
    generation: dict[str, Any] = {}
    # A decoder schedules in "generation": the flags that mean the same there go there.
    decoder = engine == "decoder"
    for flag_key, value in (
        ("max_batch_size", args.max_batch_size),
        ("max_delay_ms", args.max_delay_ms),
        ("max_queue_size", args.max_queue_size),
        ("timeout_ms", args.timeout_ms),
    ):
        if value is None:
            continue
        if decoder and flag_key != "max_delay_ms":
            generation["max_num_seqs" if flag_key == "max_batch_size" else flag_key] = value
        else:
            batching[flag_key] = value
    if args.preferred_batch_sizes is not None:
        batching["preferred_batch_sizes"] = _sizes(args.preferred_batch_sizes)
    if batching:
        out["batching"] = batching
    if args.max_model_len is not None and not decoder:
        generation["max_model_len"] = args.max_model_len  # refused below, naming the flag
    if generation:
        out["generation"] = generation
    return out


def _server_keys(args: argparse.Namespace, data: dict[str, Any]) -> None:
    http = data.setdefault("http", {})
    if args.host is not None:
        http["host"] = args.host
    if args.port is not None:
        http["port"] = args.port
    if not http:
        del data["http"]
    if args.no_grpc:
        data.pop("grpc", None)
    elif args.grpc_port is not None or "grpc" not in data:
        grpc = data.setdefault("grpc", {})
        grpc["port"] = args.grpc_port if args.grpc_port is not None else grpc.get("port", 8001)
        if args.host is not None:
            grpc["host"] = args.host
    limits = {
        k: v
        for k, v in (
            ("max_connections", args.max_connections),
            ("max_concurrency", args.max_concurrency),
        )
        if v is not None
    }
    if limits:
        data["limits"] = {**data.get("limits", {}), **limits}
    gpu = {
        k: v
        for k, v in (
            ("mem_limit_mib", args.gpu_mem_limit_mib),
            ("empty_cache_interval_s", args.empty_cache_interval_s),
        )
        if v is not None
    }
    if gpu:
        data["gpu"] = {**data.get("gpu", {}), **gpu}
    for flag, path, key in (
        ("--api-key-file", args.api_key_file, "api_keys_file"),
        ("--admin-key-file", args.admin_key_file, "admin_keys_file"),
    ):
        if path is None:
            continue
        if not path.is_file():
            raise UsageError(f"{flag} {path}: no such file")
        data["auth"] = {**data.get("auth", {}), key: str(path.absolute())}


def _spec(flag: str, text: str) -> dict[str, Any]:
    parts = text.split(":")
    if len(parts) != 3 or not parts[0]:
        raise UsageError(f"{flag} {text}: expected NAME:DTYPE:SHAPE ({_SPEC_EXAMPLE})")
    name, dtype, shape = parts
    try:
        dims = [int(d) for d in shape.split(",")] if shape.strip() else []
    except ValueError:
        raise UsageError(
            f"{flag} {text}: the shape '{shape}' is not comma-separated integers ({_SPEC_EXAMPLE})"
        ) from None
    return {"name": name, "datatype": dtype.upper(), "shape": dims}


def _sizes(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise UsageError(
            f"--preferred-batch-sizes {text}: expected comma-separated integers, e.g. 8,16"
        ) from None


def _merge(model: dict[str, Any], keys: dict[str, Any]) -> None:
    for key, value in keys.items():
        if isinstance(value, dict) and isinstance(model.get(key), dict):
            model[key] = {**model[key], **value}
        else:
            model[key] = value


def _read_tensors(model: dict[str, Any], fmt: str, target: str) -> None:
    """Fill the model's missing inputs/outputs from its file (the engines' own reading)."""
    from aserve.commands.model_io import read_io
    from aserve.engines.requirements import engine_problem

    device = model.get("device", "cpu")
    problem = engine_problem(model["engine"], device)
    if problem:
        raise UsageError(f"{target}: {problem}")
    max_batch = model.get("batching", {}).get("max_batch_size", 32)
    if not isinstance(max_batch, int) or max_batch < 1:
        return  # the config's validation names --max-batch-size
    try:
        inputs, outputs = read_io(Path(target), fmt, max_batch, device)
    except ValueError as exc:
        raise UsageError(f"{target}: {exc}") from None
    except RuntimeError as exc:  # TensorRT or CUDA could not start
        raise UsageError(f"{target}: {exc}") from None
    model.setdefault("inputs", [s.model_dump() for s in inputs])
    model.setdefault("outputs", [s.model_dump() for s in outputs])


def _fit_context(model: dict[str, Any], max_model_len: int | None) -> None:
    """A decoder's ``max_model_len``: the flag, else the default capped at the model's
    context length (a small model would refuse the default of 2048).

    The folder is checked as far as it can be without building anything (its
    sizes against the default ``generation.checkpoint_limits``, the weights'
    headers against them, the sizes of its files), so that ``--print-config``
    refuses a folder the server would refuse, at the cost of reading headers."""
    from aserve.config import GenerationConfig
    from aserve.engines.decoder.checkpoint import check_folder
    from aserve.engines.decoder.spec import CheckpointError

    generation = model.setdefault("generation", {})
    try:
        positions = check_folder(Path(model["path"])).max_positions
    except CheckpointError as exc:
        raise UsageError(f"{model['path']}: {exc}") from None
    if max_model_len is not None:
        if max_model_len > positions:
            raise UsageError(
                f"--max-model-len {max_model_len}: exceeds the model's context length "
                f"({positions} positions)"
            )
        generation["max_model_len"] = max_model_len
    elif positions < GenerationConfig().max_model_len:
        generation["max_model_len"] = positions
    if not generation:
        del model["generation"]


def _archive_limits(args: argparse.Namespace) -> Any:
    """The archive's :class:`aserve.config.archive.Limits`, from the flags."""
    from aserve.config.archive import DEFAULT_MAX_RATIO, ArchiveError, Limits, limits_of

    try:
        default = limits_of()
    except ArchiveError as exc:  # $ASERVE_ARCHIVE_MAX_BYTES
        raise UsageError(str(exc)) from None
    max_bytes, ratio = args.max_archive_bytes, args.max_archive_ratio
    if max_bytes is not None and max_bytes < 1:
        raise UsageError(f"--max-archive-bytes: must be >= 1 (got {max_bytes})")
    if ratio is not None and not 1 <= ratio < float("inf"):
        raise UsageError(f"--max-archive-ratio: must be a number >= 1 (got {ratio})")
    return Limits(
        default.max_bytes if max_bytes is None else max_bytes,
        DEFAULT_MAX_RATIO if ratio is None else ratio,
    )


def _archive(path: Path, limits: Any, extract: bool) -> tuple[dict[str, Any], Path]:
    """The archive's config: verified and extracted to serve it, or only verified."""
    from aserve.config.archive import ArchiveError, peek_config, serve_config

    try:
        read = serve_config if extract else peek_config
        return read(path, limits), path.absolute().parent
    except ArchiveError as exc:
        raise UsageError(str(exc)) from None
