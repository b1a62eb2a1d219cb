"""A request's sequence parameters: ``sequence_id``, ``sequence_start``, ``sequence_end``.

Layer: codecs (pure; never asyncio). Both frontends hand a request's
parameters on as one plain dict (JSON ``parameters`` over HTTP; over gRPC
the ``InferParameter`` map, with tritonclient's ``int64_param`` or
``string_param`` id and ``bool_param`` flags), so one function reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from aserve.errors import InvalidArgument, Unimplemented
from aserve.types.sequence import SequenceId

SEQUENCE_ID: Final = "sequence_id"
SEQUENCE_START: Final = "sequence_start"
SEQUENCE_END: Final = "sequence_end"
# The largest id a uint64 holds (Triton's ids are uint64 or strings).
MAX_ID: Final = 2**64 - 1
# A string id longer than this is refused: the server keeps each one it serves.
MAX_ID_CHARS: Final = 256


@dataclass(frozen=True)
class SequenceParams:
    """What a request says of its sequence."""

    id: SequenceId
    start: bool
    end: bool


def sequence_params(params: Mapping[str, Any] | None, model: str) -> SequenceParams:
    """The sequence a request of sequence-batched ``model`` belongs to, checked.

    Raises InvalidArgument for a missing id, an id that is neither a positive
    integer below 2**64 nor a non-empty string, or a flag that is not a boolean.
    tritonclient leaves the parameters out when its ``sequence_id`` is 0, so a
    0 reads as missing too.
    """
    value = None if params is None else params.get(SEQUENCE_ID)
    if value is None or value == 0 or value == "":
        raise InvalidArgument(
            f"model '{model}' serves sequences: a request needs the parameter "
            f"'{SEQUENCE_ID}' (a positive integer or a non-empty string; tritonclient's "
            "infer(..., sequence_id=)), with 'sequence_start' true on a sequence's first "
            "request and 'sequence_end' true on its last"
        )
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(
            f"parameter '{SEQUENCE_ID}' must be a positive integer or a non-empty string, "
            f"got {value!r}"
        )
    if isinstance(value, int) and not 0 < value <= MAX_ID:
        raise InvalidArgument(
            f"parameter '{SEQUENCE_ID}' must be between 1 and 2**64 - 1, got {value}"
        )
    if isinstance(value, str) and len(value) > MAX_ID_CHARS:
        raise InvalidArgument(
            f"parameter '{SEQUENCE_ID}' is {len(value)} characters long; at most {MAX_ID_CHARS}"
        )
    assert params is not None
    return SequenceParams(value, _flag(params, SEQUENCE_START), _flag(params, SEQUENCE_END))


def refuse_sequence(params: Mapping[str, Any] | None, model: str) -> None:
    """Raise Unimplemented when a request to ``model``, which serves no sequences,
    names one: it would otherwise be answered as if each request stood alone."""
    if params is None:
        return
    value = params.get(SEQUENCE_ID)
    if value is None or value == 0 or value == "":
        return
    raise Unimplemented(
        f"model '{model}' does not serve sequences (its config has no sequence_batching): "
        f"parameter '{SEQUENCE_ID}' is not supported for it"
    )


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if value is None:  # an InferParameter with nothing set
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"parameter '{key}' must be true or false, got {value!r}")
    return value
