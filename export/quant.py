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


def unpack4(b: np.ndarray, count: int) -> np.ndarray:
    """Inverse of `_pack` for 4-bit values: bytes [..., L] → the first `count` values [..., count] (low nibble first)."""
    q = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.uint8)
    q[..., 0::2], q[..., 1::2] = b & 0x0F, b >> 4
    return q[..., :count]


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


def quantize_block_min(w: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """4-bit blocks that keep a float minimum, as GGUF's Q4_1 does (w ≈ s·q + m), in MatMulNBits' layout, whose zero
    points are integers: w = s·(q − z) + r with z = round(−m/s) and the block's residual r = m + s·z (|r| ≤ s/2 when
    0 ≤ −m/s ≤ 15; otherwise r absorbs the rest). Dropping r is what an integer zero point costs (up to half a step
    on every weight of the block: top-1 0.63 against the source on SmolLM2's Q4_1 GGUF); keeping it is exact up to
    r's own 4-bit rounding.

    The residuals ride along as extra input channels: y = [x, block_sums(x)] @ [W; R]ᵀ, where block_sums_b(x) =
    Σ_{k in block b} x_k (`block_sum_matrix`) and R [N, n_blocks] holds every block's r, padded with zeros to whole
    blocks and quantized like any other block (4-bit, min/max with zero inside the range, so padding stays 0).

    → (B uint8 [N, n_blocks + extra, block_size/2], scales [N·(n_blocks + extra)], zero points packed
    [N·ceil((n_blocks + extra)/2)], extra) for K = n_blocks·block_size + extra·block_size input channels."""
    n, k = w.shape
    if k % block_size:
        raise ValueError(f"block minimum needs whole blocks: K={k}, block {block_size}")
    blocks = _blocks(w, block_size)
    nb = blocks.shape[1]
    lo, hi = blocks.min(-1), blocks.max(-1)
    scale = ((hi - lo) / 15).astype(np.float32)
    safe = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint((blocks - lo[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    zp = np.clip(np.rint(-lo / safe), 0, 15).astype(np.uint8)
    resid = (lo + scale * zp.astype(np.float32)).astype(np.float32)  # [N, nb]: exactly what z rounded away
    extra = -(-nb // block_size)
    padded = np.zeros((n, extra * block_size), np.float32)
    padded[:, :nb] = resid
    rb, rs, rz = quantize_asymmetric(padded, 4, block_size)
    rz = unpack4(rz.reshape(n, -1), extra)  # one zero point per block
    b = np.concatenate([_pack(q, 4), rb.reshape(n, extra, block_size // 2)], 1)
    s = np.concatenate([scale, rs.reshape(n, extra)], 1)
    z = np.concatenate([zp, rz], 1)
    return b, s.reshape(-1), _pack(z, 4).reshape(-1), extra


def block_sum_matrix(k: int, block_size: int, extra: int, dtype=np.float32) -> np.ndarray:
    """E [K, extra·block_size] with E[i, i // block_size] = 1: x @ E = the block sums `quantize_block_min` pairs with
    its residual columns (zeros past the last block)."""
    e = np.zeros((k, extra * block_size), dtype)
    e[np.arange(k), np.arange(k) // block_size] = 1
    return e


def dequantize_block_min(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, n: int, k: int,
                         block_size: int) -> np.ndarray:
    """The [N, K] weights a `quantize_block_min` layer computes with: s·(q − z) plus its block's de-quantized
    residual (what the tests compare the graph with)."""
    nb = k // block_size
    blocks = b.shape[1]
    q, z = unpack4(b, block_size), unpack4(zero_points.reshape(n, -1), blocks)
    full = (q.astype(np.float32) - z[..., None]) * scales.reshape(n, blocks, 1)  # [N, blocks, bs]
    resid = full[:, nb:].reshape(n, -1)[:, :nb]  # [N, nb]
    return (full[:, :nb] + resid[..., None]).reshape(n, k)


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
    q = unpack4(b, block_size) if bits == 4 else b
    w = (q.astype(np.float32) - (1 << (bits - 1))) * scales.reshape(n, nb, 1)
    return w.reshape(n, nb * block_size)[:, :k]
