"""Giving the memory of an unloaded model back to the operating system.

glibc's allocator keeps what a process frees in its arenas, for the process's
next allocations, and returns only the top of each heap by itself. A model's
weights and tokenizer are many allocations made at once (a tokenizer's
vocabulary is millions of small strings), so after they are freed most of
that memory stays with the server, counted in its RSS, though nothing uses
it. ``malloc_trim(0)`` returns every free page of every arena
(``bench/decoder_memory.py`` measures it).

glibc also raises its mmap threshold each time it frees a large block that
it had mapped (up to 32 MiB), so that after the first model is unloaded the
next one's weights come from the arenas, where models of other sizes loaded
and unloaded in turn leave free memory behind that not even ``malloc_trim``
gives back (measured with 24 models of 2 to 32 MiB evicted in turn: the RSS
grew to 2.5x what the loaded models held). :func:`map_large_blocks` fixes
the threshold: blocks from it up are mapped on their own and unmapped when
freed.
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
M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>


def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt  # type: ignore[no-any-return]


def map_large_blocks(threshold_bytes: int) -> bool:
    """Serve every allocation of ``threshold_bytes`` or more with a mapping of its
    own, returned to the system when freed (and glibc's threshold no longer
    moves); whether it could. For a process whose models come and go (a memory
    budget): their weights' memory leaves with them. Its cost: each such block
    is mapped afresh (a model's activations of that size too, at each batch)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes))


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
