"""edge/kv.py's KVCache: keep() moves exactly the kept slots (a tree path), append/trim/room at the bounds, and
slots allocated as they are used."""
from __future__ import annotations

import numpy as np
import pytest

from edge.kv import KVCache


def _numbered_cache(capacity=8, length=2):
    c = KVCache(layers=2, kv_heads=1, head_dim=1, capacity=capacity)
    for a in c.arrays:
        a[...] = np.arange(a.shape[2], dtype=np.float32)[:, None]  # slot j holds j
    c.length = length
    return c


@pytest.mark.parametrize("idx,expected", [([0, 1, 2], [2, 3, 4]), ([0, 2, 3], [2, 4, 5]), ([1], [3]),
                                          ([2, 4], [4, 6]), ([0, 1, 4], [2, 3, 6])])
def test_kv_keep_moves_exactly_the_kept_slots(idx, expected):
    c = _numbered_cache()
    c.keep(idx)
    assert c.length == 2 + len(idx)
    assert c.buf[:, :, 0, 0, : c.length, 0].tolist() == [[[0, 1] + expected] * 2] * 2


def test_kv_bounds():
    """The cache fills exactly to capacity (check_room, append and room() agree on the last slot) and refuses a
    rollback past its start."""
    c = KVCache(1, 1, 1, capacity=4)
    c.check_room(4)
    c.append(4)
    assert c.room() == 0 and c.length == 4
    with pytest.raises(AssertionError):
        c.trim(5)
    c.trim(4)
    assert c.room() == 4


def test_kv_grows_on_demand_and_keeps_every_slot():
    """Only the slots in use are allocated (rounded up); growing copies every old slot, pending ones too, tells
    the session which array it replaced, and never goes past capacity."""
    from memory.footprint import KV_GROW_SLOTS, kv_allocated_slots

    cap = 3 * KV_GROW_SLOTS + 5
    c = KVCache(layers=2, kv_heads=1, head_dim=1, capacity=cap)
    assert c.slots == KV_GROW_SLOTS and c.nbytes == 4 * (KV_GROW_SLOTS + 1) * 4
    for a in c.arrays:
        a[...] = np.arange(a.shape[2], dtype=np.float32)[:, None]
    seen = []
    assert not c.reserve(KV_GROW_SLOTS)
    assert c.reserve(KV_GROW_SLOTS + 1, lambda j, arr: seen.append((j, arr.shape[2])))
    assert c.slots == 2 * KV_GROW_SLOTS and seen == [(j, 2 * KV_GROW_SLOTS + 1) for j in range(4)]
    for a in c.arrays:
        assert a[0, 0, : KV_GROW_SLOTS + 1, 0].tolist() == list(range(KV_GROW_SLOTS + 1))
        assert not a[0, 0, KV_GROW_SLOTS + 1 :].any()
    assert c.reserve(cap + 100) and c.slots == cap  # never past capacity (check_room refuses beyond it)
    assert kv_allocated_slots(1, 10) == 10 and kv_allocated_slots(KV_GROW_SLOTS * 2 + 1, 10**6) == 3 * KV_GROW_SLOTS
    full = KVCache(layers=1, kv_heads=1, head_dim=1, capacity=cap, reserve_all=True)
    assert full.slots == cap


def test_a_wide_prefill_chunk_is_reused_whole_or_from_its_first_token():
    """A chunk that attended over a dequantized cache computed its rows together: a new prompt that shares only
    part of it recomputes it from its first token, so the chunk is computed as it was the first time."""
    c = KVCache(1, 1, 1, 64)
    c.append(5, [1, 2, 3, 4, 5])  # a narrow chunk (the quantized kernel: any row can be recomputed alone)
    c.append(6, [6, 7, 8, 9, 10, 11], chunk=True)
    c.append(2, [12, 13])  # decode steps
    assert c.in_chunk == [False] * 6 + [True] * 5 + [False] * 2
    assert c.common_prefix([1, 2, 3, 99]) == 3
    assert c.common_prefix([1, 2, 3, 4, 5, 6, 7, 8, 99]) == 5  # diverges inside the chunk: from its first token
    assert c.common_prefix(list(range(1, 12)), limit=10) == 5  # a limit inside it too
    assert c.common_prefix(list(range(1, 14)) + [0]) == 13
    assert c.common_prefix(list(range(1, 14)), limit=11) == 11  # the whole chunk
    assert c.common_prefix(list(range(1, 14)), limit=12) == 12
    c.trim(4)
    assert c.tokens == list(range(1, 10)) and c.in_chunk == [False] * 6 + [True] * 3
    c.keep([0], [10])  # a verified token is never part of a chunk
    assert c.in_chunk[-1] is False and len(c.in_chunk) == c.length
