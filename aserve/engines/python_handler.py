"""The python engine: a user's handler class serves the model.

A config names the class as ``"handler": "package.module:ClassName"``,
importable from the config file's folder. The class has::

    load(self, context)                 once, off the loop, before serving
    preprocess(self, request) -> dict   per request, off the loop: named arrays
    infer(self, batch) -> dict          per batch, on an executor thread
    postprocess(self, outputs, request) per request, off the loop: the response
    unload(self)                        optional, once, off the loop

``preprocess`` and ``postprocess`` run in the model's handler threads (see
``aserve/loop/runtimes/handler.py``); the arrays ``preprocess`` returns are
batched with other requests' (stacked along the first dimension) and handed
to ``infer`` on an executor thread. Methods may run concurrently on several
threads, so a handler must not keep per-request state on ``self``.

With ``"executor": "process"`` the handler is loaded twice: in the server
for ``preprocess`` and ``postprocess`` (``context.role`` "front") and in
each worker process for ``infer`` (role "infer"); with threads, once (role
"both"). A handler can skip what its role does not need (a front needs the
tokenizer, not the weights).

Raw bodies (``POST /predictions/{model}``, TorchServe's route) reach a handler
that has, besides the methods above::

    preprocess_raw(self, request) -> dict      per request, off the loop: named arrays
    postprocess_raw(self, outputs, request)    optional, per request: the answer

``request.body`` is the body's bytes, or for ``multipart/form-data`` the
list of its :class:`Part` (name, filename, content type, data);
``request.content_type`` is the request's Content-Type, ``request.inputs``
is empty and ``request.parameters`` holds the query string. Every string
here is valid UTF-8: header bytes that are not (a filename from a client
that writes Latin-1, say) are U+FFFD in it, and a part's
``filename_bytes`` keeps its filename's bytes as sent. The arrays
``preprocess_raw`` returns are batched as ``preprocess``'s are (with other
raw requests' and V2 requests' of the same names, dtypes and item shapes),
so one handler serves both routes. The answer (``postprocess_raw``'s, else
``postprocess``'s) is sent as :func:`raw_answer` says: ``bytes`` as
``application/octet-stream``, ``(bytes, content_type)`` as that type, a
``str`` as text, anything else (a dict of arrays too) as JSON. A ``str``
that is not valid UTF-8 (a lone surrogate in it), in the answer or in its
JSON, fails the request with a message that says so, as does a content
type that is not printable ASCII (a CR or LF in it, say).

A decoupled model (``"decoupled": true``) answers a request with any
number of responses. Its handler has, instead of the four methods above::

    load(self, context)                       once, off the loop, before serving
    stream(self, request) -> Iterator[dict]   per request, in a handler thread

``stream`` is a generator: each dict it yields is one response, every
declared output by name (arrays with the request's batch dimension first).
It may yield none. The server takes each response as it comes, at most a
few ahead of what the client has read (the generator waits at its
``yield`` meanwhile); when the client goes, the generator is closed at its
next ``yield`` (``GeneratorExit`` there, so its ``finally`` runs), and
``request.cancelled()`` is true from then on, for a generator that waits
between responses and wants to stop sooner.

Everything in this module runs off the loop.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from aserve.config import ModelConfig, TensorSpec
from aserve.engines.base import Engine
from aserve.engines.handler_imports import import_from
from aserve.obs.handler_metrics import MetricSet
from aserve.types.sequence import SequenceInfo
from aserve.types.text import first_surrogate

REQUIRED_METHODS = ("load", "preprocess", "infer", "postprocess")
DECOUPLED_METHODS = ("load", "stream")  # a decoupled model's handler
RAW_METHOD = "preprocess_raw"  # a handler with it serves /predictions


class HandlerImportError(Exception):
    """The handler cannot be imported or is not a handler class; says why."""


@dataclass(frozen=True)
class HandlerContext:
    """What ``load(context)`` learns about its model."""

    model_name: str
    model_version: str
    device: str
    instances: int
    base_dir: Path  # the config file's folder
    path: Path | None  # the config's ``path``, resolved; None when not given
    parameters: dict[str, Any]
    inputs: list[TensorSpec]  # the model's V2 inputs, as configured
    outputs: list[TensorSpec]
    # What this instance of the handler will be asked to do: "both" (every method),
    # "front" (preprocess/postprocess, in the server) or "infer" (in a worker process).
    role: str = "both"
    # The model's custom metrics (counter/gauge/histogram), usable from every method.
    metrics: MetricSet | None = None


@dataclass(frozen=True)
class Part:
    """One part of a ``multipart/form-data`` body (a form field or a file)."""

    name: str | None  # the form field's name (Content-Disposition ``name``)
    filename: str | None  # the file's name, for a file; bytes not UTF-8 as U+FFFD
    content_type: str | None  # the part's own Content-Type, if it has one
    data: bytes
    # The filename's bytes as the client wrote them (``filename="..."``; for an
    # RFC 5987 ``filename*``, the UTF-8 of its text): for a handler that must
    # tell apart names that differ only in bytes that are not UTF-8.
    filename_bytes: bytes | None = None


def _never() -> bool:
    return False


@dataclass
class HandlerRequest:
    """One request as ``preprocess`` and ``postprocess`` see it.

    ``inputs`` are the V2 input tensors by name, each with the batch
    dimension first (BYTES tensors are object arrays of ``bytes``);
    ``batch_size`` is that dimension. ``state`` is free for the handler to
    carry something from ``preprocess`` to ``postprocess`` of this request.
    A raw request (``/predictions``) has no inputs (``batch_size`` 1) and
    its ``body`` and ``content_type`` instead. ``cancelled()`` tells whether
    the client has gone (a decoupled model's ``stream`` may stop early).
    ``sequence`` is the request's place in its sequence, for a model with
    ``sequence_batching`` (its id, whether it starts or ends it, its slot,
    and ``state``: a dict kept for the sequence's life, for what its next
    request needs); None otherwise.
    """

    inputs: dict[str, np.ndarray]
    batch_size: int
    parameters: dict[str, Any]
    id: str | None
    state: dict[str, Any] = field(default_factory=dict)
    body: bytes | list[Part] | None = None
    content_type: str | None = None
    cancelled: Callable[[], bool] = _never
    sequence: SequenceInfo | None = None


def raw_answer(value: Any, where: str) -> tuple[bytes, str]:
    """A raw request's answer as (body, Content-Type); ``where`` names the method for errors.

    ``bytes`` -> ``application/octet-stream``; ``(bytes, str)`` -> that type;
    ``str`` -> ``text/plain; charset=utf-8``; anything else is JSON, with
    numpy arrays and scalars as lists and numbers and ``bytes`` as UTF-8 text.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), "application/octet-stream"
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], (bytes, bytearray, memoryview))
        and isinstance(value[1], str)
    ):
        if not value[1].isprintable() or not value[1].isascii():
            raise TypeError(f"{where} returned the content type {value[1]!r}: not printable ASCII")
        return bytes(value[0]), value[1]
    if isinstance(value, str):
        at = first_surrogate(value)
        if at is not None:
            raise TypeError(
                f"{where} returned a str that is not valid UTF-8 (a lone surrogate "
                f"{value[at]!r} at index {at}): return bytes, or replace it first "
                "(text.encode('utf-8', 'replace'))"
            )
        return value.encode(), "text/plain; charset=utf-8"
    try:
        body = orjson.dumps(value, default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        if "surrogates" in str(exc):  # orjson's word for a str that is not UTF-8
            raise TypeError(
                f"{where} returned JSON with a str that is not valid UTF-8 (a lone "
                "surrogate in it): replace it first (text.encode('utf-8', 'replace'))"
            ) from None
        raise TypeError(
            f"{where} returned what is neither bytes, (bytes, content_type), str nor JSON: {exc}"
        ) from None
    return body, "application/json"


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):  # object arrays (BYTES): orjson takes only numeric ones
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"type {type(value).__name__} is not JSON serializable")


