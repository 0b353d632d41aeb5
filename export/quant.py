"""Block-wise weight quantization into ONNX Runtime's MatMulNBits layout (numpy, vectorized).

Symmetric per block of `block_size` input channels: scale = signed absmax / -(2^(bits-1)), q = round(w/scale) +
2^(bits-1) clipped to [0, 2^bits - 1]; no zero-point tensor (MatMulNBits then assumes 2^(bits-1)). This is
what MLAS' own symmetric quantizer does, so the extreme value of every block is represented exactly.

Layout (MatMulNBits, com.microsoft): B uint8 [N, n_blocks, block_size*bits/8] with two 4-bit values per byte,
low nibble first; scales [N * n_blocks].
"""
from __future__ import annotations

import numpy as np


def _blocks(w: np.ndarray, block_size: int) -> np.ndarray:
    n, k = w.shape
    nb = -(-k // block_size)
    wp = np.zeros((n, nb * block_size), np.float32)
    wp[:, :k] = w
    return wp.reshape(n, nb, block_size)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[..., L] values < 2^bits → bytes, two 4-bit values per byte (low nibble first)."""
    if bits == 4:
        if q.shape[-1] % 2:
            q = np.concatenate([q, np.zeros(q.shape[:-1] + (1,), np.uint8)], -1)
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return np.ascontiguousarray(q)


def quantize_asymmetric(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Min/max per block with an integer zero point → (B, scales [N*n_blocks], zero_points uint8 packed
    [N * ceil(n_blocks*bits/8)]). Suits weights that were already asymmetric (GGUF Q4_1/Q5_1/K-quants): their
    16 levels map onto ours up to the zero point's rounding."""
    assert bits in (4, 8), bits
    blocks = _blocks(w, block_size)
    n, nb, _ = blocks.shape
    lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
    top = (1 << bits) - 1
    scale = ((hi - lo) / top).astype(np.float32)
    safe = np.where(scale == 0, 1.0, scale).astype(np.float32)
    zp = np.clip(np.rint(-lo / safe), 0, top).astype(np.uint8)
    q = np.clip(np.rint(blocks / safe[..., None]) + zp[..., None], 0, top).astype(np.uint8)
    return _pack(q, bits), scale.reshape(-1), _pack(zp, bits).reshape(-1)


def quantize_blockwise(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] (y = x @ w.T) → (B uint8 [N, n_blocks, block_size*bits//8], scales float32 [N*n_blocks])."""
    assert bits in (4, 8) and block_size >= 16 and block_size & (block_size - 1) == 0, (bits, block_size)
    blocks = _blocks(w, block_size)
    idx = np.abs(blocks).argmax(-1)
    vmax = np.take_along_axis(blocks, idx[..., None], -1)[..., 0]  # signed value of largest magnitude
    half = 1 << (bits - 1)
    scale = (vmax / -half).astype(np.float32)
    safe = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(blocks / safe[..., None]) + half, 0, (1 << bits) - 1).astype(np.uint8)
    return _pack(q, bits), scale.reshape(-1)


def dequantize_blockwise(b: np.ndarray, scales: np.ndarray, bits: int, block_size: int, k: int) -> np.ndarray:
    """Inverse of `quantize_blockwise` → [N, K] fp32 (used by tests and the parity report)."""
    n, nb, _ = b.shape
    if bits == 4:
        q = np.empty((n, nb, block_size), np.uint8)
        q[..., 0::2], q[..., 1::2] = b & 0x0F, b >> 4
    else:
        q = b
    w = (q.astype(np.float32) - (1 << (bits - 1))) * scales.reshape(n, nb, 1)
    return w.reshape(n, nb * block_size)[:, :k]
