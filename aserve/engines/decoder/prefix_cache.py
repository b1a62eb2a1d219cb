"""Which KV-cache slot a new sequence gets, so that a shared prompt prefix is reused.

The cache holds one contiguous slot per sequence (:mod:`.kv_cache`), and a
slot's K/V stay when its sequence ends. This index remembers, for every slot,
the tokens whose K/V it holds, keyed by blocks of ``block_tokens`` tokens: a
chained hash per block (the hash of the previous block's hash and this
block's tokens), so one dictionary lookup per block says which slots hold a
prompt's first ``i`` blocks. A new prompt then starts from the longest
block-aligned prefix any slot holds:

- a free slot holding that prefix and nothing more is given to the sequence
  as it is: only the rest of the prompt is prefilled, with no copy;
- otherwise the sequence takes the least recently used free slot (slots that
  never held anything first, lowest index first), and the prefix is copied
  there from the slot holding it: a free one that holds more (a system
  prompt and an old conversation; the rest stays cached there), or one in
  use (another request with the same system prompt, running now). The
  slot taken is overwritten past the prefix: eviction is LRU over the free
  slots, within the KV cache's ``max_num_seqs`` slots, and never touches a
  running sequence. A prefix read from a free slot counts as a use of it.

Slot-level reuse, not a pool of shared blocks (vLLM's paged cache), because
the cache's layout is one contiguous range per slot that decode reads as a
view: sharing blocks between sequences would need a block table and a gather
in every decode step's attention, while reusing a slot needs neither. What
it gives up: sequences with the same prefix hold it once each (a copy costs
a memory copy of the prefix, no compute), so fewer distinct prefixes fit
than in a pool of blocks of the same size.

At least one prompt token is always prefilled: its logits give the first
generated token. Pure Python (no torch): the engine moves the K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a new sequence goes: ``slot`` to take, ``cached`` prompt tokens
    already there or copied from ``copy_from`` (a slot in use), the rest to
    prefill."""

    slot: int
    cached: int
    copy_from: int | None = None


class PrefixCache:
    def __init__(self, num_slots: int, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.block_tokens = block_tokens
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self._chains: list[list[int]] = [[] for _ in range(num_slots)]
        self._holders: dict[int, set[int]] = {}  # chained block hash -> slots holding it
        # Free slots and when each was freed (a counter): the smallest is evicted
        # first; -1 for slots that hold nothing worth keeping.
        self._free: dict[int, int] = dict.fromkeys(range(num_slots), -1)
        self._clock = 0
        self.hits = 0  # sequences placed with a cached prefix
        self.hit_tokens = 0  # their cached tokens, summed

    def _chain(self, tokens: Sequence[int], blocks: int) -> list[int]:
        b, h, out = self.block_tokens, 0, []
        for i in range(blocks):
            h = hash((h, tuple(tokens[i * b : (i + 1) * b])))
            out.append(h)
        return out

    def place(self, prompt: Sequence[int]) -> Placement:
        """Choose the slot for ``prompt`` (at least one slot must be free)
        and record it as taken, holding the cached prefix only."""
        if not self._free:
            raise ValueError("no free KV-cache slot to place a sequence in")
        # Blocks that leave at least one token to prefill.
        chain = self._chain(prompt, (len(prompt) - 1) // self.block_tokens)
        depth, holders = 0, set[int]()
        for h in chain:
            found = self._holders.get(h)
            if not found:
                break
            depth, holders = depth + 1, found
        cached = depth * self.block_tokens
        # A hash that collides is not a match: the chosen slot's tokens are compared.
        head = list(prompt[:cached])
        holders = {s for s in holders if self._tokens[s][:cached] == head}
        # A free slot holding the prefix and nothing more is taken as it is;
        # otherwise the prefix is copied into the least recently used free slot,
        # so that what the holder has past the prefix stays cached.
        exact = [s for s in holders if s in self._free and len(self._chains[s]) == depth]
        if exact:
            slot, source = exact[0], None
        else:
            slot = min(self._free, key=lambda s: (self._free[s], s))
            source = None if slot in holders else min(holders, default=None)
            if slot not in holders and source is None:
                cached = 0
        if source is not None and source in self._free:
            self._clock += 1
            self._free[source] = self._clock  # used: the last to be evicted now
        del self._free[slot]
        self._set(slot, prompt[:cached], chain[: cached // self.block_tokens])
        if cached:
            self.hits += 1
            self.hit_tokens += cached
        return Placement(slot, cached, source)

    def filled(self, slot: int, tokens: Sequence[int]) -> None:
        """Slot ``slot`` (in use) now holds K/V for ``tokens``."""
        self._set(slot, tokens, self._chain(tokens, len(tokens) // self.block_tokens))

    def release(self, slot: int, tokens: Sequence[int]) -> None:
        """Slot ``slot`` is free again, holding K/V for ``tokens`` (empty when
        its contents cannot be trusted, after a failed step)."""
        self.filled(slot, tokens)
        self._clock += 1
        self._free[slot] = self._clock if tokens else -1

    def _set(self, slot: int, tokens: Sequence[int], chain: list[int]) -> None:
        for h in self._chains[slot]:
            holders = self._holders[h]
            holders.discard(slot)
            if not holders:
                del self._holders[h]
        for h in chain:
            self._holders.setdefault(h, set()).add(slot)
        self._tokens[slot] = list(tokens[: len(chain) * self.block_tokens])
        self._chains[slot] = chain
