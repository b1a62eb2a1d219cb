"""``aserve`` / ``python -m aserve``: serve the models of a JSON config."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from aserve import __version__, archive_pack, scaffold

# Package data, so that an installed wheel has it (configs/default.json links to it).
DEFAULT_CONFIG = Path(__file__).resolve().parent / "default_config.json"

log = logging.getLogger("aserve")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aserve", description="Serve deep-learning models over HTTP and gRPC."
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="JSON config file (default: the embedded one, the builtin affine model)",
    )
    p.add_argument("--port", type=int, default=None, help="override http.port from the config")
    p.add_argument("--host", default=None, help="override http.host from the config")
    p.add_argument(
        "--watch-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often to check --config for changes (default 1; 0: only on SIGHUP)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument(
        "--log-format",
        default=None,
        choices=["text", "json"],
        help="text or JSON lines (default: the config's logging.format, else text)",
    )
    p.add_argument("--version", action="version", version=f"aserve {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    new = sub.add_parser("new", help="scaffold a handler project in ./NAME")
    new.add_argument("name", metavar="NAME", help="the project's folder and its model's name")
    pack = sub.add_parser("archive", help="test a project with pytest, then pack it (.aserve)")
    pack.add_argument("project", type=Path, metavar="DIR", help="the project's folder")
    pack.add_argument("-o", "--output", type=Path, default=None, help="default: ./DIR.aserve")
    pack.add_argument(
        "--config",
        dest="project_config",
        metavar="FILE",
        default="config.json",
        help="the project's config (default: config.json)",
    )
    pack.add_argument("--skip-tests", action="store_true", help="pack without running pytest")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "new":
        return scaffold.run_new(args.name)
    if args.command == "archive":
        return archive_pack.run_archive(
            args.project, args.output, args.project_config, args.skip_tests
        )
    from aserve import logs

    logs.configure(args.log_level, args.log_format or "text")
    # Imported late so that --help and config errors answer without loading torch.
    from aserve.config import ConfigError, check_model_files, read_config

    path = args.config or DEFAULT_CONFIG
    try:
        config, base_dir, raw = read_config(path)
        check_model_files(config, base_dir)
    except ConfigError as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        return 2
    file_config = config
    if args.log_format is None and config.logging.format != "text":
        logs.configure(args.log_level, config.logging.format)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        config = config.model_copy(update={"http": config.http.model_copy(update=overrides)})

    from aserve.loop.reload import ConfigSource
    from aserve.loop.runtime import Server, StartupError

    # Only a config the user named is watched; SIGHUP re-reads either.
    watch_s = args.watch_interval if args.config is not None else 0.0
    source = ConfigSource(Path(path), raw, file_config, watch_s)

    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    log.info("aserve %s starting with %s", __version__, path)
    try:
        runner(Server(config, base_dir, source).run())
    except StartupError as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
