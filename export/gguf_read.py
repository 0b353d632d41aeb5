"""A fast reader for GGUF files: the metadata key/values and the tensor directory in one pass.

`gguf.GGUFReader` builds a numpy view for every part of every field, which on a 262k-token vocabulary costs about
ten seconds per open. Here numeric arrays are single `np.frombuffer` views and string arrays one loop over
length-prefixed bytes, so the same metadata reads in well under a second. Tensor data are views of one read-only
memory map, in the dtype and shape `gguf.GGUFReader` gives them (quantized types as their raw bytes), so
`gguf.quants.dequantize(t.data, t.tensor_type)` takes them as they are."""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR = {_UINT8: "B", _INT8: "b", _UINT16: "H", _INT16: "h", _UINT32: "I", _INT32: "i", _FLOAT32: "f",
           _BOOL: "?", _UINT64: "Q", _INT64: "q", _FLOAT64: "d"}
_NUMPY = {_UINT8: "u1", _INT8: "i1", _UINT16: "u2", _INT16: "i2", _UINT32: "u4", _INT32: "i4", _FLOAT32: "f4",
          _BOOL: "?", _UINT64: "u8", _INT64: "i8", _FLOAT64: "f8"}

# ggml tensor types stored element-wise (the rest are quantized blocks, exposed as raw bytes)
_PLAIN = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands (bad magic, unsupported version, truncated)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    tensor_type: int  # a gguf.GGMLQuantizationType value
    data: np.ndarray  # read-only view: outermost dimension first, raw bytes for quantized types


@dataclass(frozen=True)
class GGUFFile:
    version: int
    fields: dict  # key → int / float / bool / str; arrays as numpy arrays (numbers) or lists (strings, nested)
    tensors: list[GGUFTensor]
    data_offset: int


class _Cursor:
    def __init__(self, buf, order: str):
        self.buf, self.off, self.order = buf, 0, order
        self._u64 = struct.Struct(order + "Q").unpack_from

    def scalar(self, code: str):
        s = struct.calcsize(code)
        (v,) = struct.unpack_from(self.order + code, self.buf, self.off)
        self.off += s
        return v

    def u64(self) -> int:
        (v,) = self._u64(self.buf, self.off)
        self.off += 8
        return v

    def string(self) -> str:
        n = self.u64()
        end = self.off + n
        if end > len(self.buf):
            raise GGUFFormatError("truncated string")
        s = self.buf[self.off:end].decode("utf-8")
        self.off = end
        return s

    def strings(self, n: int) -> list[str]:
        buf, u64, off = self.buf, self._u64, self.off
        out = [""] * n
        for i in range(n):
            (k,) = u64(buf, off)
            off += 8
            out[i] = buf[off:off + k].decode("utf-8")
            off += k
        if off > len(buf):
            raise GGUFFormatError("truncated string array")
        self.off = off
        return out

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.scalar("I"), self.u64()
            if itype == _STRING:
                return self.strings(n)
            if itype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            if itype not in _NUMPY:
                raise GGUFFormatError(f"unknown array item type {itype}")
            dt = np.dtype(_NUMPY[itype]).newbyteorder(self.order)
            a = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.off)
            self.off += a.nbytes
            return a.astype(a.dtype.newbyteorder("="))  # a native-order copy: the memory map may close
        if vtype not in _SCALAR:
            raise GGUFFormatError(f"unknown value type {vtype}")
        return self.scalar(_SCALAR[vtype])


def read_gguf(path: str | os.PathLike, tensors: bool = True) -> GGUFFile:
    """Parse a GGUF file's metadata (and, with `tensors`, its tensor directory as views of a memory map)."""
    path = Path(path)
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise GGUFFormatError(f"{path}: empty file, not a GGUF")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    g = None
    try:
        g = _parse(path, mm, tensors)
        return g
    except GGUFFormatError:
        raise
    except (struct.error, UnicodeDecodeError, ValueError) as e:
        raise GGUFFormatError(f"{path}: malformed GGUF ({e})") from e
    finally:
        if g is None or not g.tensors:  # nothing maps the file: close it now, not at garbage collection
            try:
                mm.close()
            except BufferError:  # a view made before a failure still holds it; it closes with that view
                pass


def _parse(path: Path, mm, want_tensors: bool) -> GGUFFile:
    if len(mm) < 24 or mm[:4] != GGUF_MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file (bad magic)")
    order = "<"
    (version,) = struct.unpack_from("<I", mm, 4)
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        order = ">"
        (version,) = struct.unpack_from(">I", mm, 4)
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    c = _Cursor(mm, order)
    c.off = 8
    n_tensors, n_kv = c.u64(), c.u64()
    fields: dict = {}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = c.value(c.scalar("I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.u64() for _ in range(c.scalar("I")))
        infos.append((name, dims, c.scalar("I"), c.u64()))
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise GGUFFormatError(f"{path}: alignment {align} is not a power of two")
    data_offset = -(-c.off // align) * align
    out: list[GGUFTensor] = []
    if want_tensors and infos:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        data = np.frombuffer(mm, dtype=np.uint8)
        for name, dims, ttype, off in infos:
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            np_dims = tuple(reversed(dims))
            start = data_offset + off
            if ttype in _PLAIN:
                dt = np.dtype(_PLAIN[ttype]).newbyteorder(order)
                nbytes = n * dt.itemsize
            else:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
                if np_dims[-1] % block:
                    raise GGUFFormatError(f"{path}: tensor {name}: row of {np_dims[-1]} is not whole blocks of {block}")
                dt, nbytes = np.dtype(np.uint8), n * size // block
                np_dims = (*np_dims[:-1], np_dims[-1] // block * size)
            if start + nbytes > len(data):
                raise GGUFFormatError(f"{path}: tensor {name} runs past the end of the file")
            arr = data[start:start + nbytes].view(dt).reshape(np_dims)
            out.append(GGUFTensor(name, dims, ttype, arr))
    return GGUFFile(version, fields, out, data_offset)
