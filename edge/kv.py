"""The KV cache: one preallocated buffer per layer, shared by the graph's past and present (GroupQueryAttention
appends in place), and the committed length that says how much of it is real.

A verify call writes its S candidate slots at [length, length + S) without committing them. Then:
- `append(n, ids)`  commits the first n of them (a chain: the accepted prefix),
- `keep(idx, ids)`  compacts a verified tree: slot length+idx[j] moves to length+j, then commits len(idx),
- `trim(n)`         drops the last n committed tokens (rollback; nothing is copied or zeroed).
Stale slots past `length` are harmless: the attention bias never lets a query see them.

The cache also owns the ids of its committed tokens (`tokens`), changed in the same step as `length`, so the two
cannot disagree (an interrupted request leaves both where its last commit put them) and a new prompt re-uses the
longest prefix the cache holds (`common_prefix`). A commit without ids (timing and probe calls) records -1s, which
no prompt matches.

A prefill chunk that attended over a dequantized copy of an int8 cache (`append(..., chunk=True)`) computed its
rows together: each saw the chunk's earlier rows unquantized, so its tokens are re-used whole or not at all.
`common_prefix` backs off to such a chunk's first token, and a prompt sent again recomputes exactly the chunk it
computed the first time (the same answer, bit for bit).
"""
from __future__ import annotations

import numpy as np

from memory.footprint import KV_SCRATCH_SLOTS as SCRATCH_SLOTS
from memory.footprint import kv_allocated_slots

from .errors import CacheFull, EngineError


# the manifest's `kv_dtype` → the cache's element type ("int8": GroupQueryAttention quantizes each new K/V value
# with the graph's static per-channel scales, so a token's cached codes do not depend on the call that wrote them)
KV_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


def kv_numpy_dtype(kv_dtype: str):
    try:
        return KV_DTYPES[kv_dtype]
    except KeyError:
        raise EngineError(f"kv_dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}") from None


class KVCache:
    """One [1, kv_heads, slots + 1, head_dim] array per layer and kind, K and V. Only the slots in use are allocated,
    rounded up (`memory.footprint.kv_allocated_slots`): `reserve` grows the arrays one at a time (so growing never
    holds two copies of the whole cache) and returns True when it did, and a session bound to the old arrays must
    then bind the new ones (`arrays`). The extra slot is scratch for the graph's pad query row
    (export/graph.py), which writes one K/V slot past a call's tokens."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype=np.float32,
                 reserve_all: bool = False):
        self.capacity = capacity
        self.length = 0
        self.tokens: list[int] = []  # ids of the committed tokens: len(tokens) == length
        self.in_chunk: list[bool] = []  # per committed token: written by a wide prefill chunk, after its first row
        self._shape = (1, kv_heads, head_dim)
        self.dtype = np.dtype(dtype)
        self.slots = capacity if reserve_all else kv_allocated_slots(1, capacity)
        self.arrays = [self._zeros(self.slots) for _ in range(2 * layers)]  # [2·i + kind]

    def _zeros(self, slots: int) -> np.ndarray:
        b, h, d = self._shape
        return np.zeros((b, h, slots + SCRATCH_SLOTS, d), self.dtype)

    def layer(self, i: int, kind: int) -> np.ndarray:
        return self.arrays[2 * i + kind]

    @property
    def buf(self) -> np.ndarray:
        """All of it as one [layers, 2, 1, kv_heads, slots + 1, head_dim] copy (inspection and tests)."""
        n = len(self.arrays) // 2
        return np.stack(self.arrays).reshape((n, 2) + self.arrays[0].shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def reserve(self, needed: int, replaced=None) -> bool:
        """Make room for `needed` slots (committed + pending); True if the arrays were replaced. Every old slot is
        copied (pending ones too: a verify call's K/V may be committed after it). `replaced(j, new)` is called
        after array j is replaced, before the next one is allocated: a session rebinds it there, so the old array
        can be freed and growing costs one layer's copy at a time, not a second whole cache."""
        if needed <= self.slots:
            return False
        slots = kv_allocated_slots(min(needed, self.capacity), self.capacity)
        for j in range(len(self.arrays)):
            old = self.arrays[j]
            new = self._zeros(slots)
            new[:, :, : old.shape[2]] = old
            self.arrays[j] = new
            del old
            if replaced is not None:
                replaced(j, new)
        self.slots = slots
        return True

    def room(self) -> int:
        return self.capacity - self.length

    def check_room(self, s: int) -> None:
        if self.length + s > self.capacity:
            raise CacheFull(f"KV cache full: {self.length} + {s} tokens > capacity {self.capacity}")

    def append(self, n: int, ids=None, chunk: bool = False) -> None:
        """Commit the first n pending slots, holding tokens `ids` (None: unknown); `chunk`: they were computed
        together by one wide prefill call, and are re-used only from its first."""
        assert 0 <= n and self.length + n <= self.capacity, (n, self.length)
        assert ids is None or len(ids) == n, (n, len(ids))
        self.tokens += [-1] * n if ids is None else ids
        self.in_chunk += [False] + [True] * (n - 1) if chunk and n else [False] * n
        self.length += n

    def trim(self, n: int) -> None:
        """Drop the last n committed tokens."""
        assert 0 <= n <= self.length, (n, self.length)
        self.length -= n
        del self.tokens[self.length :], self.in_chunk[self.length :]

    def common_prefix(self, ids, limit: int | None = None) -> int:
        """How many of `ids` (up to `limit`) the cache holds as its first tokens and a request can continue from:
        never the middle of a wide prefill chunk (the class docstring)."""
        have = self.tokens
        lim = min(len(have), len(ids) if limit is None else limit)
        n = 0
        while n < lim and have[n] == ids[n]:
            n += 1
        while n < len(self.in_chunk) and self.in_chunk[n]:
            n -= 1
        return n

    def keep(self, indices, ids=None) -> None:
        """Commit the pending slots `indices` (ascending, relative to `length`) as consecutive tokens `ids`."""
        idx = np.asarray(indices, np.int64)
        n = len(idx)
        moved = np.nonzero(idx != np.arange(n))[0]
        if moved.size:
            first = int(moved[0])
            src = self.length + idx[first:]
            dst = self.length + np.arange(first, n)
            for a in self.arrays:
                a[:, :, dst] = a[:, :, src]
        self.append(n, ids)
