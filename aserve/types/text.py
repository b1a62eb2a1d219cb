"""Text that always encodes as UTF-8, for strings from outside the server's own code.

aiohttp decodes header bytes that are not UTF-8 with ``surrogateescape``,
and a handler's own strings may hold lone surrogates too (``"\\udcff"``).
Such a string fails at the first ``str.encode`` on its way out: in a JSON
answer, in the Prometheus exposition, in msgpack to a worker process. The
places where such strings enter (a multipart part's headers, a handler's
metric labels) pass them through :func:`utf8_safe` first.
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8_safe(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD; ``text`` itself when it has none."""
    if text.isascii():  # C speed, and the common case
        return text
    return _SURROGATE.sub(REPLACEMENT, text)


def first_surrogate(text: str) -> int | None:
    """Where ``text``'s first lone surrogate is (what keeps it from being UTF-8), or None."""
    if text.isascii():
        return None
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def header_bytes(text: str) -> bytes:
    """A header value's bytes as they were sent, from aiohttp's ``surrogateescape`` text."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no byte makes: not from a header's bytes
        return utf8_safe(text).encode()
