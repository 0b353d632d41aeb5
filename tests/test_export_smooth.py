"""export/smooth.py: SmoothQuant-style smoothing folded into the weights for w8a8.

Kinds: the smoothed checkpoint computes the same function (fp32 reference, llama and qwen2 with its v bias, grouped
heads); it evens out the channels it claims to; on a checkpoint with outlier channels (planted without changing the
function) the w8a8 graph of the smoothed checkpoint follows the fp32 source much better; the export records it and
`--no-smooth` turns it off.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import VOCAB, tiny_export_options
from export import reference, smooth
from export.checkpoint import Checkpoint, load_hf_dir
from export.evaluate import GraphRunner
from export.graph import GraphOptions, build_graph, save_model


def prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(20, 50))) for _ in range(n)]


def with_outliers(ck: Checkpoint, factor: float = 40.0, channels=(3, 17, 40)) -> Checkpoint:
    """The same function with a few input channels of every qkv and gate/up input scaled up by `factor` (their
    RMSNorm weight × factor, the weights' columns ÷ factor): the activation outliers real LLMs have, which a per-row
    int8 scale spends its range on."""
    w = dict(ck.weights)
    idx = np.asarray(channels)
    for i in range(ck.config.layers):
        p = f"model.layers.{i}."
        for norm, cols in (("input_layernorm.weight", [f"self_attn.{n}_proj.weight" for n in "qkv"]),
                           ("post_attention_layernorm.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"])):
            g = w[p + norm].copy()
            g[idx] *= factor
            w[p + norm] = g
            for n in cols:
                m = w[p + n].copy()
                m[:, idx] /= factor
                w[p + n] = m
    return Checkpoint(ck.config, w, ck.source, ck.source_format)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_smoothing_keeps_the_function(checkpoint_dirs, family):
    ck = load_hf_dir(checkpoint_dirs[family])
    seqs = prompts()
    amax = smooth.activation_maxima(ck, seqs[:4])
    sm = smooth.smooth(ck, amax)
    changed = [n for n in ck.weights if not np.array_equal(ck.weights[n], sm.weights[n])]
    assert any("v_proj" in n for n in changed) and any("up_proj" in n for n in changed)
    assert any("layernorm" in n for n in changed)
    if ck.config.qkv_bias:
        assert any(n.endswith("v_proj.bias") for n in changed)
    for ids in seqs:
        want = reference.forward(ck, ids)
        np.testing.assert_allclose(reference.forward(sm, ids), want, atol=2e-4 * np.abs(want).max(), rtol=0)


def test_smoothing_evens_out_the_channels(tiny_llama):
    """Per linear input, max over channels of max|x_k| / its median: far lower after smoothing when outliers are
    planted (it is what the per-row int8 step depends on)."""
    ck = with_outliers(tiny_llama)
    seqs = prompts()
    before = smooth.activation_maxima(ck, seqs)
    after = smooth.activation_maxima(smooth.smooth(ck, before), seqs)
    spread = lambda a: float(a.max() / np.median(a))  # noqa: E731
    for name in ("0.qkv", "1.gate_up"):
        assert spread(after[name]) < spread(before[name]) / 4, (name, spread(before[name]), spread(after[name]))


def test_smoothed_w8a8_follows_the_source_despite_outliers(tiny_llama, tmp_path):
    """w8a8 graphs of a checkpoint with outlier channels: without smoothing the per-row int8 activations lose much
    of the signal; the smoothed checkpoint's graph stays close to the fp32 source (measured here: top-1 0.92
    against 0.53, mean |Δlogit| 10× lower)."""
    ck = with_outliers(tiny_llama)
    seqs = prompts(8, seed=1)
    calib, held = seqs[:5], seqs[5:]
    agree, err = {}, {}
    for name, c in (("plain", ck), ("smoothed", smooth.smooth(ck, smooth.activation_maxima(ck, calib)))):
        p = tmp_path / name / "model.onnx"
        p.parent.mkdir()
        save_model(build_graph(c, GraphOptions(precision="w8a8", max_len=128)), str(p))
        r = GraphRunner(str(p), c.config.layers, c.config.kv_heads, c.config.head_dim)
        got = [r.logits(ids) for ids in held]
        want = [reference.forward(ck, ids) for ids in held]
        agree[name] = float(np.mean(np.concatenate([g.argmax(-1) == w.argmax(-1) for g, w in zip(got, want)])))
        err[name] = float(np.mean([np.abs(g - w).mean() for g, w in zip(got, want)]))
    assert agree["smoothed"] >= 0.9 and agree["smoothed"] > agree["plain"] + 0.1, agree
    assert err["smoothed"] < err["plain"] / 2, err


@pytest.mark.parametrize("on", [True, False])
def test_w8a8_export_records_its_smoothing(tmp_path, tiny_llama_dir, on):
    from export.pipeline import export_model

    m = export_model(tiny_llama_dir, tmp_path / "out",
                     tiny_export_options(precision="w8a8", smooth=on, drafters=(), parity=False), progress=False)
    s = m.target.stats.get("smoothing")
    assert (s is not None) is on
    if on:
        assert s["alpha"] == smooth.ALPHA and s["prompts"] > 0


def test_other_precisions_are_not_smoothed(tmp_path, tiny_llama_dir):
    """int4 keeps the source's own block grid (export.quant.quantize_block_min): smoothing would move the weights
    off it, and MatMulNBits' per-block activation scales need it less."""
    from export.pipeline import export_model

    m = export_model(tiny_llama_dir, tmp_path / "out", tiny_export_options(precision="int4", drafters=(), parity=False),
                     progress=False)
    assert "smoothing" not in m.target.stats


