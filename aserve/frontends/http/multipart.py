"""A whole ``multipart/form-data`` body, held in memory, split into its parts (on a thread).

``/predictions`` reads the body first (bounded by ``max_request_bytes`` and
``max_inflight_bytes``) and splits it here. The framing of RFC 2046 is found
with ``bytes.find``: each part's data is one slice of the body, so a part
costs one copy at C speed and no Python step per chunk of it. (aiohttp's
streaming reader, used before, copied the body three times over, 16 KiB
pieces, the chunks it read and their join, and spent half a second of
Python per 64 MiB holding the GIL, which stalled the event loop while a few
big bodies were parsed at once.) A part's header lines are parsed by
aiohttp's own header parser, with the bounds checked first.

Every bound is checked before the part it concerns is copied: at most
:data:`MAX_PARTS` parts (the 129th is refused before its headers are read), each with
at most :data:`MAX_PART_HEADERS` header lines of :data:`MAX_HEADER_LINE_BYTES`,
at most :data:`MAX_PREAMBLE_BYTES` before the first boundary. Errors are
:class:`~aserve.errors.InvalidArgument` (400) naming what is wrong, or
:class:`~aserve.errors.TooLarge` (413) past :data:`MAX_PARTS`.

Header text that is not UTF-8 (aiohttp decodes it with ``surrogateescape``)
reaches the handler with U+FFFD in its place; the filename's bytes as sent
are kept too (:class:`~aserve.engines.python_handler.Part`).
"""

from __future__ import annotations

from aiohttp import hdrs
from aiohttp.helpers import parse_mimetype
from aiohttp.http import HeadersParser
from aiohttp.multipart import content_disposition_filename, parse_content_disposition

from aserve.engines.python_handler import Part
from aserve.errors import InvalidArgument, TooLarge
from aserve.frontends.http.bodies import SpooledBody
from aserve.types.text import header_bytes, utf8_safe

MAX_PARTS = 128  # parts of one multipart/form-data body
MAX_PREAMBLE_BYTES = 1024  # before the first boundary (RFC 2046 allows some; nobody sends it)
MAX_PART_HEADERS = 16  # clients send two or three (Content-Disposition, -Type)
MAX_HEADER_LINE_BYTES = 8190
_MAX_BOUNDARY_CHARS = 70  # RFC 2046
_CRLF = b"\r\n"
_FIND_WINDOW_BYTES = 1 << 20
_MAX_PADDING_BYTES = 1024  # whitespace a boundary line may have after its boundary
# The longest header block the bounds allow: that many lines of the longest length.
_MAX_HEADER_BLOCK_BYTES = MAX_PART_HEADERS * (MAX_HEADER_LINE_BYTES + 2) + 2


def boundary_of(content_type: str) -> bytes:
    """The delimiter's boundary from a ``multipart/form-data`` Content-Type."""
    boundary = parse_mimetype(content_type).parameters.get("boundary", "").strip('"')
    if not boundary:
        raise InvalidArgument("multipart body cannot be read: its Content-Type has no boundary")
    if len(boundary) > _MAX_BOUNDARY_CHARS or not boundary.isascii():
        raise InvalidArgument(
            f"multipart body cannot be read: its boundary {boundary[:80]!r} is not 1 to "
            f"{_MAX_BOUNDARY_CHARS} ASCII characters"
        )
    return boundary.encode()


def split_parts(content_type: str, body: bytes | SpooledBody) -> list[Part]:
    """The parts of a whole ``multipart/form-data`` body, in memory or spooled to a
    file; see the module docstring. On a thread: it reads a spooled body."""
    src = _Source(body)
    dash = b"--" + boundary_of(content_type)
    pos = _first_boundary(src, dash)
    delimiter = _CRLF + dash
    parts: list[Part] = []
    while True:
        # After a boundary: "--" closes the body (what follows is an epilogue);
        # else optional whitespace and the line's end, then a part.
        if src.read(pos, pos + 2) == b"--":
            break
        eol = src.find(_CRLF, pos, pos + _MAX_PADDING_BYTES + 2)
        if eol < 0 and pos + _MAX_PADDING_BYTES + 2 >= src.size:
            raise _cut_short()
        if eol < 0 or src.read(pos, eol).strip(b" \t"):
            line = src.read(pos - len(dash), min(pos + 80, src.size))
            raise InvalidArgument(
                f"multipart body cannot be read: {line!r} is not a boundary line ({dash[:80]!r})"
            )
        if len(parts) == MAX_PARTS:
            raise TooLarge(f"multipart body has over {MAX_PARTS} parts, the most aserve takes")
        start = eol + 2
        end = src.find(delimiter, start)
        if end < 0:
            raise _cut_short()
        parts.append(_part(src, start, end, len(parts) + 1))
        pos = end + len(delimiter)
    if not parts:
        raise InvalidArgument("multipart body has no parts")
    return parts


