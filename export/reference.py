"""Slow fp32 numpy forward pass of the llama/qwen2/gemma3 families: the "source logits" of every parity report.

Written straight from the architecture (not from the ONNX graph), so parity compares two independent
implementations. Tests check this reference against transformers on tiny random checkpoints.
"""
from __future__ import annotations

import numpy as np

from .checkpoint import Checkpoint


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.float32(np.sqrt(2 / np.pi)) * (x + np.float32(0.044715) * x * x * x)))


def _rotate(x: np.ndarray, pos: np.ndarray, inv: np.ndarray) -> np.ndarray:
    # x [H, S, D], pos [S], inv [D/2] (ArchConfig.inv_freq); half-split (non-interleaved) rotary as in HF llama
    d = x.shape[-1]
    ang = pos[:, None].astype(np.float64) * inv[None, :]  # [S, D/2]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def forward(ck: Checkpoint, ids, positions=None, mask=None, layers: int | None = None,
            adapter: np.ndarray | None = None, return_hidden: bool = False, observe=None) -> np.ndarray:
    """ids [S] → logits [S, V]. `positions` [S] default 0..S-1; `mask` bool [S, S] (True = may attend),
    default causal. `layers` < config.layers gives the early-exit drafter's logits (final norm + LM head);
    `adapter` [H, H] is applied to the residual stream before the final norm; `return_hidden` returns the
    residual stream [S, H] after the last layer run instead of logits. `observe(name, x)`, if given, sees every
    linear layer's input [S, K] (names "{layer}.qkv", ".o", ".gate_up", ".down"; export/smooth.py's statistics)."""
    look = observe or (lambda name, x: None)
    c = ck.config
    ids = np.asarray(ids, dtype=np.int64)
    S = ids.shape[0]
    pos = np.arange(S) if positions is None else np.asarray(positions)
    allow = np.tril(np.ones((S, S), bool)) if mask is None else np.asarray(mask, bool)
    bias = np.where(allow, 0.0, -np.inf).astype(np.float32)
    # sliding layers (Gemma 3): a query also may not see keys `sliding_window` or more positions behind it
    window_bias = np.where(allow & (pos[:, None] - pos[None, :] < c.sliding_window), 0.0, -np.inf).astype(
        np.float32) if c.sliding_window else bias
    w = ck.weights
    gemma = c.family == "gemma3"
    h = w["model.embed_tokens.weight"][ids] * np.float32(c.embed_scale)
    group = c.heads // c.kv_heads
    for i in range(c.layers if layers is None else layers):
        L = lambda n: w[f"model.layers.{i}.{n}"]  # noqa: E731
        inv = c.inv_freq(i)
        x = _rms(h, L("input_layernorm.weight"), c.rms_eps)
        look(f"{i}.qkv", x)
        q, k, v = (x @ L(f"self_attn.{n}_proj.weight").T for n in "qkv")
        if c.qkv_bias:
            q, k, v = q + L("self_attn.q_proj.bias"), k + L("self_attn.k_proj.bias"), v + L("self_attn.v_proj.bias")
        q = q.reshape(S, c.heads, c.head_dim).transpose(1, 0, 2)
        k = k.reshape(S, c.kv_heads, c.head_dim).transpose(1, 0, 2)
        if gemma:  # QK-norm: an RMSNorm over each head, before the rotation
            q, k = _rms(q, L("self_attn.q_norm.weight"), c.rms_eps), _rms(k, L("self_attn.k_norm.weight"), c.rms_eps)
        q, k = _rotate(q, pos, inv), _rotate(k, pos, inv)
        v = v.reshape(S, c.kv_heads, c.head_dim).transpose(1, 0, 2)
        k, v = np.repeat(k, group, 0), np.repeat(v, group, 0)
        s = q @ k.transpose(0, 2, 1) * np.float32(c.softmax_scale) + (window_bias if c.is_sliding(i) else bias)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(S, -1)  # [S, H·D]
        look(f"{i}.o", a)
        o = a @ L("self_attn.o_proj.weight").T
        if gemma:
            h = h + _rms(o, L("post_attention_layernorm.weight"), c.rms_eps)
            x = _rms(h, L("pre_feedforward_layernorm.weight"), c.rms_eps)
        else:
            h = h + o
            x = _rms(h, L("post_attention_layernorm.weight"), c.rms_eps)
        look(f"{i}.gate_up", x)
        g = x @ L("mlp.gate_proj.weight").T
        gate = _gelu_tanh(g) if gemma else g / (1 + np.exp(-g))
        act = gate * (x @ L("mlp.up_proj.weight").T)
        look(f"{i}.down", act)
        m = act @ L("mlp.down_proj.weight").T
        h = h + (_rms(m, L("post_feedforward_layernorm.weight"), c.rms_eps) if gemma else m)
    if return_hidden:
        return h
    if adapter is not None:
        h = h @ adapter
    return _rms(h, w["model.norm.weight"], c.rms_eps) @ ck.lm_head.T
