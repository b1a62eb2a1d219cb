"""The user's batch function as an engine: runs on an executor thread or in a worker.

Nothing here touches the event loop. The batcher sees every call as a
request of one item with one tensor, so that its queue, deadlines and
latency model work unchanged:

- ``"v"``: an object array of one item (the value itself in this process;
  its msgpack bytes when it crosses to a worker), for functions that take a
  list of anything;
- ``"x"``: the item as a ``(1, *shape)`` numeric array, for ``stack=True``
  functions, which get the items stacked into one ``(n, *shape)`` array (the
  batcher batches only items of one shape and dtype together).

The function's results come back as ``"y"`` (one numeric array with the
batch first, when a stacking function returns one) or ``"v"`` (an object
array of the ``n`` results), and each caller gets its row.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aserve.config import ModelConfig
from aserve.engines.base import Engine
from aserve.engines.python_handler import HandlerContext
from aserve.library.values import pack_value, unpack_value

Predict = Callable[[Any], Any]


class LoadError(RuntimeError):
    """The function named by an import path cannot be imported or loaded; says why."""


def resolve(target: Any, device: str) -> tuple[Predict, Callable[[], Any] | None]:
    """The batch function of ``target`` and its unload hook (or None), loaded on ``device``.

    ``target`` is a callable, a class, or an import path ``"module:name"`` of
    either. A class is instantiated, its ``load(device)`` called if it has
    one, and its ``predict(batch)`` is the function (as service-streamer's
    ``ManagedModel`` has ``init_model`` and ``predict``).
    """
    if isinstance(target, str):
        target = import_target(target)
    if not isinstance(target, type):
        return target, None
    model = target()
    load = getattr(model, "load", None)
    if callable(load):
        load(device)
    predict = getattr(model, "predict", None)
    if not callable(predict):
        raise LoadError(f"class '{target.__qualname__}' has no predict(batch) method")
    unload = getattr(model, "unload", None)
    return predict, unload if callable(unload) else None


def import_target(path: str) -> Any:
    """The object an import path ``"package.module:name"`` names (imports the module)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise LoadError(f"'{path}' is not an import path: write 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, SyntaxError, whatever the module raised
        raise LoadError(f"cannot import '{module_name}': {type(exc).__name__}: {exc}") from exc
    obj = getattr(module, attr, None)
    if obj is None or not callable(obj):
        raise LoadError(f"module '{module_name}' has no function or class '{attr}'")
    return obj


class BatchFunction:
    """Calls the function on one batch and checks what it returned.

    ``wire``: items and results are msgpack bytes (they crossed a pipe).
    """

    def __init__(self, predict: Predict, name: str, stack: bool, wire: bool) -> None:
        self.predict = predict
        self.name = name
        self.stack = stack
        self.wire = wire

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.stack:
            batch: Any = inputs["x"]
            n = len(batch)
        else:
            items = inputs["v"]
            n = len(items)
            batch = [unpack_value(v) for v in items] if self.wire else list(items)
        return self._outputs(self.predict(batch), n)

    def _outputs(self, out: Any, n: int) -> dict[str, np.ndarray]:
        if isinstance(out, np.ndarray) and out.ndim >= 1 and not out.dtype.hasobject:
            self._check_length(len(out), n)
            if self.stack:
                return {"y": out}
        try:
            length = len(out)
        except TypeError:
            raise TypeError(
                f"'{self.name}' returned a {type(out).__name__}, not a list of {n} results "
                "(one per input, in order)"
            ) from None
        self._check_length(length, n)
        results = np.empty(n, dtype=object)
        for i, r in enumerate(out):
            results[i] = pack_value(r, f"result {i} of '{self.name}'") if self.wire else r
        return {"v": results}

    def _check_length(self, length: int, n: int) -> None:
        if length != n:
            raise ValueError(
                f"'{self.name}' returned {length} results for a batch of {n} inputs; "
                "it must return one result per input, in order"
            )


def stack_parts(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The requests' one-item tensors as one batch (their shape key made them stackable)."""
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


class FunctionEngine(Engine):
    """The function in this process: the engine of the executor thread that runs it."""

    def __init__(
        self, config: ModelConfig, target: Any, name: str, stack: bool, device: str
    ) -> None:
        super().__init__(config, Path("."))
        self._target = target
        self._name = name
        self._stack = stack
        self._device = device
        self._fn: BatchFunction | None = None
        self._unload: Callable[[], Any] | None = None

    def load(self) -> None:
        predict, self._unload = resolve(self._target, self._device)
        self._fn = BatchFunction(predict, self._name, self._stack, wire=False)

    def stack_inputs(self, parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return stack_parts(parts)

    def run(self, inputs: dict[str, np.ndarray], instance: Any) -> dict[str, np.ndarray]:
        assert self._fn is not None
        return self._fn.run(inputs)

    def check_outputs(self, outputs: dict[str, np.ndarray], batch_size: int) -> None:
        pass  # BatchFunction checked them, in the function's own words

    def unload(self) -> None:
        hook, self._unload = self._unload, None
        if hook is not None:
            hook()


class WorkerHandler:
    """The function in a worker process, as a handler of the python engine.

    Each worker of a ``Batched(..., workers=N)`` is a worker process of
    :mod:`aserve.workers.batch_process` serving this handler; ``load`` imports
    the function named in the parameters and loads it on the worker's device.
    Only ``infer`` runs there: ``preprocess``/``postprocess`` are the caller's
    side and never called.
    """

    def __init__(self) -> None:
        self._fn: BatchFunction | None = None

    def load(self, context: HandlerContext) -> None:
        p = context.parameters
        predict, _ = resolve(p["target"], context.device)
        self._fn = BatchFunction(predict, p["label"], bool(p["stack"]), wire=True)

    def infer(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self._fn is not None
        return self._fn.run(batch)

    def preprocess(self, request: Any) -> dict[str, np.ndarray]:
        raise RuntimeError("a Batched worker only runs infer")

    def postprocess(self, outputs: Any, request: Any) -> Any:
        raise RuntimeError("a Batched worker only runs infer")