class _Source:
    """A body's bytes, in memory or in a spooled file, found in and read a window at
    a time: between two windows the GIL can pass to the event loop's thread (one
    find over 60 MB in memory holds it for about 10 ms; a spooled body is read by
    ``pread``, which lets go of it)."""

    __slots__ = ("_file", "_memory", "size")

    def __init__(self, body: bytes | SpooledBody) -> None:
        self._memory = body if isinstance(body, bytes) else None
        self._file = None if isinstance(body, bytes) else body
        self.size = len(body) if isinstance(body, bytes) else body.size

    def read(self, start: int, stop: int) -> bytes:
        if self._memory is not None:
            return self._memory[start:stop]
        assert self._file is not None
        return self._file.read(start, stop)

    def find(self, sub: bytes, start: int, stop: int | None = None) -> int:
        """Where ``sub`` first lies wholly in ``[start, stop)``, or -1."""
        stop = self.size if stop is None else min(stop, self.size)
        while start < stop:
            end = min(start + _FIND_WINDOW_BYTES + len(sub), stop)
            if self._memory is not None:
                at = self._memory.find(sub, start, end)
            else:
                at = self.read(start, end).find(sub)
                at = -1 if at < 0 else start + at
            if at >= 0 or end >= stop:
                return at
            start = end - len(sub) + 1
        return -1


def _first_boundary(src: _Source, dash: bytes) -> int:
    """Where the first boundary line's boundary ends (the preamble before it bounded)."""
    at = src.find(dash, 0)
    while at > 0 and src.read(at - 1, at) != b"\n":  # not at a line's start: still preamble
        if at > MAX_PREAMBLE_BYTES:
            break
        at = src.find(dash, at + 1)
    if at < 0:
        raise InvalidArgument(
            "multipart body cannot be read: no boundary "
            f"{dash[2:].decode('latin-1')!r} (from its Content-Type) in it"
        )
    if at > MAX_PREAMBLE_BYTES:
        raise InvalidArgument(
            f"multipart body has {at} bytes before its first boundary, over the "
            f"{MAX_PREAMBLE_BYTES} aserve reads"
        )
    return at + len(dash)


def _part(src: _Source, start: int, end: int, number: int) -> Part:
    """Part ``number``: its headers from ``start``, its data up to ``end``."""
    if src.read(start, start + 2) == _CRLF:  # no header lines
        lines: list[bytes] = []
        data_start = start + 2
    else:
        lines, data_start = _header_lines(src, start, end, number)
    try:
        headers, _ = HeadersParser(max_field_size=MAX_HEADER_LINE_BYTES).parse_headers(
            [*lines, b""]
        )
        _, params = parse_content_disposition(headers.get(hdrs.CONTENT_DISPOSITION))
    except Exception as exc:  # aiohttp's BadHttpMessage, InvalidHeader, ValueError...
        why = str(getattr(exc, "message", None) or exc).strip() or type(exc).__name__
        raise InvalidArgument(f"multipart body cannot be read: part {number}: {why}") from None
    ctype = headers.get(hdrs.CONTENT_TYPE)
    if ctype is not None and ctype.lstrip().lower().startswith("multipart/"):
        raise InvalidArgument("multipart body: nested multipart parts are not supported")
    name = content_disposition_filename(params, "name")
    filename = content_disposition_filename(params, "filename")
    return Part(
        None if name is None else utf8_safe(name),
        None if filename is None else utf8_safe(filename),
        None if ctype is None else utf8_safe(ctype),
        src.read(data_start, end),
        None if filename is None else header_bytes(filename),
    )


def _header_lines(src: _Source, start: int, end: int, number: int) -> tuple[list[bytes], int]:
    """Part ``number``'s header lines, within the bounds, and where its data starts.

    Only as much is read as the bounds allow headers to take: a part whose
    empty line comes later breaks one of them.
    """
    window = min(end, start + _MAX_HEADER_BLOCK_BYTES)
    blank = src.find(b"\r\n\r\n", start, window)
    block = src.read(start, window if blank < 0 else blank)
    count = block.count(_CRLF) + 1
    if count > MAX_PART_HEADERS:
        raise InvalidArgument(
            f"multipart body cannot be read: part {number} has over {MAX_PART_HEADERS} header "
            "lines, the most aserve reads (Too many headers)"
        )
    if blank < 0 and window == end:
        raise InvalidArgument(
            f"multipart body cannot be read: part {number}'s headers do not end with an "
            "empty line before the next boundary"
        )
    lines = block.split(_CRLF)
    for line in lines:
        if len(line) > MAX_HEADER_LINE_BYTES:
            raise InvalidArgument(
                f"multipart body cannot be read: part {number} has a header line of over "
                f"{MAX_HEADER_LINE_BYTES} bytes, the most aserve reads"
            )
    assert blank >= 0  # a block as long as the bounds allow without one has a long line
    return lines, blank + 4


def _cut_short() -> InvalidArgument:
    return InvalidArgument("multipart body cannot be read: it ends before its closing boundary")
