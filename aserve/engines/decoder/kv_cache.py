"""The preallocated KV cache and its slot allocator.

One slot holds one sequence: for every layer, K and V of shape
(slots, kv_heads, max_model_len, head_dim). Allocating everything up front
means a step never allocates cache memory, and the capacity the scheduler
plans with is exactly what exists.
"""

from __future__ import annotations

import heapq

import torch

from aserve.errors import Unavailable
from aserve.types.generation import SequenceTooLong


class CacheFull(Unavailable):
    """Every slot is taken. The scheduler should admit a sequence only while
    :attr:`KVCache.num_free` says there is room; seeing this is its bug."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        # Lowest free slot first: running sequences then tend to occupy a
        # contiguous range, which decode reads as a view instead of a gather.
        self._free = list(range(num_slots))
        self._taken: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def alloc(self, slot: int | None = None) -> int:
        """Take ``slot`` (a free one the prefix cache chose), or the lowest free
        slot; :class:`CacheFull` when none is left."""
        if not self._free:
            raise CacheFull(f"all {self.num_slots} KV-cache slots (max_num_seqs) are in use")
        if slot is None:
            slot = heapq.heappop(self._free)
        elif slot in self._taken or not 0 <= slot < self.num_slots:
            raise ValueError(f"KV-cache slot {slot} is not free")
        else:
            self._free.remove(slot)
            heapq.heapify(self._free)
        self._taken.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back. Its contents are left as they are: a slot's next
        sequence overwrites every position it reads before reading it, except
        the prefix the prefix cache found there for it."""
        if slot not in self._taken:
            raise ValueError(f"KV-cache slot {slot} is not allocated")
        self._taken.remove(slot)
        heapq.heappush(self._free, slot)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Give slot ``dst`` the first ``length`` positions of slot ``src`` (a
        prompt prefilled once for several sequences of it)."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def check_slots(self, slots: list[int]) -> None:
        for s in slots:
            if s not in self._taken:
                raise ValueError(f"KV-cache slot {s} is not allocated")
        if len(set(slots)) != len(slots):
            raise ValueError(f"a KV-cache slot appears twice in one batch: {slots}")

    def check_length(self, length: int) -> None:
        """A sequence of ``length`` tokens must fit in the cache."""
        if length > self.max_len:
            raise SequenceTooLong(
                f"sequence of {length} tokens exceeds max_model_len ({self.max_len})"
            )
