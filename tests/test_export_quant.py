"""Block-wise quantization (`export/quant.py`) and the quantized graphs it feeds.

Kinds: round-trip error bounds (symmetric and asymmetric) with hypothesis; the packed layout against a slow
per-element reference; MatMulNBits itself (one-node ONNX graphs) as the consumer of that layout; and the int8/int4/
fp16 graphs of the tiny llama against (a) the numpy reference run on the *de-quantized* weights, which isolates the
graph from quantization error, and (b) the fp32 reference, with top-1 bounds measured on this checkpoint.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from conftest import VOCAB, build_checkpoint
from export import reference
from export.checkpoint import Checkpoint, load_hf_dir
from export.evaluate import GraphRunner
from export.graph import IR_VERSION, GraphOptions, build_graph, save_model
from export.quant import (block_sum_matrix, dequantize_block_min, dequantize_blockwise, quantize_asymmetric,
                          quantize_block_min, quantize_blockwise, unpack4)

PROPERTY = settings(max_examples=60, deadline=None, database=None)


def unpack(b: np.ndarray, bits: int, length: int) -> np.ndarray:
    """Bytes [..., L] → values [..., length] (4-bit: low nibble first), by explicit per-element loop."""
    if bits == 8:
        return b[..., :length].astype(np.int64)
    flat = b.reshape(-1, b.shape[-1])
    out = np.zeros((flat.shape[0], length), np.int64)
    for r in range(flat.shape[0]):
        for j in range(length):
            byte = int(flat[r, j // 2])
            out[r, j] = (byte >> 4) if j % 2 else (byte & 0x0F)
    return out.reshape(b.shape[:-1] + (length,))


def dequantize_asymmetric(b, scales, zp, bits: int, block_size: int, n: int, k: int) -> np.ndarray:
    nb = -(-k // block_size)
    q = unpack(b, bits, block_size)  # [N, nb, bs]
    z = unpack(zp.reshape(n, -1), bits, nb)  # [N, nb]: each row's zero points padded to whole bytes
    return ((q - z[..., None]) * scales.reshape(n, nb, 1)).reshape(n, -1)[:, :k].astype(np.float32)


def slow_quantize(w, bits: int, block_size: int, symmetric: bool):
    """Per-element reference of the documented formulas → (q [N, nb, bs] ints, scale [N, nb], zp [N, nb])."""
    n, k = w.shape
    nb = -(-k // block_size)
    q = np.zeros((n, nb, block_size), np.int64)
    scale = np.zeros((n, nb))
    zp = np.zeros((n, nb), np.int64)
    top = (1 << bits) - 1
    for r in range(n):
        for c in range(nb):
            blk = [float(w[r, c * block_size + j]) if c * block_size + j < k else 0.0 for j in range(block_size)]
            if symmetric:
                vmax = max(blk, key=abs)  # first of largest magnitude, sign kept
                s = np.float32(vmax / -(1 << (bits - 1)))
                z = 1 << (bits - 1)
            else:
                lo, hi = min(min(blk), 0.0), max(max(blk), 0.0)
                s = np.float32((np.float32(hi) - np.float32(lo)) / top)
                z = int(min(max(np.rint(-np.float32(lo) / (s or np.float32(1))), 0), top))
            safe = s if s != 0 else np.float32(1)
            for j, v in enumerate(blk):
                q[r, c, j] = int(min(max(np.rint(np.float32(v) / safe) + z, 0), top))
            scale[r, c], zp[r, c] = s, z
    return q, scale, zp


# ----------------------------------------------------------------------------- layout and round trips

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,block", [(3, 64, 32), (5, 70, 16), (2, 96, 32), (1, 40, 64)])
def test_packing_matches_slow_reference(bits, symmetric, n, k, block):
    w = np.random.default_rng(n * k + bits).standard_normal((n, k)).astype(np.float32)
    w[0, :5] = 0.0
    q, scale, zp = slow_quantize(w, bits, block, symmetric)
    nb = q.shape[1]
    if symmetric:
        b, s = quantize_blockwise(w, bits, block)
    else:
        b, s, z = quantize_asymmetric(w, bits, block)
        assert z.dtype == np.uint8 and z.shape == (n * -(-nb * bits // 8),)
        np.testing.assert_array_equal(unpack(z.reshape(n, -1), bits, nb), zp)
    assert b.dtype == np.uint8 and b.shape == (n, nb, block * bits // 8)
    assert s.dtype == np.float32 and s.shape == (n * nb,)
    np.testing.assert_array_equal(unpack(b, bits, block), q)
    np.testing.assert_allclose(s.reshape(n, nb), scale, rtol=1e-6, atol=0)


@PROPERTY
@given(st.integers(1, 6), st.integers(1, 130), st.sampled_from([16, 32, 64]), st.sampled_from([4, 8]),
       st.integers(0, 2**31 - 1), st.floats(1e-3, 1e3))
def test_symmetric_round_trip_bound(n, k, block, bits, seed, amp):
    w = (amp * np.random.default_rng(seed).standard_normal((n, k))).astype(np.float32)
    b, s = quantize_blockwise(w, bits, block)
    back = dequantize_blockwise(b, s, bits, block, k)
    assert back.shape == w.shape
    nb = b.shape[1]
    step = np.abs(np.repeat(s.reshape(n, nb), block, 1)[:, :k])
    err = np.abs(back - w)
    # half a step inside the grid; the grid is [-half, half-1]·step, so a value of the opposite sign to the block's
    # extreme with magnitude near it is clipped by up to one step (MLAS' symmetric scheme does the same)
    half = 1 << (bits - 1)
    inside = np.abs(w) <= (half - 0.5) * step
    # + one float32 ulp of the value: the dequantized q·scale is itself rounded to float32 (at |w| ≈ 519, 6e-5 —
    # more than the 1e-5 relative slack on a 6.4 step, which hypothesis found)
    ulp = np.spacing(np.abs(w))
    assert np.all(err[inside] <= step[inside] * 0.5 * (1 + 1e-5) + ulp[inside])
    assert np.all(err <= step * (1 + 1e-5) + ulp)
    blocks = np.pad(w, ((0, 0), (0, nb * block - k))).reshape(n, nb, block)
    idx = np.abs(blocks).argmax(-1)
    flat = np.pad(back, ((0, 0), (0, nb * block - k))).reshape(n, nb, block)
    extreme = idx[..., None]
    np.testing.assert_allclose(np.take_along_axis(flat, extreme, -1), np.take_along_axis(blocks, extreme, -1), rtol=1e-6)


@PROPERTY
@given(st.integers(1, 6), st.integers(1, 130), st.sampled_from([16, 32, 64]), st.sampled_from([4, 8]),
       st.integers(0, 2**31 - 1), st.floats(-2.0, 2.0))
def test_asymmetric_round_trip_bound(n, k, block, bits, seed, shift):
    w = (np.random.default_rng(seed).standard_normal((n, k)) + shift).astype(np.float32)  # skewed blocks
    b, s, z = quantize_asymmetric(w, bits, block)
    back = dequantize_asymmetric(b, s, z, bits, block, n, k)
    nb = b.shape[1]
    step = np.repeat(s.reshape(n, nb), block, 1)[:, :k]
    assert np.all(np.abs(back - w) <= step * 0.5 * (1 + 1e-4) + 1e-6)


def q4_1_weights(n: int, k: int, block: int, seed: int, shift: float = 0.0) -> np.ndarray:
    """Weights already on a Q4_1 grid, as the embedded GGUF stores them: per block w = d·q + m with q in 0..15
    spanning the whole range, a float scale d and a float minimum m (rarely a multiple of d)."""
    rng = np.random.default_rng(seed)
    nb = k // block
    q = rng.integers(0, 16, (n, nb, block))
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's d = (max - min)/15, m = min: both ends are used
    d = rng.uniform(0.005, 0.05, (n, nb, 1))
    m = -d * rng.uniform(0, 15, (n, nb, 1)) + shift * d * 15
    return (d * q + m).astype(np.float32).reshape(n, k)


@PROPERTY
@given(st.integers(1, 6), st.sampled_from([1, 2, 3, 5, 33]), st.sampled_from([16, 32]), st.integers(0, 2**31 - 1),
       st.sampled_from([0.0, 0.7, -0.7, 2.0]))
def test_block_min_reproduces_q4_1_weights(n, nblocks, block, seed, shift):
    """Q4_1-style blocks (float minimum, both ends of the 4-bit range used) come back to within the residual's own
    4-bit rounding, while integer zero points (what MatMulNBits stores) miss by up to half a weight step — the
    difference between top-1 0.95 and 0.63 on the embedded model. Shifted minimums give all-positive / all-negative
    blocks (the zero point clips, the residual takes the rest; still within the residual's rounding)."""
    k = nblocks * block
    w = q4_1_weights(n, k, block, seed, shift)
    b, s, z, extra = quantize_block_min(w, block)
    assert extra == -(-nblocks // block) and b.shape == (n, nblocks + extra, block // 2)
    back = dequantize_block_min(b, s, z, n, k, block)
    blocks = w.reshape(n, nblocks, block)
    d = (blocks.max(-1) - blocks.min(-1)) / 15  # [n, nb]
    resid = blocks.min(-1) + d * np.clip(np.rint(-blocks.min(-1) / d), 0, 15)
    r_step = (np.maximum(resid.max(1), 0) - np.minimum(resid.min(1), 0)) / 15  # [n]: the residual blocks' step
    err = np.abs(back - w).reshape(n, nblocks, block)
    assert np.all(err <= r_step[:, None, None] * 0.5 * (1 + 1e-4) + 1e-6 + 1e-5 * d[..., None])
    if shift == 0:  # every block straddles zero (as trained weights do): |r| ≤ d/2, so the error is ≤ d/30
        assert err.max() <= d.max() / 30 * (1 + 1e-3) + 1e-6
        int_zp = dequantize_asymmetric(*quantize_asymmetric(w, 4, block), 4, block, n, k)
        assert np.abs(back - w).mean() < np.abs(int_zp - w).mean() / 4


def test_block_min_edge_blocks():
    """A constant block (scale 0), a block of zeros, and the K check."""
    w = np.zeros((3, 64), np.float32)
    w[0, :32] = 0.37  # constant and positive: all of it is residual
    w[1, 32:] = -1.25
    b, s, z, extra = quantize_block_min(w, 32)
    back = dequantize_block_min(b, s, z, 3, 64, 32)
    np.testing.assert_allclose(back, w, atol=1.25 / 15 / 2 + 1e-6)
    np.testing.assert_array_equal(back[2], 0)  # zero rows stay exactly zero
    with pytest.raises(ValueError, match="whole blocks"):
        quantize_block_min(np.ones((2, 40), np.float32), 32)


def test_block_sum_matrix():
    x = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
    e = block_sum_matrix(96, 32, 1)
    assert e.shape == (96, 32)
    # a BLAS may sum the 32 terms in another order than numpy's reduction: equal to float rounding, not bit for bit
    np.testing.assert_allclose(x @ e[:, :3], x.reshape(3, 3, 32).sum(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(x @ e[:, 3:], 0)


def test_zero_blocks_stay_zero():
    w = np.zeros((2, 64), np.float32)
    w[1, 32:] = np.linspace(-1, 1, 32)
    for bits in (4, 8):
        b, s = quantize_blockwise(w, bits, 32)
        back = dequantize_blockwise(b, s, bits, 32, 64)
        assert np.all(np.isfinite(back)) and np.all(back[0] == 0) and np.all(back[1, :32] == 0)
        b, s, z = quantize_asymmetric(w, bits, 32)
        back = dequantize_asymmetric(b, s, z, bits, 32, 2, 64)
        assert np.all(np.isfinite(back)) and np.all(back[0] == 0) and np.all(back[1, :32] == 0)


def test_symmetric_rejects_bad_block():
    with pytest.raises(AssertionError):
        quantize_blockwise(np.ones((2, 32), np.float32), 4, 24)


# ----------------------------------------------------------------------------- MatMulNBits as the consumer

def matmul_nbits(x, w, bits, block, symmetric) -> np.ndarray:
    """One MatMulNBits node (accuracy_level 0: fp32 activations) over our packed weights."""
    import onnxruntime as ort

    n, k = w.shape
    if symmetric:
        b, s = quantize_blockwise(w, bits, block)
        extra = []
    else:
        b, s, z = quantize_asymmetric(w, bits, block)
        extra = [numpy_helper.from_array(z, "zp")]
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(s, "scales")] + extra
    node = helper.make_node("MatMulNBits", ["x", "B", "scales"] + (["zp"] if extra else []), ["y"],
                            domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, accuracy_level=0)
    g = helper.make_graph([node], "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = IR_VERSION
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {"x": x})[0]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,block", [(24, 64, 32), (10, 80, 16), (7, 160, 32), (6, 256, 128)])
def test_matmulnbits_reads_our_layout(bits, symmetric, n, k, block):
    rng = np.random.default_rng(k + n)
    w = (rng.standard_normal((n, k)) + 0.5).astype(np.float32)
    x = rng.standard_normal((5, k)).astype(np.float32)
    if symmetric:
        deq = dequantize_blockwise(*quantize_blockwise(w, bits, block), bits, block, k)
    else:
        deq = dequantize_asymmetric(*quantize_asymmetric(w, bits, block), bits, block, n, k)
    np.testing.assert_allclose(matmul_nbits(x, w, bits, block, symmetric), x @ deq.T, atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------- w8a8: MatMulIntegerToFloat

def w8a8_linear(x, w, kernel: str | None = None) -> np.ndarray:
    """The exporter's w8a8 linear (per-row int8 activations, per-channel int8 weights) as a one-op-chain graph;
    `kernel` None: the weight layout an export on this host writes."""
    import onnxruntime as ort

    from export.graph import OPSET, _Builder

    b = _Builder(GraphOptions(precision="w8a8", w8a8_kernel=kernel), TensorProto.FLOAT)
    y = b.linear("x", w, "lin", 8)
    n, k = w.shape
    g = helper.make_graph(b.nodes, "w8a8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, k])],
                          [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, None, n])], initializer=b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = IR_VERSION
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x[None]})[0][0]


def w8a8_numpy(x, w) -> np.ndarray:
    """The same arithmetic in numpy: symmetric int8 per output channel, uint8 around 128 per row (QuantizeLinear:
    x / scale rounded half to even)."""
    ws = np.abs(w).max(1) / 127
    wq = np.clip(np.rint(w / ws[:, None]), -127, 127)
    m = np.abs(x).max(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero row: NaN codes, multiplied by m = 0 below
        q = np.rint(x / (m / 127))
    return (q @ wq.T) * (ws / 127) * m


def test_w8a8_linear_is_the_integer_arithmetic_it_claims():
    """Rows with an outlier, tiny values and one of zeros: ORT's graph equals the numpy arithmetic (float rounding
    only), a zero row gives zeros, and the error against the float product stays within int8's resolution."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    x = rng.standard_normal((6, 96)).astype(np.float32)
    x[1, 7] = 40.0  # an outlier channel: its row's scale is set by it
    x[2] *= 1e-6
    x[3] = 0.0
    got = w8a8_linear(x, w)
    want = w8a8_numpy(x.astype(np.float64), w.astype(np.float64))
    want[3] = 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not np.any(got[3])
    exact = x @ w.T
    rel = np.abs(got - exact).max(1) / np.abs(exact).max(1).clip(1e-30)
    assert rel[[0, 2, 4, 5]].max() < 0.03, rel


@pytest.mark.parametrize("kernel", ["u8s8", "u8u8"])
def test_w8a8_kernels_where_pairs_of_products_overflow_int16(kernel):
    """Adjacent weights at ±127 and activation codes near 255: a pair of products reaches 2·255·127 > 32767. MLAS'
    u8s8 kernel on x86 without VNNI adds such pairs in saturating int16 (vpmaddubsw); its u8u8 kernel widens first.
    So uint8 weights must give the exact integer arithmetic on every host, and int8 weights exactly where
    `devices.int8_gemm_exact` says so — the probe the export's default layout is chosen by."""
    from devices import int8_gemm_exact

    rng = np.random.default_rng(9)
    w = np.sign(rng.standard_normal((16, 64))).astype(np.float32)  # every weight at its channel's max: ±127
    x = (np.abs(rng.standard_normal((3, 64))) + 4).astype(np.float32)  # codes 200-255: far above the zero point
    got = w8a8_linear(x, w, kernel)
    want = w8a8_numpy(x.astype(np.float64), w.astype(np.float64))
    exact = np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert exact if kernel == "u8u8" else exact == int8_gemm_exact(), np.abs(got - want).max()


def test_w8a8_kernel_is_chosen_by_the_host_and_recorded(monkeypatch):
    """ExportOptions resolves the w8a8 layout from the host probe once, so the manifest records (and a cached default
    export is compared on) what was written; an explicit choice wins; other precisions record none."""
    import devices
    from export.pipeline import ExportOptions

    for exact, kernel in ((True, "u8s8"), (False, "u8u8")):
        monkeypatch.setattr(devices, "int8_gemm_exact", lambda exact=exact: exact)
        opts = ExportOptions(precision="w8a8")
        assert opts.w8a8_kernel == kernel and opts.recorded()["w8a8_kernel"] == kernel
        assert opts.graph_options(64).w8a8_kernel == kernel
        assert ExportOptions(precision="w8a8", w8a8_kernel="u8s8").w8a8_kernel == "u8s8"
    assert "w8a8_kernel" not in ExportOptions(precision="int4").recorded()
    with pytest.raises(ValueError, match="w8a8_kernel"):
        GraphOptions(precision="w8a8", w8a8_kernel="s8s8")


def test_w8a8_rows_do_not_depend_on_the_other_rows():
    """Each row's result is bit-identical alone and among others (integer sums, per-row scales): the property that
    makes speculation lossless with int8 activations."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    x = rng.standard_normal((17, 128)).astype(np.float32)
    together = w8a8_linear(x, w)
    for i in (0, 5, 16):
        np.testing.assert_array_equal(w8a8_linear(x[i : i + 1], w)[0], together[i])
        np.testing.assert_array_equal(w8a8_linear(x[i : i + 3], w)[0], together[i])
    # negative control: one activation scale per call (DynamicQuantizeMatMul, "int8 dynamic" exports) does depend
    # on the other rows
    import onnxruntime as ort

    ws = (np.abs(w).max(1) / 127).astype(np.float32)
    wq = np.clip(np.rint(w / ws[:, None]), -127, 127).astype(np.int8).T
    node = helper.make_node("DynamicQuantizeMatMul", ["x", "B", "s"], ["y"], domain="com.microsoft")
    g = helper.make_graph([node], "dq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 128])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 64])],
                          initializer=[numpy_helper.from_array(np.ascontiguousarray(wq), "B"),
                                       numpy_helper.from_array(ws, "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = IR_VERSION
    dq = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    assert not np.array_equal(dq.run(None, {"x": x[:1]})[0][0], dq.run(None, {"x": x})[0][0])


# ----------------------------------------------------------------------------- quantized graphs of the tiny llama

def dequantized_checkpoint(ck: Checkpoint, bits: int, head_bits: int, block: int, symmetric: bool,
                           block_min: bool = True) -> Checkpoint:
    """The checkpoint with every Linear, the LM head and the embedding (stored like the head) replaced by its
    quantize→dequantize image (4-bit linears with their blocks' float minimums unless `block_min` is off; the
    embedding's rows always with integer zero points)."""
    def qd(w, b, linear=True):
        n, k = w.shape
        if symmetric:
            return dequantize_blockwise(*quantize_blockwise(w, b, block), b, block, k)
        if linear and block_min and b == 4:
            return dequantize_block_min(*quantize_block_min(w, block)[:3], n, k, block)
        return dequantize_asymmetric(*quantize_asymmetric(w, b, block), b, block, n, k)

    w = {k: (qd(v, bits) if k.endswith("_proj.weight") else v) for k, v in ck.weights.items()}
    w["lm_head.weight"] = qd(ck.lm_head, head_bits)
    w["model.embed_tokens.weight"] = qd(ck.weights["model.embed_tokens.weight"], head_bits, linear=False)
    return Checkpoint(ck.config, w, ck.source, ck.source_format)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(42)
    return [rng.integers(0, VOCAB, n) for n in (60, 45, 70, 30)]


@pytest.fixture(scope="module")
def graph_file(tiny_llama, tmp_path_factory):
    cache = {}

    def get(**opts):
        key = tuple(sorted(opts.items()))
        if key not in cache:
            p = tmp_path_factory.mktemp("q") / "model.onnx"
            save_model(build_graph(tiny_llama, GraphOptions(max_len=128, **opts)), str(p))
            cache[key] = p
        return cache[key]

    return get


def runner(path, ck, kv_dtype=np.float32) -> GraphRunner:
    c = ck.config
    return GraphRunner(str(path), c.layers, c.kv_heads, c.head_dim, kv_dtype=kv_dtype)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantized_graph_equals_dequantized_reference(tiny_llama, graph_file, prompts, precision, symmetric):
    """fp32 activations: the int graph is exactly the reference on de-quantized weights (graph ≡ arithmetic). One
    8-bit head here; the two-stage head's arithmetic is the next test's."""
    bits = int(precision[3:])
    qck = dequantized_checkpoint(tiny_llama, bits, 8, 32, symmetric)
    r = runner(graph_file(precision=precision, symmetric=symmetric, accuracy_level=0, head_rescore=0), tiny_llama)
    for ids in prompts:
        np.testing.assert_allclose(r.logits(ids), reference.forward(qck, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_two_stage_head_equals_its_arithmetic(tiny_llama, graph_file, prompts, precision, symmetric):
    """fp32 activations: the two-stage head's logits are the coarse head's (4-bit symmetric blocks of 32), except
    at each row's `head_rescore` best coarse logits, which are the 8-bit embedding rows' dot products."""
    bits = int(precision[3:])
    opts = GraphOptions(precision=precision, symmetric=symmetric, accuracy_level=0, max_len=128)
    qck = dequantized_checkpoint(tiny_llama, bits, 8, 32, symmetric)  # head = the embedding's 8-bit rows
    coarse_w = dequantize_blockwise(*quantize_blockwise(tiny_llama.lm_head, 4, 32), 4, 32, tiny_llama.config.hidden)
    cck = Checkpoint(qck.config, {**qck.weights, "lm_head.weight": coarse_w}, qck.source, qck.source_format)
    r = runner(graph_file(precision=precision, symmetric=symmetric, accuracy_level=0), tiny_llama)
    for ids in prompts[:2]:
        coarse, exact = reference.forward(cck, ids), reference.forward(qck, ids)
        cand = np.argsort(-coarse, axis=1, kind="stable")[:, :opts.head_rescore]
        want = coarse.copy()
        np.put_along_axis(want, cand, np.take_along_axis(exact, cand, 1), 1)
        np.testing.assert_allclose(r.logits(ids), want, atol=1e-4, rtol=0)
        assert not np.allclose(coarse, exact, atol=1e-3)  # the two stages differ: the test sees which one is where


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_int8_activations_stay_close(tiny_llama, graph_file, prompts, precision):
    """accuracy_level 4 (int8 activations, the fast default) vs the de-quantized reference: measured on this
    checkpoint max |Δ| ≈ 0.4 and top-1 ≈ 0.95–0.97 (logit std ≈ 2)."""
    qck = dequantized_checkpoint(tiny_llama, int(precision[3:]), 8, 32, False)
    r = runner(graph_file(precision=precision), tiny_llama)
    diffs, agree = [], []
    for ids in prompts:
        got, want = r.logits(ids), reference.forward(qck, ids)
        diffs.append(np.abs(got - want).max())
        agree.append(got.argmax(-1) == want.argmax(-1))
    assert max(diffs) < 1.0
    assert np.concatenate(agree).mean() >= 0.85


@pytest.mark.parametrize("precision,bound", [("int8", 0.9), ("int4", 0.4), ("w8a8", 0.9)])
def test_top1_agreement_with_fp32_reference(tiny_llama, graph_file, prompts, precision, bound):
    """Default export settings vs the fp32 reference. Measured: int8 ≈ 0.96, int4 ≈ 0.54 — a random tiny model
    is far more sensitive to 4-bit weights than a trained one (the real model's figures are in the slow test)."""
    r = runner(graph_file(precision=precision), tiny_llama)
    agree = np.concatenate([r.logits(ids).argmax(-1) == reference.forward(tiny_llama, ids).argmax(-1)
                            for ids in prompts])
    assert agree.mean() >= bound, agree.mean()


def test_float_head_option(tiny_llama, graph_file, prompts):
    """lm_head_bits=0 keeps the head (and the embedding) in float: with fp32 activations only the body's int8
    error remains."""
    import onnx

    p = graph_file(precision="int8", lm_head_bits=0, accuracy_level=0)
    m = onnx.load(str(p), load_external_data=False)
    assert {n.op_type for n in m.graph.node if n.name == "lm_head"} == {"MatMul"}
    qck = dequantized_checkpoint(tiny_llama, 8, 8, 32, False)
    qck.weights["lm_head.weight"] = tiny_llama.lm_head
    qck.weights["model.embed_tokens.weight"] = tiny_llama.weights["model.embed_tokens.weight"]
    np.testing.assert_allclose(runner(p, tiny_llama).logits(prompts[0]), reference.forward(qck, prompts[0]),
                               atol=1e-4, rtol=0)


def test_fp16_graph_builds_loads_and_runs(tiny_llama, graph_file, prompts):
    """fp16 is meant for GPU providers; on CPU it loads and (with onnxruntime 1.31) runs: loose parity."""
    r = runner(graph_file(precision="fp16"), tiny_llama, kv_dtype=np.float16)
    for ids in prompts[:2]:
        got, want = r.logits(ids), reference.forward(tiny_llama, ids)
        assert got.dtype == np.float32
        assert np.abs(got - want).max() < 0.1
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


def test_fp16_export_runs_end_to_end(tiny_llama_dir, tmp_path):
    """The whole pipeline at fp16: its own measurement calls feed an fp16 cache (they fed fp32 and the export died
    in ONNX Runtime), and the manifest records kv_dtype float16, which the runtime allocates (it said float32)."""
    import edge
    from conftest import tiny_export_options
    from export.pipeline import export_model

    m = export_model(tiny_llama_dir, tmp_path / "out", tiny_export_options(precision="fp16"), progress=False)
    assert {g.kv_dtype for g in m.graphs} == {"float16"} and m.parity["top1_agreement"] >= 0.9
    e = edge.load(tmp_path / "out", drafter="none", context=128)
    plain = e.generate("the quick brown fox", max_tokens=16, drafter="none").token_ids
    for kind in ("lookup", "hybrid", "model"):
        e.reset()
        assert e.generate("the quick brown fox", max_tokens=16, drafter=kind).token_ids == plain, kind


def test_embedding_is_block_quantized_in_its_own_initializer(tiny_llama, tiny_untied_dir, graph_file):
    """Quantized graphs gather the embedding from its own block-quantized rows (not the tied head's: those would
    stay resident, while the embedding's memory-mapped rows are read only where used); float graphs keep a Gather."""
    import onnx

    def embed_node(model):
        (n,) = [n for n in model.graph.node if n.name == "embed"]
        return n

    for ck, ids in ((tiny_llama, None), (load_hf_dir(tiny_untied_dir), None), (tiny_llama, np.arange(50))):
        n = embed_node(build_graph(ck, GraphOptions(precision="int4", max_len=64), ids))
        assert n.op_type == "GatherBlockQuantized" and n.input[0] == "embed_tokens.qweight", n
    assert embed_node(build_graph(tiny_llama, GraphOptions(precision="int4", max_len=64, lm_head_bits=0))).op_type == "Gather"
    m = onnx.load(str(graph_file(precision="fp32")), load_external_data=False)
    assert embed_node(m).op_type == "Gather"


@pytest.mark.parametrize("symmetric", [False, True])
def test_4bit_head_and_embedding_equal_dequantized_reference(tiny_llama, graph_file, prompts, symmetric):
    """--lm-head-bits 4: the head and the gathered embedding rows (4-bit, one zero point per block) are exactly
    their de-quantized images (fp32 activations)."""
    qck = dequantized_checkpoint(tiny_llama, 4, 4, 32, symmetric)
    r = runner(graph_file(precision="int4", symmetric=symmetric, accuracy_level=0, lm_head_bits=4), tiny_llama)
    for ids in prompts[:2]:
        np.testing.assert_allclose(r.logits(ids), reference.forward(qck, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("head_bits,symmetric", [(8, False), (4, False), (8, True)])
def test_footprint_predicts_the_quantized_embedding_to_the_byte(tiny_llama, head_bits, symmetric):
    """memory.footprint's embedding bytes equal the initializers the exporter writes for it."""
    from memory.footprint import predict_weight_bytes

    c = tiny_llama.config
    opts = GraphOptions(precision="int4", max_len=64, lm_head_bits=head_bits, symmetric=symmetric)
    m = build_graph(tiny_llama, opts)
    written = sum(numpy_helper.to_array(t).nbytes for t in m.graph.initializer if t.name.startswith("embed_tokens."))
    arch = {"layers": c.layers, "vocab": c.vocab, "hidden": c.hidden, "head_dim": c.head_dim,
            "intermediate": c.intermediate, "heads": c.heads, "kv_heads": c.kv_heads}
    w = predict_weight_bytes(arch, precision="int4", lm_head_bits=head_bits, max_len=64, zero_points=not symmetric,
                             embedding_bits=opts.embedding_bits(c.hidden))
    assert opts.embedding_bits(c.hidden) == head_bits and w.embedding == written


def test_footprint_predicts_w8a8_weights_to_the_byte(tiny_llama):
    """w8a8: int8 [K, N] + one float scale per output channel for every linear and the head."""
    from memory.footprint import predict_weight_bytes

    c = tiny_llama.config
    m = build_graph(tiny_llama, GraphOptions(precision="w8a8", max_len=64, head_rescore=0))
    written = {p: sum(numpy_helper.to_array(t).nbytes for t in m.graph.initializer
                      if t.name.endswith((".qweight", ".scales")) and t.name.split("/")[0].startswith(p))
               for p in ("l", "lm_head")}
    written["l"] -= written["lm_head"]
    arch = {"layers": c.layers, "vocab": c.vocab, "hidden": c.hidden, "head_dim": c.head_dim,
            "intermediate": c.intermediate, "heads": c.heads, "kv_heads": c.kv_heads}
    w = predict_weight_bytes(arch, precision="w8a8", max_len=64)
    assert w.body.total == written["l"] and w.head.total == written["lm_head"]


@pytest.mark.parametrize("head_bits", [8, 4])
def test_footprint_predicts_block_min_weights_to_the_byte(tiny_llama, head_bits):
    """int4 with float block minimums: the residual blocks of every 4-bit linear (and of a 4-bit head) and one
    block-sum matrix per distinct K are what memory.footprint predicts, to the byte."""
    from memory.footprint import predict_weight_bytes

    c = tiny_llama.config
    m = build_graph(tiny_llama, GraphOptions(precision="int4", max_len=64, lm_head_bits=head_bits, head_rescore=0))
    size = {t.name: numpy_helper.to_array(t).nbytes for t in m.graph.initializer}
    assert any(n.op_type == "MatMulNBits" and "/with_sums/" in n.input[0] for n in m.graph.node)
    arch = {"layers": c.layers, "vocab": c.vocab, "hidden": c.hidden, "head_dim": c.head_dim,
            "intermediate": c.intermediate, "heads": c.heads, "kv_heads": c.kv_heads}
    w = predict_weight_bytes(arch, precision="int4", lm_head_bits=head_bits, max_len=64)  # the exporter's default
    body = sum(v for n, v in size.items() if n.startswith("l") and n.split("/")[0][1:].isdigit()
               and n.endswith((".qweight", ".scales", ".zero_points")))
    head = sum(v for n, v in size.items() if n.startswith("lm_head."))
    sums = sum(v for n, v in size.items() if n.startswith("block_sums_"))
    assert (w.body.total, w.head.total, w.other) == (body, head, sums)
    plain = predict_weight_bytes(arch, precision="int4", lm_head_bits=head_bits, max_len=64, block_min=False)
    assert w.body.total > plain.body.total and (w.head.total > plain.head.total) == (head_bits == 4)


@pytest.mark.parametrize("pad", [True, False])
def test_export_time_greedy_matches_one_shot_logits(tiny_llama, tmp_path, pad):
    """GraphRunner.greedy (calibration text at export time, presents fed back as past) continues exactly as the
    argmax of one-shot logits over the growing sequence, with and without the pad query row."""
    p = tmp_path / "model.onnx"
    save_model(build_graph(tiny_llama, GraphOptions(precision="fp32", max_len=64, pad_query=pad)), str(p))
    r = runner(p, tiny_llama)
    ids = list(np.random.default_rng(8).integers(0, VOCAB, 12))
    gen = r.greedy(ids, 6)
    for i, tok in enumerate(gen):
        assert int(r.logits(ids + gen[:i])[-1].argmax()) == tok


# ----------------------------------------------------------------------------- K not in whole blocks

def deq_asym(w: np.ndarray, bits: int, bs: int) -> np.ndarray:
    """quantize_asymmetric → de-quantized [N, K] (independent of the graph)."""
    n, k = w.shape
    nb = -(-k // bs)
    b, s, z = quantize_asymmetric(w, bits, bs)
    q = unpack4(b, bs) if bits == 4 else b
    zz = unpack4(z.reshape(n, -1), nb) if bits == 4 else z.reshape(n, nb)
    return ((q.astype(np.float32) - zz[..., None]) * s.reshape(n, nb, 1)).reshape(n, -1)[:, :k]


def deq_linear(w: np.ndarray, bits: int, bs: int) -> np.ndarray:
    """What a default (block_min, asymmetric) quantized linear computes with: 4-bit layers whose K splits into whole
    blocks keep their float block minimums, every other one integer zero points."""
    n, k = w.shape
    if bits == 4 and k % bs == 0:
        return dequantize_block_min(*quantize_block_min(w, bs)[:3], n, k, bs)
    return deq_asym(w, bits, bs)


def test_block_min_residual_columns_are_whole_blocks_only_as_many_as_needed():
    """K = 32 blocks of 32: the 32 residuals fill exactly one extra block (not two), and the layer is still exact
    up to the residual's rounding."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 1024)).astype(np.float32)
    b, s, z, extra = quantize_block_min(w, 32)
    assert extra == 1 and b.shape == (4, 33, 16) and s.shape == (4 * 33,)
    back = dequantize_block_min(b, s, z, 4, 1024, 32)
    step = (w.reshape(4, 32, 32).max(-1) - w.reshape(4, 32, 32).min(-1)) / 15
    assert np.abs(back - w).max() <= step.max()


@pytest.fixture(scope="module")
def odd_checkpoints(tmp_path_factory):
    """Two tiny llamas whose layers do not all split into whole 32-blocks: `mixed` (hidden 64, intermediate 80:
    down_proj's K = 80), `narrow` (hidden 48: every K but down's, and the embedding rows)."""
    root = tmp_path_factory.mktemp("odd")
    build_checkpoint(root / "mixed", layers=2, seed=11, hidden=64, heads=4, kv_heads=2, intermediate=80)
    build_checkpoint(root / "narrow", layers=2, seed=12, hidden=48, heads=3, kv_heads=1, intermediate=64)
    return {k: load_hf_dir(root / k) for k in ("mixed", "narrow")}


def _dequantized(ck: Checkpoint, bits: int, opts: GraphOptions) -> Checkpoint:
    bs = opts.block_size
    w = {k: (deq_linear(v, bits, bs) if k.endswith("_proj.weight") else v) for k, v in ck.weights.items()}
    w["lm_head.weight"] = deq_linear(ck.lm_head, opts.head_bits, bs)
    emb_bits = opts.embedding_bits(ck.config.hidden)
    if emb_bits:
        w["model.embed_tokens.weight"] = deq_asym(ck.weights["model.embed_tokens.weight"], emb_bits, bs)
    return Checkpoint(ck.config, w, ck.source, ck.source_format)


@pytest.mark.parametrize("kind,precision", [("mixed", "int4"), ("narrow", "int4"), ("narrow", "int8")])
def test_graph_with_partial_blocks_equals_dequantized_reference(odd_checkpoints, tmp_path, kind, precision):
    """int4/int8 graphs (fp32 activations) of models whose K is not always a multiple of the block: each layer is
    exactly its de-quantized image (block minimums where K splits into whole blocks, integer zero points elsewhere;
    a float embedding where the rows do not split), and the manifest's `block_min` flag says whether the graph has
    block-minimum layers at all."""
    ck = odd_checkpoints[kind]
    c = ck.config
    opts = GraphOptions(precision=precision, max_len=64, accuracy_level=0, head_rescore=0)
    model = build_graph(ck, opts)
    has_sums = any(n.name.endswith("/block_sums") for n in model.graph.node)
    assert opts.uses_block_min(c.hidden, c.heads * c.head_dim, c.intermediate) == has_sums
    p = tmp_path / "model.onnx"
    save_model(model, str(p))
    r = runner(p, ck)
    qck = _dequantized(ck, opts.bits, opts)
    for ids in (np.arange(5, 40), np.random.default_rng(1).integers(0, VOCAB, 23)):
        np.testing.assert_allclose(r.logits(ids), reference.forward(qck, ids), atol=1e-4, rtol=0)


def test_builds_inside_reuse_quantization_quantize_a_large_table_once(tiny_llama, monkeypatch):
    """The tied embedding/head table, built into two graphs inside `reuse_quantization()`, is quantized once and the
    graphs are the same; outside it, every use quantizes again."""
    from export import graph

    table = []
    real = graph.quantize_asymmetric

    def counted(w, *args):
        table.append(w.shape == (VOCAB, 64))
        return real(w, *args)

    monkeypatch.setattr(graph, "quantize_asymmetric", counted)
    monkeypatch.setattr(graph, "MEMO_MIN", VOCAB * 64)  # the tiny model's table counts as large, its layers do not
    opts = GraphOptions(precision="int8", max_len=64, head_rescore=0)
    with graph.reuse_quantization():
        a = build_graph(tiny_llama, opts)
        b = build_graph(tiny_llama, opts)
    assert sum(table) == 1 and len(table) > 1
    assert a.SerializeToString() == b.SerializeToString()
    table.clear()
    build_graph(tiny_llama, opts)
    assert sum(table) == 2  # embedding and head
