"""The KV cache: one preallocated buffer per layer, shared by the graph's past and present (GroupQueryAttention
appends in place), and the committed length that says how much of it is real.

A verify call writes its S candidate slots at [length, length + S) without committing them. Then:
- `append(n)`  commits the first n of them (a chain: the accepted prefix),
- `keep(idx)`  compacts a verified tree: slot length+idx[j] moves to length+j, then commits len(idx),
- `trim(n)`    drops the last n committed tokens (rollback; nothing is copied or zeroed).
Stale slots past `length` are harmless: the attention bias never lets a query see them.
"""
from __future__ import annotations

import numpy as np

from memory.footprint import KV_SCRATCH_SLOTS as SCRATCH_SLOTS


class CacheFull(Exception):
    pass


# the manifest's `kv_dtype` → the cache's element type ("int8": GroupQueryAttention quantizes each new K/V value
# with the graph's static per-channel scales, so a token's cached codes do not depend on the call that wrote them)
KV_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


def kv_numpy_dtype(kv_dtype: str):
    try:
        return KV_DTYPES[kv_dtype]
    except KeyError:
        raise ValueError(f"kv_dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}") from None


class KVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype=np.float32):
        # [layer, k|v, 1, kv_heads, capacity + 1, head_dim]: each layer's slice is contiguous. The extra slot is
        # scratch for the graph's pad query row (export/graph.py), which writes one K/V slot past a full cache
        self.buf = np.zeros((layers, 2, 1, kv_heads, capacity + SCRATCH_SLOTS, head_dim), dtype)
        self.capacity = capacity
        self.length = 0

    def layer(self, i: int, kind: int) -> np.ndarray:
        return self.buf[i, kind]

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    def room(self) -> int:
        return self.capacity - self.length

    def check_room(self, s: int) -> None:
        if self.length + s > self.capacity:
            raise CacheFull(f"KV cache full: {self.length} + {s} tokens > capacity {self.capacity}")

    def append(self, n: int) -> None:
        assert 0 <= n and self.length + n <= self.capacity, (n, self.length)
        self.length += n

    def trim(self, n: int) -> None:
        assert 0 <= n <= self.length, (n, self.length)
        self.length -= n

    def keep(self, indices) -> None:
        """Commit the pending slots `indices` (ascending, relative to `length`) as consecutive tokens."""
        idx = np.asarray(indices, np.int64)
        n = len(idx)
        moved = np.nonzero(idx != np.arange(n))[0]
        if moved.size:
            first = int(moved[0])
            src = self.length + idx[first:]
            dst = self.length + np.arange(first, n)
            self.buf[:, :, :, :, dst] = self.buf[:, :, :, :, src]
        self.append(n)
