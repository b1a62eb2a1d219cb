"""``direct`` sequence batching on the loop: an instance's batcher and executor per instance.

Layer: ``loop``. Under ``direct`` each sequence is bound to one instance and one
batch row for its life (:mod:`aserve.sched.direct`). The runtime
(:mod:`aserve.loop.runtimes.batched`) then runs the instances as a
:class:`~aserve.workers.pinned_pool.PinnedPool` and keeps one
:class:`~aserve.loop.batcher.Batcher` per instance, fed only that instance's
sequences: deadlines, admission, cancellation and the batch sizes are the
generic batcher's, and a batch never mixes instances. Each request carries its
slot to the engine (:data:`~aserve.sched.direct.SLOT_KEY`), which lays the
batch out by row (:class:`~aserve.engines.direct_rows.DirectRows`).

Only a model whose runtime holds its sequences (not a python handler's, whose
``request.sequence`` serves the same purpose) and whose instances are threads
does this; the others count slots only.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from aserve.config import BatchingConfig, ModelConfig
from aserve.engines.base import Engine
from aserve.engines.direct_rows import DirectRows
from aserve.loop.batcher import Batcher
from aserve.loop.sequences import Sequences
from aserve.obs.stats import ModelStats
from aserve.sched.direct import SLOT_KEY, place
from aserve.types.tensors import numpy_dtype
from aserve.workers.pinned_pool import PinnedPool


def direct_rows(config: ModelConfig) -> bool:
    """Whether ``config``'s batches are laid out by sequence row, on bound instances."""
    sb = config.sequence_batching
    return (
        sb is not None and sb.strategy == "direct" and config.executor == "thread"
        and config.engine != "python"
    )  # fmt: skip


def pinned_pool(engine: Engine, config: ModelConfig, name: str, sequences: Sequences) -> PinnedPool:
    """The instance threads of a ``direct`` model, its engine laid out by row."""
    sb = config.sequence_batching
    assert sb is not None
    specs = {s.name: s for s in config.inputs}
    initial = {
        st.input: np.full(
            (1, *specs[st.input].shape), st.initial_value,
            dtype=numpy_dtype(specs[st.input].datatype),
        )
        for st in sb.state
    }  # fmt: skip
    rows = DirectRows(engine, config.batching.max_batch_size, initial, sequences.kept)
    return PinnedPool(cast(Engine, rows), config.instances, name)


def instance_batchers(
    label: str, batching: BatchingConfig, pool: PinnedPool, stats: ModelStats
) -> list[Batcher]:
    """A batcher per instance of ``pool``, each submitting to its own instance."""
    return [Batcher(label, batching, pool.instance(i), stats) for i in range(pool.instances)]


def with_slot(
    inputs: dict[str, np.ndarray], slot: int, batchers: list[Batcher]
) -> tuple[dict[str, np.ndarray], Batcher]:
    """A request's inputs with its slot beside them, and its instance's batcher."""
    instance, _ = place(slot, batchers[0].limits.max_batch_size)
    return {**inputs, SLOT_KEY: np.array(slot, dtype=np.int64)}, batchers[instance]
