"""``aserve`` / ``python -m aserve``: serve the models of a JSON config, or run a subcommand.

Each subcommand lives in its own module under :mod:`aserve.commands`, which
adds its parser and the function that runs it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from aserve import __version__
from aserve.commands import project, ps, serve

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
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the least severe log lines written (default INFO)",
    )  # fmt: skip
    p.add_argument(
        "--log-format",
        default=None,
        choices=["text", "json"],
        help="text or JSON lines (default: the config's logging.format, else text)",
    )
    p.add_argument("--version", action="version", version=f"aserve {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands (none: --config)")
    serve.add_parser(sub)
    ps.add_parser(sub)
    project.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command is not None:
        return int(args.run(args))
    from aserve.obs import logs

    logs.configure(args.log_level, args.log_format or "text")
    # Imported late so that --help and config errors answer without loading torch.
    from aserve.config import ConfigError, read_config
    from aserve.engines.checks import check_model_files

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

    from aserve.commands.run import run_server
    from aserve.loop.reload import ConfigSource

    # Only a config the user named is watched; SIGHUP re-reads either.
    watch_s = args.watch_interval if args.config is not None else 0.0
    source = ConfigSource(Path(path), raw, file_config, watch_s)
    return run_server(config, base_dir, source, path)
