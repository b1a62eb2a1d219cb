"""What a model ``path`` may name besides a file beside the config: a builtin model
(``builtin:NAME``), built into the cache folder, where archives are extracted too.

Layer ``config``: pure names and one environment lookup; the builders
themselves are :mod:`aserve.engines.builtin`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "builtin:"


def cache_dir() -> Path:
    """Where aserve keeps what it builds or extracts: ``$ASERVE_CACHE_DIR``, else
    ``~/.cache/aserve``."""
    root = os.environ.get("ASERVE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "aserve"
