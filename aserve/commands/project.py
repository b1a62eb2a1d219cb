"""``aserve new NAME`` and ``aserve archive DIR``: a handler project, scaffolded and packed.

The work is done by :mod:`aserve.commands.scaffold` and :mod:`aserve.commands.archive_pack`;
this module only adds their parsers.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parsers(sub: Any) -> None:
    new = sub.add_parser("new", help="scaffold a handler project in ./NAME")
    new.add_argument("name", metavar="NAME", help="the project's folder and its model's name")
    new.set_defaults(run=_run_new)
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
    pack.set_defaults(run=_run_archive)


def _run_new(args: argparse.Namespace) -> int:
    from aserve.commands import scaffold

    return scaffold.run_new(args.name)


def _run_archive(args: argparse.Namespace) -> int:
    from aserve.commands import archive_pack

    return archive_pack.run_archive(args.project, args.output, args.project_config, args.skip_tests)
