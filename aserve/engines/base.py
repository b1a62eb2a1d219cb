"""The engine interface every model backend implements.

Layer: ``engines``; never imports asyncio. Its methods run where an executor
calls them (see :class:`Engine`).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any

import numpy as np

from aserve.config import ModelConfig
from aserve.engines import batching


class ParkError(RuntimeError):
    """A parked engine's weights cannot be read back (its file changed since the
    load, or a read failed): the caller loads the model anew."""


class Engine(abc.ABC):
    """Runs one model version. Thread-safety contract:

    - ``load`` and ``unload`` run once, off the event loop, never concurrently
      with ``run``.
    - ``create_instance`` runs on each executor thread as it starts; what it
      returns (thread settings, a CUDA stream, staging buffers) is handed back
      to every ``run`` on that thread.
    - ``run`` may run concurrently on several instance threads.
    - An engine whose ``inline_capable`` is True may also have ``run`` called
      on the event loop's thread, with an instance created there, for batches
      measured to take well under 100 µs (see
      :class:`aserve.workers.thread_pool.ExecutorPool`).
    """

    inline_capable = False

    def __init__(self, config: ModelConfig, model_path: Path) -> None:
        self.config = config
        self.model_path = model_path

    @abc.abstractmethod
    def load(self) -> None:
        """Load weights onto the device. Raise with a clear message on failure."""

    def load_front(self) -> None:  # noqa: B027 - optional hook
        """What the server process needs when ``run`` happens in worker processes
        (``"executor": "process"``): nothing, for engines that only ``run``."""

    def load_worker(self) -> None:
        """``load``, in a worker process (see :mod:`aserve.workers.batch_process`)."""
        self.load()

    def create_instance(self, index: int) -> Any:
        """Per-thread state for instance ``index``; called on that thread."""
        return None

    # One batch from the requests' inputs (where ``run`` runs), and the check of
    # what ``run`` returned (``ValueError`` naming the output that broke the
    # model's contract): batching's functions themselves, so that a batch makes
    # no forwarding call here. Engines with their own override them as methods.
    stack_inputs = batching.stack_inputs
    check_outputs = batching.engine_check_outputs

    @abc.abstractmethod
    def run(self, inputs: dict[str, np.ndarray], instance: Any) -> dict[str, np.ndarray]:
        """Run one batch: named arrays with the batch dimension in, named arrays out."""

    def unload(self) -> None:  # noqa: B027 - optional hook
        """Release the model's memory."""

    def park(self) -> int | None:
        """Release the weights' memory but keep the loaded model, for :meth:`unpark`
        to read them back (an evicted model's fast reload); the bytes released,
        or None where this engine cannot (then the caller unloads it). Called
        off the loop, with no batch running."""
        return None

    def unpark(self) -> None:
        """Read back the weights :meth:`park` released; raise when they cannot be
        (the caller then unloads the model and loads it anew)."""
        raise NotImplementedError(f"{type(self).__name__} does not park")
