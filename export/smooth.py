"""SmoothQuant-style per-channel smoothing for w8a8 (static, folded into the weights: no runtime cost).

w8a8 quantizes every activation row with one scale (its abs-max, export/graph.py `_Builder.linear_w8a8`), so a few
channels with large values set the step for all the others. Measured on the embedded model: int8 per-channel weights
with fp32 activations keep top-1 0.975 against the fp32 source, w8a8 0.85 — the activations cost most of it.

Smoothing divides input channel k of a linear layer by s_k and multiplies the weights' column k by s_k: exactly the
same function in real arithmetic, with the channels' ranges evened out before quantization (Xiao et al., SmoothQuant,
2023: s_k = max|x_k|^α / max|W_:,k|^(1−α)). The division is folded into what produces the input, so the graph is
unchanged:
- qkv and gate/up: their RMSNorm's weight (γ_k / s_k);
- o_proj: v_proj's output rows (attention output channels are weighted sums of v's; with grouped-query attention
  one v channel feeds `heads / kv_heads` heads, so those heads share one s);
- down: up_proj's output rows (the activation is silu(gate) · up).
The maxima come from the fp32 reference forward over the calibration prompts. Scales are static: a token's numbers
still depend on its own row only, so speculation stays exact.
"""
from __future__ import annotations

import numpy as np

from . import reference
from .checkpoint import Checkpoint

ALPHA = 0.5  # SmoothQuant's default migration strength
S_MIN, S_MAX = 1e-2, 1e2  # keep every channel's rescaling moderate (dead channels would otherwise get s → 0)


def activation_maxima(ck: Checkpoint, sequences, chunk: int = 1024) -> dict[str, np.ndarray]:
    """max |x_k| of every linear layer's input over all positions of `sequences` (token id lists). Sequences are
    packed into forwards of up to `chunk` tokens with a block-diagonal causal mask and positions restarting at 0
    (each sees only itself: the same numbers as one forward each, ~1.7× faster)."""
    amax: dict[str, np.ndarray] = {}

    def look(name, x):
        m = np.abs(x).max(0)
        amax[name] = m if name not in amax else np.maximum(amax[name], m)

    def run(group):
        ids = np.concatenate(group)
        seg = np.repeat(np.arange(len(group)), [len(g) for g in group])
        mask = (seg[:, None] == seg[None, :]) & np.tril(np.ones((len(ids), len(ids)), bool))
        positions = np.concatenate([np.arange(len(g)) for g in group])
        reference.forward(ck, ids, positions, mask, return_hidden=True, observe=look)  # decoder layers only

    group: list[np.ndarray] = []
    for ids in sequences:
        ids = np.asarray(ids, np.int64)
        if group and sum(map(len, group)) + len(ids) > chunk:
            run(group)
            group = []
        group.append(ids)
    if group:
        run(group)
    return amax


def _scales(amax: np.ndarray, wmax: np.ndarray, alpha: float) -> np.ndarray:
    """s_k = max|x_k|^α / max|W_:,k|^(1−α), clipped to [S_MIN, S_MAX]."""
    s = np.power(np.maximum(amax, 1e-8), alpha) / np.power(np.maximum(wmax, 1e-8), 1 - alpha)
    return np.clip(s, S_MIN, S_MAX).astype(np.float32)


def _col_max(*weights: np.ndarray) -> np.ndarray:
    return np.max([np.abs(w).max(0) for w in weights], 0)  # [K]: every weight that reads this input


def smooth(ck: Checkpoint, amax: dict[str, np.ndarray], alpha: float = ALPHA) -> Checkpoint:
    """The smoothed checkpoint: the same function, with evened-out linear inputs. The LM head is left alone
    (smoothing its input as well measured no better: top-1 0.926 against 0.936 without)."""
    c = ck.config
    w = dict(ck.weights)
    group = c.heads // c.kv_heads

    def scale(name, s, cols=(), rows=()):
        """weights[name] (a norm weight, or the rows of `rows` and their bias) / s; columns of `cols` · `col_s`."""
        for n in rows:
            w[n] = (w[n] / s[:, None]).astype(np.float32)
            bias = n.replace(".weight", ".bias")
            if bias in w:
                w[bias] = (w[bias] / s).astype(np.float32)
        if name:
            w[name] = (w[name] / s).astype(np.float32)
        for n, col_s in cols:
            w[n] = (w[n] * col_s[None, :]).astype(np.float32)

    # o_proj's input channel (head h, dim d) is v's output channel (h // group, d): heads sharing a v channel share
    # its s
    by_v = lambda x: x.reshape(c.kv_heads, group, c.head_dim).max(1).reshape(-1)  # noqa: E731
    for i in range(c.layers):
        p = f"model.layers.{i}."
        qkv = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        s = _scales(amax[f"{i}.qkv"], _col_max(*(w[n] for n in qkv)), alpha)
        scale(p + "input_layernorm.weight", s, cols=[(n, s) for n in qkv])

        o = p + "self_attn.o_proj.weight"
        s_v = _scales(by_v(amax[f"{i}.o"]), by_v(_col_max(w[o])), alpha)
        s_o = np.repeat(s_v.reshape(c.kv_heads, 1, c.head_dim), group, 1).reshape(-1)
        scale(None, s_v, cols=[(o, s_o)], rows=[p + "self_attn.v_proj.weight"])

        gu = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        s = _scales(amax[f"{i}.gate_up"], _col_max(*(w[n] for n in gu)), alpha)
        mlp_norm = "pre_feedforward_layernorm" if c.family == "gemma3" else "post_attention_layernorm"
        scale(p + mlp_norm + ".weight", s, cols=[(n, s) for n in gu])

        down = p + "mlp.down_proj.weight"
        s = _scales(amax[f"{i}.down"], _col_max(w[down]), alpha)
        scale(None, s, cols=[(down, s)], rows=[p + "mlp.up_proj.weight"])
    return Checkpoint(ck.config, w, ck.source, ck.source_format)
