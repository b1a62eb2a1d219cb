"""The prefix cache's slot choice, pure (no model): which slot a prompt takes,
what it reuses, and the LRU order of eviction."""

from __future__ import annotations

import pytest

from aserve.engines.decoder.prefix_cache import Placement, PrefixCache

pytestmark = pytest.mark.timeout(10)


def test_a_prompt_reuses_whole_blocks_and_leaves_one_token_to_prefill() -> None:
    pc = PrefixCache(num_slots=2, block_tokens=4)
    a = list(range(10))
    assert pc.place(a) == Placement(0, 0)  # nothing cached: the lowest empty slot
    pc.filled(0, a)
    pc.release(0, a)
    assert pc.place([*a[:9], 99]) == Placement(0, 8)  # exactly what slot 0 holds, taken
    pc.release(0, [*a[:9], 99])
    assert pc.place(a[:8]) == Placement(1, 4, copy_from=0)  # 7 tokens may come from cache
    assert (pc.hits, pc.hit_tokens) == (2, 12)


def test_a_free_slot_holding_more_is_copied_from_not_taken() -> None:
    pc = PrefixCache(num_slots=3, block_tokens=2)
    long = list(range(12))
    pc.place(long)
    pc.release(0, long)
    got = pc.place([*long[:4], 50, 51, 52])
    assert got == Placement(1, 4, copy_from=0)  # slot 0 keeps its 12 tokens
    # A running slot (1) is a source too, never a slot to take.
    assert pc.place([*long[:4], 50, 51, 52, 53]).slot == 2


def test_eviction_is_least_recently_used_and_a_read_counts_as_a_use() -> None:
    pc = PrefixCache(num_slots=3, block_tokens=2)
    p, q, r = [1] * 6, [2] * 6, [3] * 6
    for slot, prompt in ((0, p), (1, q)):
        assert pc.place(prompt).slot == slot
        pc.release(slot, prompt)
    # Slot 2 never held anything: it goes first, and p's prefix is copied there.
    assert pc.place([*p[:4], 7, 7]) == Placement(2, 4, copy_from=0)
    pc.release(2, [*p[:4], 7, 7])
    # p was freed before q, but read since: q's slot is the least recently used.
    assert pc.place(r) == Placement(1, 0)
    # The least recently used free slot that holds the prefix is taken as it is
    # (its tail was the next to go anyway).
    pc.release(1, r)
    assert pc.place([*p[:4], 8, 8]) == Placement(0, 4)


def test_a_hash_that_matches_different_tokens_is_no_hit() -> None:
    pc = PrefixCache(num_slots=2, block_tokens=2)
    pc.place([1, 2, 3])
    pc.release(0, [1, 2, 3])
    pc._tokens[0] = [9, 9]  # as if another block had the same chained hash
    assert pc.place([1, 2, 3]).cached == 0
