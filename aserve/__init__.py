"""aserve: an asyncio-native inference server for deep-learning models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from aserve.library import Batched

__all__ = ["Batched"]


def __getattr__(name: str) -> Any:
    # Lazy: ``import aserve`` (the CLI, a client) stays as light as it was; the
    # batcher, numpy and pydantic load with the first ``aserve.Batched``.
    if name == "Batched":
        from aserve.library import Batched

        return Batched
    raise AttributeError(f"module 'aserve' has no attribute {name!r}")