def import_handler(spec: str, base_dir: Path, decoupled: bool = False) -> type:
    """Import ``package.module:ClassName`` from ``base_dir``.

    The folder's modules are imported under a package of the folder's own
    (:mod:`aserve.engines.handler_imports`): another folder's modules of the
    same names (an archive's old content, another model's project) never
    stand in for them. A folder whose modules changed on disk since they were
    imported is imported afresh, so a reload picks up edited handler code.
    A decoupled model's class needs :data:`DECOUPLED_METHODS`, others
    :data:`REQUIRED_METHODS`. Raises :class:`HandlerImportError`.
    """
    module_name, _, class_name = spec.partition(":")
    try:
        module = import_from(base_dir, module_name)
    except Exception as exc:  # ImportError, SyntaxError, whatever the module raised
        raise HandlerImportError(
            f"cannot import module '{module_name}' (looked in {base_dir} and sys.path): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise HandlerImportError(f"module '{module_name}' has no class '{class_name}'")
    required = DECOUPLED_METHODS if decoupled else REQUIRED_METHODS
    missing = [m for m in required if not callable(getattr(cls, m, None))]
    if missing:
        kind = "a decoupled model's handler" if decoupled else "a handler"
        raise HandlerImportError(
            f"class '{spec}' lacks method(s) {', '.join(missing)}; {kind} needs "
            f"{', '.join(required)}"
        )
    return cls


def set_torch_threads(count: int) -> None:
    """On the calling thread: torch's intra-op threads (``cpu_threads``), if torch is in use.

    Only when torch is imported in this process already (by the handler's
    module or its ``load``, or another model): importing it here would cost
    a handler that does not use it a second or more and a few hundred MB per
    process, for a setting that means nothing to it. Per thread, as in the
    torch engine: torch keeps the count per thread, so each thread that runs
    the handler sets it.
    """
    if "torch" not in sys.modules:
        return
    # The import statement, not sys.modules: while another thread (another model's
    # load) is still importing torch, this waits for it to finish rather than see
    # a half-initialized module.
    import torch

    torch.set_num_threads(count)


class PythonHandlerEngine(Engine):
    """Runs a handler's ``infer`` on the executor threads.

    Unlike the torch engine, the arrays it batches are whatever ``preprocess``
    returned, not the model's configured inputs: stacking and checking go by
    the arrays' own names.
    """

    def __init__(self, config: ModelConfig, model_path: Path | None, base_dir: Path) -> None:
        super().__init__(config, model_path)  # type: ignore[arg-type]
        self.base_dir = base_dir
        self.handler: Any = None
        # A worker process's set only collects what changed, for the batch answer.
        self.metrics = MetricSet(config.name, config.version, delta=False)

    def load(self) -> None:
        self._load("both")

    def load_front(self) -> None:
        self._load("front")

    def load_worker(self) -> None:
        self.metrics = MetricSet(self.config.name, self.config.version, delta=True)
        self._load("infer")

    def _load(self, role: str) -> None:
        assert self.config.handler is not None
        cls = import_handler(self.config.handler, self.base_dir, self.config.decoupled)
        c = self.config
        context = HandlerContext(
            c.name, c.version, c.device, c.instances, self.base_dir,
            self.model_path, dict(c.parameters), list(c.inputs), list(c.outputs), role,
            self.metrics,
        )  # fmt: skip
        handler = cls()
        handler.load(context)
        self.handler = handler

    def create_instance(self, index: int) -> Any:
        # On the thread (or in the worker process) that runs infer, after load.
        set_torch_threads(self.config.cpu_threads)
        return None

    def stack_inputs(self, parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        if len(parts) == 1:
            return parts[0]
        # Requests share a batch only with equal names, dtypes and shapes (their shape key).
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def run(self, inputs: dict[str, np.ndarray], instance: Any) -> dict[str, np.ndarray]:
        outputs = self.handler.infer(inputs)
        if not isinstance(outputs, dict):
            raise TypeError(f"infer returned {type(outputs).__name__}, not a dict of arrays")
        return {k: np.asarray(v) for k, v in outputs.items()}

    def check_outputs(self, outputs: dict[str, np.ndarray], batch_size: int) -> None:
        for name, arr in outputs.items():
            if arr.ndim == 0 or arr.shape[0] != batch_size:
                raise ValueError(
                    f"infer output '{name}' has shape {list(arr.shape)}; its first dimension "
                    f"must be the batch size {batch_size}"
                )

    def unload(self) -> None:
        handler, self.handler = self.handler, None
        hook = getattr(handler, "unload", None)
        if callable(hook):
            hook()