def test_packed_maxima_equal_one_forward_per_sequence(tiny_llama):
    """activation_maxima packs sequences into one forward (block-diagonal mask, positions from 0 each): the same
    maxima as running them one by one, whatever the packing."""
    seqs = prompts(7, seed=3)
    one = {}
    for ids in seqs:
        for k, v in smooth.activation_maxima(tiny_llama, [ids]).items():
            one[k] = v if k not in one else np.maximum(one[k], v)
    for chunk in (1, 60, 10_000):
        packed = smooth.activation_maxima(tiny_llama, seqs, chunk=chunk)
        assert packed.keys() == one.keys()
        for k in one:
            np.testing.assert_allclose(packed[k], one[k], rtol=1e-5, atol=1e-6)


def _abs_maxima(ck: Checkpoint, seqs) -> dict[str, np.ndarray]:
    """max |x_k| of every linear input, one reference forward per sequence (independent of smooth.py)."""
    out: dict[str, np.ndarray] = {}

    def look(name, x):
        m = np.abs(x).max(0)
        out[name] = m if name not in out else np.maximum(out[name], m)

    for ids in seqs:
        reference.forward(ck, ids, return_hidden=True, observe=look)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_smoothing_balances_activation_and_weight_ranges(checkpoint_dirs, family):
    """SmoothQuant with α = 0.5 (no clipping on this checkpoint): each linear input channel k is divided by
    s_k = sqrt(max|x_k| / max|W_:,k|) (maxima over the calibration text and over the source weights that read k), so
    afterwards max|x_k| = sqrt(max|x_k| · max|W_:,k|). For o_proj, per v channel: the heads that share a v channel
    share its s. Activation maxima measured here with one reference forward per sequence, independently of
    smooth.py."""
    ck = load_hf_dir(checkpoint_dirs[family])
    c = ck.config
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, VOCAB, int(rng.integers(20, 40))) for _ in range(4)]
    sm = smooth.smooth(ck, smooth.activation_maxima(ck, seqs))
    before, after = _abs_maxima(ck, seqs), _abs_maxima(sm, seqs)
    w = ck.weights  # the source's weights: each group's s is computed from them
    group = c.heads // c.kv_heads
    by_v = lambda x: x.reshape(c.kv_heads, group, c.head_dim).max(1).reshape(-1)  # noqa: E731
    colmax = lambda *ns: np.max([np.abs(w[n]).max(0) for n in ns], 0)  # noqa: E731
    assert smooth.ALPHA == 0.5
    for i in range(c.layers):
        p = f"model.layers.{i}."
        pairs = {
            "qkv": (before[f"{i}.qkv"], after[f"{i}.qkv"], colmax(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"))),
            "o": (by_v(before[f"{i}.o"]), by_v(after[f"{i}.o"]), by_v(colmax(p + "self_attn.o_proj.weight"))),
            "gate_up": (before[f"{i}.gate_up"], after[f"{i}.gate_up"],
                        colmax(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
            "down": (before[f"{i}.down"], after[f"{i}.down"], colmax(p + "mlp.down_proj.weight")),
        }
        for name, (a0, a1, wm) in pairs.items():
            s = np.sqrt(a0 / wm)
            assert s.min() > smooth.S_MIN and s.max() < smooth.S_MAX  # no clipping here
            np.testing.assert_allclose(a1, np.sqrt(a0 * wm), rtol=2e-3, err_msg=f"layer {i} {name}")
