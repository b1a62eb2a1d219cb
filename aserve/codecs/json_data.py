"""JSON tensor data (``inputs[i].data``) to numpy, taking only what KServe V2 allows.

JSON numbers for the numeric types (integers for the integer types), ``true``
and ``false`` for BOOL, strings for BYTES. Anything else (``null``, ``"1"``,
``true`` for FP32, ``1.5`` for INT32, a value outside the type's range) is
refused with the element's index (row-major, counting the leaves of nested
lists). numpy's own conversion would take all of those (``null`` as NaN,
``"1"`` as 1.0, ``"false"`` as True), so it is not used on the elements.

The common case (a flat list of numbers) stays one C loop: :mod:`array`
converts them (refusing null, strings and non-integers for integer types,
and out-of-range integers, all by itself), and only elements equal to 0 or 1,
the values a ``true``/``false`` would have become, are looked at again.
Large data is converted in chunks, so that decoding it on a worker thread
lets the loop's thread take the GIL in between.
"""

from __future__ import annotations

import array
from typing import Any, Final

import numpy as np

from aserve.codecs.binary import CHUNK
from aserve.errors import InvalidArgument
from aserve.types.tensors import numpy_dtype

# The array module's type code that converts each numeric datatype's JSON
# numbers; FP16 goes through doubles.
_ARRAY_CODE: Final[dict[str, str]] = {
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "FP16": "d",
    "FP32": "f",
    "FP64": "d",
}
for _datatype, _code in _ARRAY_CODE.items():
    _want = 8 if _datatype == "FP16" else numpy_dtype(_datatype).itemsize
    assert array.array(_code).itemsize == _want, (_datatype, _code)


# Up to this many elements, their types are looked at one by one (see _numbers).
_SMALL = 128
# The Python types of JSON numbers a float and an integer datatype take.
_NUMBER_TYPES: Final[dict[bool, set[type]]] = {False: {int, float}, True: {int}}
_SMALL_NUMBERS: Final[dict[str, np.dtype]] = {t: numpy_dtype(t) for t in _ARRAY_CODE}


def from_json(name: str, datatype: str, shape: list[int], count: int, data: list) -> np.ndarray:
    """The tensor ``data`` holds (flat or nested lists), of ``shape`` with ``count`` elements."""
    if count <= _SMALL and len(data) == count:
        # The hot path (a few numbers, flat): their types cost less to look at
        # than numpy's calls; numpy converts what passes.
        dtype = _SMALL_NUMBERS.get(datatype)
        if dtype is not None and set(map(type, data)) <= _NUMBER_TYPES[dtype.kind in "iu"]:
            try:
                return np.array(data, dtype=dtype).reshape(shape)
            except OverflowError:
                pass  # an integer out of range: _numbers says which
    convert = _CONVERT.get(datatype, _numbers)
    if len(data) == count:
        try:
            return convert(name, datatype, data, count).reshape(shape)
        except _Nested:  # lists inside, as many as the shape's first dimensions
            pass
    return convert(name, datatype, _flatten(name, data, shape, count), count).reshape(shape)


class _Nested(Exception):
    """The elements are lists: the data is nested, flatten it first."""


def _numbers(name: str, datatype: str, flat: list, count: int) -> np.ndarray:
    if count <= _SMALL:
        if set(map(type, flat)) <= _NUMBER_TYPES[datatype[0] in "IU"]:
            try:
                return np.array(flat, dtype=numpy_dtype(datatype))
            except OverflowError:
                pass
        _refuse_number(name, datatype, flat)
        raise InvalidArgument(f"input '{name}': 'data' is not valid {datatype}")
    code = _ARRAY_CODE[datatype]
    try:
        if count <= CHUNK:
            values = array.array(code, flat)
        else:
            values = array.array(code)
            for i in range(0, count, CHUNK):
                values.extend(flat[i : i + CHUNK])
    except (TypeError, OverflowError) as exc:
        _refuse_number(name, datatype, flat)
        raise InvalidArgument(f"input '{name}': 'data' is not valid {datatype}: {exc}") from None
    arr = np.frombuffer(values, dtype=np.float64 if datatype == "FP16" else numpy_dtype(datatype))
    # array takes true/false as 1/0 (bool is an int): look at those values again.
    maybe_bool = np.flatnonzero((arr == 0) | (arr == 1))
    if maybe_bool.size:
        _refuse_bools(name, datatype, flat, maybe_bool)
    return arr.astype(np.float16) if datatype == "FP16" else arr


