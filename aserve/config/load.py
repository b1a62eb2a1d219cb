"""Reading a config: the file, its archives, the schema, the pipeline checks, and
errors that name the JSON path.

Layer ``config``: imports nothing above it. Every error names its JSON path
(``models[0].batching.max_batch_size: must be >= 1``) so that the CLI can
print it and exit with status 2, no traceback. Blocking (reads files,
extracts archives): called before the server starts, or in a reload's thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from aserve.config import archive
from aserve.config.pipelines import check_pipelines
from aserve.config.schema import ArchivesConfig, ServerConfig


class ConfigError(Exception):
    """A config that cannot be used; the message names the JSON path."""


def load_config(path: str | Path) -> tuple[ServerConfig, Path]:
    """Read and validate a config file; returns it and the folder paths resolve against."""
    config, base_dir, _ = read_config(path)
    return config, base_dir


def read_config(path: str | Path) -> tuple[ServerConfig, Path, bytes]:
    """:func:`load_config`, plus the file's bytes (a reload compares them)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    # The folder of the path as given, symlinks kept: a Kubernetes ConfigMap's file is a
    # symlink into a timestamped folder that the next update deletes.
    base_dir = path.absolute().parent
    return parse_config(data, source=str(path), base_dir=base_dir), base_dir, raw


def parse_config(data: Any, source: str = "config", base_dir: Path | None = None) -> ServerConfig:
    """Validate decoded JSON into a :class:`ServerConfig`. With ``base_dir`` (the
    config's folder), model entries whose ``path`` is an ``.aserve`` archive are
    verified, extracted and replaced by the archive's model (blocking)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object")
    if base_dir is not None:
        data = _expand_archives(data, base_dir, source)
    try:
        config = ServerConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{_json_path(e['loc'])}: {_message(e)}" for e in exc.errors()]
        raise ConfigError(f"{source}: invalid config\n  " + "\n  ".join(lines)) from None
    lines = check_pipelines(config)
    if lines:
        raise ConfigError(f"{source}: invalid config\n  " + "\n  ".join(lines))
    return config


def _expand_archives(data: dict[str, Any], base_dir: Path, source: str) -> dict[str, Any]:
    models = data.get("models")
    if not isinstance(models, list):
        return data
    limits = None
    expanded = []
    for i, m in enumerate(models):
        if isinstance(m, dict) and str(m.get("path", "")).endswith(archive.SUFFIX):
            # The limits the archives are checked against come first, checked on their own.
            limits = limits or _archive_limits(data.get("archives", {}), source)
            try:
                m = archive.expand_entry(m, base_dir, limits)
            except archive.ArchiveError as exc:
                raise ConfigError(f"{source}: invalid config\n  models[{i}].path: {exc}") from None
        expanded.append(m)
    return {**data, "models": expanded}


def _archive_limits(block: Any, source: str) -> archive.Limits:
    try:
        config = ArchivesConfig.model_validate(block)
    except ValidationError as exc:
        where = [
            f"archives.{_json_path(e['loc'])}" if e["loc"] else "archives" for e in exc.errors()
        ]
        lines = [f"{w}: {_message(e)}" for w, e in zip(where, exc.errors(), strict=True)]
        raise ConfigError(f"{source}: invalid config\n  " + "\n  ".join(lines)) from None
    try:
        return archive.limits_of(config)
    except archive.ArchiveError as exc:  # the environment's default
        raise ConfigError(f"{source}: {exc}") from None


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
    if kind == "string_pattern_mismatch" and err["loc"][-1] == "handler":
        return f"{err['input']!r} is not 'package.module:ClassName'"
    if kind == "string_pattern_mismatch":
        return f"{err['input']!r} is not a valid name (letters, digits, '_', '.', '-')"
    msg: str = err["msg"]
    return msg.removeprefix("Value error, ")
