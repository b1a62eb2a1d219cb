"""aserve as a library: its deadline batcher inside your own application.

``Batched`` wraps a function of a list (service-streamer's job): see
:mod:`aserve.library.batched`. Importing this package does not import torch.
"""

from aserve.library.batched import Batched, BatchFailed, Timeout
from aserve.library.values import NotSendable

__all__ = ["BatchFailed", "Batched", "NotSendable", "Timeout"]
