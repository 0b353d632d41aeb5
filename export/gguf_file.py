"""A GGUF file read once: metadata, vocabulary arrays and tensor locations from one pass over its header.

The `gguf` package's reader builds a Python object for every element of every array field; on a 262k-token
vocabulary (Gemma 3) that takes ~10 s per open, and an export used to open the file several times. Here the header is
parsed with `struct` and numpy (numeric arrays as one `frombuffer`, strings in one loop), tensors are located, and
their bytes are memory-mapped; de-quantization stays with the `gguf` package (`gguf.quants.dequantize`).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
# GGUF value types → numpy dtypes (scalars and array items); 8 = string, 9 = array
_NUMERIC = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """Not a GGUF file we can read (bad magic, a truncated header, an unknown value type)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major, outermost first (GGUF lists dims innermost first)
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("truncated header")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack_from("<" + fmt, self.take(struct.calcsize("<" + fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _NUMERIC:
            dt = np.dtype(_NUMERIC[kind])
            v = np.frombuffer(self.take(dt.itemsize), dt)[0]
            return bool(v) if kind == 7 else v.item()
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.unpack("I"), self.unpack("Q")
            if item in _NUMERIC:
                dt = np.dtype(_NUMERIC[item])
                return np.frombuffer(self.take(dt.itemsize * n), dt).copy()
            if item == _STRING:
                return [self.string() for _ in range(n)]
            return [self.value(item) for _ in range(n)]
        raise GGUFFormatError(f"unknown value type {kind}")


class GGUFFile:
    """`fields`: every key → value (numeric arrays as numpy arrays, string arrays as lists); `tensors` in file
    order; `data(t)`: a tensor's raw bytes (memory-mapped)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))
        if bytes(cur.take(4)) != _MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        version = cur.unpack("I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (readable: 2, 3)")
        n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
        self.fields: dict = {}
        for _ in range(n_kv):
            key = cur.string()
            self.fields[key] = cur.value(cur.unpack("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("Q") for _ in range(cur.unpack("I"))]
            infos.append((name, tuple(reversed(dims)), cur.unpack("I"), cur.unpack("Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        from gguf import GGML_QUANT_SIZES

        self.tensors: list[TensorInfo] = []
        for name, shape, kind, off in infos:
            block, size = GGML_QUANT_SIZES[kind]
            nbytes = int(np.prod(shape, dtype=np.int64)) // block * size
            if start + off + nbytes > len(self._map):
                raise GGUFFormatError(f"tensor {name} runs past the end of the file (truncated download?)")
            self.tensors.append(TensorInfo(name, shape, kind, start + off, nbytes))

    def data(self, t: TensorInfo) -> np.ndarray:
        return self._map[t.offset : t.offset + t.nbytes]

    def dequantize(self, t: TensorInfo) -> np.ndarray:
        """The tensor as fp32 numpy, shape `t.shape`."""
        from gguf.quants import dequantize

        raw = self.data(t)
        rows = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
        out = dequantize(raw.reshape(rows, -1), t.ggml_type)
        return np.asarray(out, np.float32).reshape(t.shape)


@lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """One parse per file version per process: the loader, the tokenizer and the manifest share it."""
    st = os.stat(path)
    return _open(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
