"""Giving the memory of an unloaded model back to the operating system.

glibc's allocator keeps what a process frees in its arenas, for the process's
next allocations, and returns only the top of each heap by itself. A model's
weights and tokenizer are many allocations made at once (a tokenizer's
vocabulary is millions of small strings), so after they are freed most of
that memory stays with the server, counted in its RSS, though nothing uses
it. ``malloc_trim(0)`` returns every free page of every arena
(``bench/decoder_memory.py`` measures it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger("aserve.engines")


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim  # glibc only: musl and macOS have none
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_TRIM = _malloc_trim()


def release_freed_memory() -> bool:
    """Return the allocator's free pages to the system; whether it could.

    Call after a model's references are dropped, off the event loop: it walks
    every arena (milliseconds after a large model). A ``ctypes`` call gives up
    the GIL meanwhile.
    """
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