def _refuse_number(name: str, datatype: str, flat: list) -> None:
    """Raise for the first element of ``flat`` that is not a number of ``datatype``.

    Returns without raising when that element is a list (the data is nested).
    """
    integer = datatype[0] in "IU"
    info = np.iinfo(numpy_dtype(datatype)) if integer else None
    for i, x in enumerate(flat):
        kind = type(x)
        if kind is list:
            raise _Nested
        if kind is int and info is not None and not info.min <= x <= info.max:
            raise InvalidArgument(
                f"input '{name}': element {i} of 'data' is {x}, outside {datatype}'s range "
                f"[{info.min}, {info.max}]"
            )
        if kind is bool or not (kind is int or (kind is float and not integer)):
            raise _wrong_element(name, datatype, i, x)


def _refuse_bools(name: str, datatype: str, flat: list, candidates: np.ndarray) -> None:
    for i in candidates.tolist():
        if type(flat[i]) is bool:
            raise _wrong_element(name, datatype, i, flat[i])


def _bools(name: str, datatype: str, flat: list, count: int) -> np.ndarray:
    out = np.empty(count, dtype=np.bool_)
    for i in range(0, count, CHUNK):
        part = flat[i : i + CHUNK]
        if set(map(type, part)) - {bool}:
            _refuse_other(name, "BOOL", part, i, bool)
        out[i : i + CHUNK] = part
    return out


def _strings(name: str, datatype: str, flat: list, count: int) -> np.ndarray:
    out = np.empty(count, dtype=object)
    for i in range(0, count, CHUNK):
        part = flat[i : i + CHUNK]
        if set(map(type, part)) - {str}:
            _refuse_other(name, "BYTES", part, i, str)
        # JSON strings are valid Unicode (orjson refuses lone surrogates), so encode cannot fail.
        out[i : i + CHUNK] = list(map(str.encode, part))
    return out


def _refuse_other(name: str, datatype: str, part: list, start: int, kind: type) -> None:
    for i, x in enumerate(part):
        if type(x) is list:
            raise _Nested
        if type(x) is not kind:
            raise _wrong_element(name, datatype, start + i, x)


_CONVERT: Final = {"BOOL": _bools, "BYTES": _strings}
_TAKES: Final[dict[str, str]] = {"BOOL": "true or false", "BYTES": "strings"}


def _wrong_element(name: str, datatype: str, index: int, value: Any) -> InvalidArgument:
    takes = _TAKES.get(datatype) or ("integers" if datatype[0] in "IU" else "numbers")
    return InvalidArgument(
        f"input '{name}': element {index} of 'data' is {_describe(value)}; "
        f"{datatype} data must be JSON {takes}"
    )


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, str):
        return f"the string {value[:32]!r}" + ("..." if len(value) > 32 else "")
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return repr(value)[:40]


def _flatten(name: str, data: list, shape: list[int], count: int) -> list:
    """The leaves of nested lists, in order; refuses more than ``count`` of them.

    A loop, not recursion: JSON may nest lists a thousand deep (orjson's
    limit), past Python's recursion limit. It stops at ``count + 1`` leaves,
    so a short shape with long data costs what the shape declares.
    """
    out: list = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if type(x) is list:
                stack.append(iter(x))
                break
            out.append(x)
            if len(out) > count:
                raise _count_mismatch(name, shape, count, f"more than {count}")
        else:
            stack.pop()
    if len(out) != count:
        raise _count_mismatch(name, shape, count, str(len(out)))
    return out


def _count_mismatch(name: str, shape: list[int], count: int, got: str) -> InvalidArgument:
    return InvalidArgument(
        f"input '{name}': 'data' has {got} elements, shape {shape} needs {count}"
    )
