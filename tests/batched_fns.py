"""Functions that tests/test_batched.py batches, imported by path in worker processes."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

DIE = -1  # an input that makes a worker process exit at once, as a crashed model would


def double(batch: list[Any]) -> list[Any]:
    """Each input doubled; ``DIE`` kills the worker process that runs the batch."""
    if DIE in batch:
        os._exit(3)
    return [x * 2 for x in batch]


def describe(batch: list[Any]) -> list[Any]:
    """What arrived, as it arrived: the values themselves, and the worker's pid."""
    return [{"value": x, "pid": os.getpid(), "batch": len(batch)} for x in batch]


class Scaler:
    """A model class with a load hook per worker (as service-streamer's ManagedModel)."""

    def load(self, device: str) -> None:
        self.device = device
        self.pid = os.getpid()
        self.scale = np.float32(3.0)

    def predict(self, batch: np.ndarray) -> np.ndarray:
        return batch * self.scale

    def unload(self) -> None:
        pass


class Where:
    """Tells which device its worker loaded on (the GPU check spreads these over cuda:N)."""

    def load(self, device: str) -> None:
        self.device = device
        if device.startswith("cuda"):
            import torch

            self.weights = torch.ones(4, device=device)
            self.device = str(self.weights.device)

    def predict(self, batch: list[Any]) -> list[Any]:
        return [{"device": self.device, "pid": os.getpid(), "x": x} for x in batch]


def unsendable(batch: list[Any]) -> list[Any]:
    """Results that cannot cross back from a worker (a set is not msgpack)."""
    return [{x} for x in batch]
