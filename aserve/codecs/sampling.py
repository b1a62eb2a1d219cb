"""KServe-style request parameters (string/number/bool values) as sampling settings.

A KServe ``/infer`` or ``ModelInfer`` on a decoder model, the requests of a
decoupled ``ModelStreamInfer`` and Triton's generate extension carry their
sampling settings as request parameters; :func:`sampling_from_parameters`
reads them, held to the bounds of :func:`aserve.types.generation.sampling_settings`.
Keys that are not sampling settings (``timeout``, ``binary_data_output``,
``triton_*``...) are left to their own readers and ignored here.

Layer ``codecs`` (no torch, no asyncio): pure, called on the loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aserve.errors import InvalidArgument
from aserve.types.generation import BadSetting, SamplingParams, sampling_settings


def sampling_from_parameters(
    params: Mapping[str, Any] | None, where: str = "parameter"
) -> SamplingParams:
    """The :class:`SamplingParams` that ``params`` ask for (defaults for what is absent).

    ``where`` prefixes messages: ``parameter 'max_tokens' must be ...``.
    """
    if not params:
        return SamplingParams()
    try:
        return SamplingParams(**sampling_settings(params))
    except BadSetting as exc:
        raise InvalidArgument(f"{where} '{exc.param}' {exc.message}") from None
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where} {exc.message}") from None
