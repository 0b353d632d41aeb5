"""Our own ONNX graph builder for the llama family: one tree-capable graph for prefill, decode and verify.

Graph I/O (what `edge` feeds):
    input_ids        int64 [1, S]
    position_ids     int64 [1, S]          prefix length + depth for tree nodes
    attention_bias   float32 [1, 1, S, T]  additive; T = committed length + S (0 = attend, very negative = not)
    logits_keep      int64 [1]             0 = logits for every row; n > 0 = only the last n rows
    past_key_values.{i}.key / .value  [1, kv_heads, capacity + 1, head_dim]  one preallocated buffer per layer,
                                           bound to present.{i}.* too: GroupQueryAttention appends in place; the
                                           extra slot is scratch for the pad query row (`_pad_query_inputs`)
    → logits [1, S or n, V], present.{i}.key / .value

Ops (the fast class onnxruntime-genai's builder uses, written here from the architecture):
embedding Gather · SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization (fused RMSNorm + residual) ·
one packed QKV MatMul · GroupQueryAttention with fused rotary (cos/sin caches, explicit position_ids) and
`attention_bias` over a max-length KV buffer shared by past and present · packed gate/up MatMul · SiLU ·
MatMulNBits (block-wise int4/int8 weights; int4 blocks keep a float minimum, `_Builder.linear_block_min`) or plain
MatMul (fp32/fp16); or, for `w8a8`, int8 per-channel weights with int8 per-row activations (`_Builder.linear_w8a8`:
MatMulIntegerToFloat, exact integer accumulation).

GroupQueryAttention wants `seqlens_k` (= T - 1) and `total_sequence_length` (= T); both are derived inside the graph
from the attention bias' last dimension (+ 1 for the pad query row), so a caller only states the mask.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edge.manifest import GRAPH_VERSION  # noqa: F401  (bumped with every change to what this builder writes)
from edge.manifest import DEQUANTIZE_PAST
from kernels.postprocess import sampling_head
from memory.footprint import COARSE_HEAD_BITS, COARSE_HEAD_BLOCK, HEAD_RESCORE, PRECISIONS

from .checkpoint import Checkpoint
from .quant import block_sum_matrix, quantize_asymmetric, quantize_block_min, quantize_blockwise, unpack4

W8A8_KERNELS = ("u8s8", "u8u8")
KV_CACHES = ("float32", "int8")
SHARED_CONSTANT_MAX = 64  # elements: larger initializers (weights) are never requested twice by name
MS = "com.microsoft"
IR_VERSION = 10  # ORT 1.31 loads IR <= 13; onnx 1.23 would write 14 by default
OPSET = 21  # QuantizeLinear's blocked form (w8a8 activations); IR 10 covers it


@dataclass(frozen=True)
class GraphOptions:
    precision: str = "int4"
    block_size: int = 32
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations (per row, per block), 0 = fp32 activations
    lm_head_bits: int | None = None  # None: 8 for int8/int4 bodies, float for fp32/fp16
    symmetric: bool = False  # False: min/max blocks with zero points (closer to GGUF's asymmetric Q4_1 source)
    block_min: bool = True  # 4-bit min/max blocks keep their float minimum (Q4_1's form; `_Builder.linear_block_min`)
    layers: int | None = None  # early-exit drafter: the first N layers (+ final norm + head)
    max_len: int | None = None  # rotary table length; default: the model's max positions
    topk: int = 8  # 0: no on-graph head; else the head (kernels/postprocess.py), whose k the runtime feeds per call
    # > 0: a two-stage LM head (`_Builder.rescored_head`) where it applies (`rescores`): a coarse 4-bit head over the
    # whole vocabulary, then these best candidates of each row scored again from the 8-bit embedding rows
    head_rescore: int = HEAD_RESCORE
    pad_query: bool = True  # one extra attention query row, so 1-token calls compute what verify calls compute
    # w8a8 weights: "u8s8" int8 (MLAS' u8s8 GEMM: VNNI's fast path, but it saturates on CPUs without VNNI) or
    # "u8u8" uint8 around 128 (exact on every CPU); None: `devices.int8_gemm_exact` decides for this host
    w8a8_kernel: str | None = None
    # "int8": GroupQueryAttention stores K/V as int8 codes with static per-channel scales fitted at export
    # (`build_graph`'s kv_scales); each value is quantized on its own, so a token's cache entry does not depend on
    # the call that wrote it, and speculation stays exact. "float32": the graph's float type (fp16 graphs: fp16)
    kv_cache: str = "float32"

    def __post_init__(self):
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache {self.kv_cache!r}: choose one of {', '.join(KV_CACHES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.w8a8_kernel is None:
            object.__setattr__(self, "w8a8_kernel", host_w8a8_kernel() if self.precision == "w8a8" else "u8s8")
        if self.w8a8_kernel not in W8A8_KERNELS:
            raise ValueError(f"w8a8_kernel {self.w8a8_kernel!r}: choose one of {', '.join(W8A8_KERNELS)}")

    @property
    def bits(self) -> int | None:
        return {"int4": 4, "int8": 8, "w8a8": 8}.get(self.precision)

    def embedding_bits(self, hidden: int) -> int:
        """Bits of the block-quantized embedding rows (GatherBlockQuantized, stored like the LM head); 0 = a float
        Gather table (float bodies, a float head, or rows that do not split into whole blocks)."""
        if not self.bits or hidden % self.block_size:
            return 0
        return self.head_bits or 0

    def uses_block_min(self, hidden: int, q_dim: int, intermediate: int) -> bool:
        """Does any 4-bit layer of this graph keep its blocks' float minimums? Those whose K splits into whole blocks
        do (qkv, gate/up and the head read `hidden`, o_proj `q_dim`, down `intermediate`); the others, and the
        embedding's rows, keep integer zero points."""
        if not self.block_min or self.symmetric:
            return False
        ks = ((hidden, q_dim, intermediate) if self.bits == 4 else ()) + ((hidden,) if self.head_bits == 4 else ())
        return any(k % self.block_size == 0 for k in ks)

    def rescores(self, tied: bool, hidden: int, vocab: int, trimmed: bool = False) -> bool:
        """Does a graph of this model get the two-stage head? Its exact rows are the embedding's own block-quantized
        rows, so only a tied head whose embedding is stored at the head's 8 bits, over the full vocabulary."""
        return (self.head_rescore > 0 and tied and not trimmed and self.head_bits == 8
                and self.embedding_bits(hidden) == 8 and vocab > self.head_rescore)

    @property
    def head_bits(self) -> int | None:
        if self.lm_head_bits is not None:
            return self.lm_head_bits or None
        return 8 if self.bits else None


def host_w8a8_kernel() -> str:
    """The w8a8 weight layout that is exact on this machine and fastest there: int8 weights where the int8 GEMM
    sums exactly (VNNI), uint8 weights elsewhere (`devices.int8_gemm_exact`)."""
    from devices import int8_gemm_exact

    return "u8s8" if int8_gemm_exact() else "u8u8"


_memo: dict | None = None  # quantized large weights, while `reuse_quantization()` is active
MEMO_MIN = 1 << 20  # elements: smaller weights are re-quantized (cheap) rather than kept


@contextmanager
def reuse_quantization():
    """Graphs built inside this block quantize each large weight once: an export builds its target up to three
    times (the KV-scale probe, the pad-row probe, the graph kept) and its drafters from the same embedding and LM
    head, and on a 262k-token vocabulary each of those tables takes seconds to quantize."""
    global _memo
    outer = _memo
    _memo = {} if outer is None else outer
    try:
        yield
    finally:
        _memo = outer


def _once(fn, w: np.ndarray, *args):
    """fn(w, *args), remembered for this very array inside `reuse_quantization()` (the array is kept with the
    result, so its id cannot be reused by another)."""
    if _memo is None or w.size < MEMO_MIN:
        return fn(w, *args)
    key = (fn.__name__, id(w), args)
    hit = _memo.get(key)
    if hit is None or hit[0] is not w:
        hit = _memo[key] = (w, fn(w, *args))
    return hit[1]


def _scaled(w: np.ndarray, scale: float) -> np.ndarray:
    return w * np.float32(scale)


class _Builder:
    def __init__(self, opts: GraphOptions, float_type: int):
        self.o = opts
        self.ft = float_type
        self.np_ft = np.float16 if float_type == TensorProto.FLOAT16 else np.float32
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._constants: dict[str, np.ndarray | None] = {}
        self._row_zeros: dict[str, str] = {}  # rows → shared w8a8 zero-point tensor
        self._n = 0
        self._embed_rows: tuple[list[str], int] | None = None  # GatherBlockQuantized inputs and bits of the table

    def init(self, name: str, arr: np.ndarray) -> str:
        """A named initializer; asking again for the same name (a shared constant) reuses the first one. Only
        small constants are kept for that check: holding every weight array too would double the export's peak."""
        if name in self._constants:
            assert np.array_equal(self._constants[name], arr), f"initializer {name!r} redefined"
            return name
        self._constants[name] = arr if arr.size <= SHARED_CONSTANT_MAX else None
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def node(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", name: str | None = None,
             outputs: list[str] | None = None, **attrs) -> list[str]:
        self._n += 1
        name = name or f"{op}_{self._n}"
        outs = outputs or [f"{name}/out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain or None, **attrs))
        return outs

    def linear(self, x: str, w: np.ndarray, name: str, bits: int | None, rows: str = "S") -> str:
        """y = x @ w.T for w [N, K]; x [1, rows, K] (`rows` names the row count: S, or R for the head)."""
        n, k = w.shape
        if bits is None:
            wt = self.init(f"{name}.weight", w.T.astype(self.np_ft))
            return self.node("MatMul", [x, wt], name=name)[0]
        if self.o.precision == "w8a8" and bits == 8:
            return self.linear_w8a8(x, w, name, rows)
        if bits == 4 and self.o.block_min and not self.o.symmetric and k % self.o.block_size == 0:
            return self.linear_block_min(x, w, name)
        if self.o.symmetric:
            b, s = _once(quantize_blockwise, w, bits, self.o.block_size)
            extra = []
        else:
            b, s, z = _once(quantize_asymmetric, w, bits, self.o.block_size)
            extra = [self.init(f"{name}.zero_points", z)]
        q = [self.init(f"{name}.qweight", b), self.init(f"{name}.scales", s.astype(self.np_ft))] + extra
        return self.node("MatMulNBits", [x] + q, domain=MS, name=name, K=k, N=n, bits=bits,
                         block_size=self.o.block_size, accuracy_level=self.o.accuracy_level)[0]

    def linear_block_min(self, x: str, w: np.ndarray, name: str) -> str:
        """4-bit blocks with a float minimum (`export.quant.quantize_block_min`): MatMulNBits over [x, block sums of
        x], whose extra input channels carry what the integer zero points rounded away. The block sums are one small
        fp32 MatMul (x @ E, E [K, block·extra] of 0/1, shared by every layer with this K); it sums each row on its own,
        so a token's result still does not depend on the other rows in the call (tests/test_export_graph.py).
        Measured on SmolLM2-135M (Q4_1 GGUF): top-1 against the source 0.95 instead of 0.63 (export parity), for
        ~0.5-0.7 ms more per call on a 2-core CPU (2 small ops per linear, K + 32 or + 64)."""
        n, k = w.shape
        bs = self.o.block_size
        b, s, z, extra = _once(quantize_block_min, w, bs)
        sums_name = f"block_sums_{k}"
        if sums_name not in self._constants:  # too large to be compared on reuse: created once per K
            self.init(sums_name, block_sum_matrix(k, bs, extra, self.np_ft))
        sums = self.node("MatMul", [x, sums_name], name=f"{name}/block_sums")[0]
        xs = self.node("Concat", [x, sums], name=f"{name}/with_sums", axis=-1)[0]
        q = [self.init(f"{name}.qweight", b), self.init(f"{name}.scales", s.astype(self.np_ft)),
             self.init(f"{name}.zero_points", z)]
        return self.node("MatMulNBits", [xs] + q, domain=MS, name=name, K=k + extra * bs, N=n, bits=4, block_size=bs,
                         accuracy_level=self.o.accuracy_level)[0]

    def linear_w8a8(self, x: str, w: np.ndarray, name: str, rows: str = "S") -> str:
        """y = x @ w.T with int8 weights (one symmetric scale per output channel) and int8 activations with one
        scale per row, computed in the graph from that row alone: q = QuantizeLinear(x, max|x|/127, 128) (uint8
        around 128; one block per row, rounding half to even), y = MatMulIntegerToFloat(q, W_int8, zero point 128,
        w_scale/127) · max|x|. Six nodes per linear, plus the zero-point tensor shared by every linear whose input
        has the same `rows` (see `_row_zero_point`).

        Why: the products are summed in int32, which is exact in any order, and every scale depends on one row
        only, so a token's result cannot depend on how many rows share its call or how the kernel tiles them
        (MatMulNBits' int8-activation kernels accumulate float partial sums per block, and over the whole model their
        cost grows ~2 ms per extra row on the dev VM; MLAS' u8s8 GEMM reuses each packed weight tile across rows). A row of zeros gives max 0,
        NaN codes and y = garbage·0 = 0. Int8 codes (QuantizeLinear without a zero point) would need no shared
        zero point, but ONNX Runtime 1.32's s8s8 MatMulIntegerToFloat ran ~20× slower on AVX2 than the u8 one.

        The same weights go in as int8 (`w8a8_kernel` "u8s8") or as uint8 w + 128 with zero point 128 ("u8u8"):
        equal integer sums, but MLAS' u8s8 kernel on x86 CPUs without VNNI adds products in saturating int16 pairs
        (`devices.int8_gemm_exact`), while its u8u8 kernel widens first and is exact everywhere."""
        k = w.shape[1]
        ws = (np.abs(w).max(1) / 127).astype(np.float32)  # [N]
        ws = np.where(ws == 0, np.float32(1), ws).astype(np.float32)
        wq = np.clip(np.rint(w / ws[:, None]), -127, 127).astype(np.int8).T  # [K, N]
        zero = self.init("w8a8_zero_point", np.array(128, np.uint8))
        w_zero = []
        if self.o.w8a8_kernel == "u8u8":
            wq, w_zero = (wq.astype(np.int16) + 128).astype(np.uint8), [zero]
        m = self.node("ReduceMax", [self.node("Abs", [x], name=f"{name}/abs")[0],
                                    self.init("axes_last", np.array([-1], np.int64))],
                      name=f"{name}/absmax", keepdims=1)[0]  # [1, rows, 1]
        s = self.node("Div", [m, self.init("w8a8_127", np.array(127, np.float32))], name=f"{name}/scale")[0]
        q = self.node("QuantizeLinear", [x, s, self._row_zero_point(m, rows)], name=f"{name}/quant", axis=2,
                      block_size=k)[0]  # [1, rows, K] uint8: one block (one scale) per row
        y = self.node("MatMulIntegerToFloat", [q, self.init(f"{name}.qweight", np.ascontiguousarray(wq)),
                                               self.init("w8a8_one", np.array(1, np.float32)),
                                               self.init(f"{name}.scales", (ws / 127).astype(np.float32)), zero]
                      + w_zero, domain=MS, name=f"{name}/matmul")[0]
        return self.node("Mul", [y, m], name=name)[0]

    def _row_zero_point(self, m: str, rows: str) -> str:
        """uint8 128s shaped like the row scales m [1, rows, 1]: blocked QuantizeLinear wants its zero point in the
        scale's shape, which depends on the call's length, so it is built once per row count (the body's S rows,
        the head's R) from the first linear's m and shared by the others."""
        key = f"w8a8_zero_rows_{rows}"
        if key not in self._row_zeros:
            shape = self.node("Shape", [m], name=f"{key}/shape")[0]
            self._row_zeros[key] = self.node("ConstantOfShape", [shape], name=key,
                                             value=numpy_helper.from_array(np.array([128], np.uint8)))[0]
        return self._row_zeros[key]

    def rescored_head(self, x: str, w: np.ndarray, embed_scale: float) -> str:
        """Logits [1, R, V] for x [1, R, K] in two stages. A coarse head, w at 4 bits in blocks of 32 with no zero
        points, ranks the whole vocabulary; the `head_rescore` best of each row are then scored again as float dot
        products with their rows of the 8-bit embedding table (the same GatherBlockQuantized the input embedding
        reads, divided by the embedding's scale), and written over their coarse logits. The other logits stay
        coarse: they only decide which tokens are candidates, and what sampling gives the far tail.

        Why: a 1-row call reads every weight of the head once. At 8 bits a 262,144 × 640 head is 168 MB a token and
        more than half of a Gemma 3 270M call; at 4 bits it is 84 MB, and the 8-bit table it rescores from is read
        only at the candidates' rows (and needs no prepacked copy). Every stage works on each row alone, so a
        token's logits do not depend on how many rows share its call, as the layers' do not."""
        n, k = w.shape
        cb, cand = COARSE_HEAD_BLOCK, self.o.head_rescore
        b, s = _once(quantize_blockwise, w, COARSE_HEAD_BITS, cb)
        coarse = self.node("MatMulNBits", [x, self.init("lm_head_coarse.qweight", b),
                                           self.init("lm_head_coarse.scales", s.astype(self.np_ft))],
                           domain=MS, name="lm_head_coarse", K=k, N=n, bits=COARSE_HEAD_BITS, block_size=cb,
                           accuracy_level=self.o.accuracy_level)[0]
        _, ids = self.node("TopK", [coarse, self.init("head_rescore_k", np.array([cand], np.int64))], n_out=2,
                           name="head_candidates", axis=-1, largest=1, sorted=0)
        inputs, bits = self._embed_rows
        rows = self.node("GatherBlockQuantized", [inputs[0], ids] + inputs[2:], domain=MS, name="head_rows",
                         bits=bits, block_size=self.o.block_size, gather_axis=0, quantize_axis=2)[0]
        rows = self.node("Reshape", [rows, self.init("head_rows_shape", np.array([1, -1, cand, k], np.int64))],
                         name="head_rows_flat")[0]  # [1, R, C, K]
        col = self.node("Unsqueeze", [x, self.init("axes_last", np.array([-1], np.int64))], name="head_x_col")[0]
        exact = self.node("MatMul", [rows, col], name="head_rescore")[0]  # [1, R, C, 1]
        exact = self.node("Reshape", [exact, self.init("head_exact_shape", np.array([1, -1, cand], np.int64))],
                          name="head_exact")[0]
        if embed_scale != 1:
            exact = self.node("Mul", [exact, self.init("head_unscale", np.array(1 / embed_scale, self.np_ft))],
                              name="head_unscale")[0]
        return self.node("ScatterElements", [coarse, ids, exact], name="lm_head", axis=-1)[0]

    def rms_norm(self, x: str, w: np.ndarray, name: str, eps: float) -> str:
        return self.node("SimplifiedLayerNormalization", [x, self.init(f"{name}.weight", w.astype(self.np_ft))],
                         name=name, axis=-1, epsilon=eps, stash_type=1)[0]

    def embedding(self, w: np.ndarray, bits: int | None) -> str:
        """Rows of w [V, H] for input_ids: a float Gather, or GatherBlockQuantized over block-quantized rows
        [V, n_blocks, blob] with one scale (and zero point) per block [V, n_blocks, 1]."""
        if bits is None:
            return self.node("Gather", [self.init("embed_tokens", w.astype(self.np_ft)), "input_ids"], name="embed",
                             axis=0)[0]
        v, nb = w.shape[0], w.shape[1] // self.o.block_size
        if self.o.symmetric:
            b, scales = _once(quantize_blockwise, w, bits, self.o.block_size)
            z = None
        else:
            b, scales, z = _once(quantize_asymmetric, w, bits, self.o.block_size)
            if bits == 4:  # MatMulNBits packs two blocks' zero points per byte; here one per block (low nibble)
                z = unpack4(z.reshape(v, -1), nb)
        inputs = [self.init("embed_tokens.qweight", b), "input_ids",
                  self.init("embed_tokens.scales", scales.astype(self.np_ft).reshape(v, nb, 1))]
        if z is not None:
            inputs.append(self.init("embed_tokens.zero_points", z.reshape(v, -1)[:, :nb].reshape(v, nb, 1)))
        self._embed_rows = (inputs, bits)
        rows = self.node("GatherBlockQuantized", inputs, domain=MS, name="embed", bits=bits,
                         block_size=self.o.block_size, gather_axis=0, quantize_axis=2)[0]  # [1, S, n_blocks, blob]
        return self.node("Reshape", [rows, self.init("embed_out_shape", np.array([1, -1, w.shape[1]], np.int64))],
                         name="embed_rows")[0]


def rotary_tables(inv_freq: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches [max_len, head_dim / 2] for GroupQueryAttention's fused rotary (ArchConfig.inv_freq)."""
    ang = np.arange(max_len, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _pad_query_inputs(g: _Builder, biases: list[str]) -> tuple[list[str], str]:
    """GroupQueryAttention's single-query path sums in another order than its multi-query path (~2e-7), which int8
    activations amplify to ~1 logit: a decode step would not compute what a verify call computes. So every attention
    call gets one extra query row (zeros, position 0; it sees everything, the real rows never see it) and always
    takes the multi-query path. Its K/V lands in the KV buffer's scratch slot after the call's tokens (the runtime
    allocates capacity + 1 slots) and is never committed. Returns the padded biases and position_ids."""
    neg = g.init("neg", np.array(np.finfo(np.float32).min, np.float32))
    padded = []
    for b in biases:
        b = g.node("Pad", [b, g.init("pad_col", np.array([0, 0, 0, 0, 0, 0, 0, 1], np.int64)), neg],
                   name=f"{b}_pad_col")[0]  # [1, 1, S, T+1]: no real row sees the pad slot
        padded.append(g.node("Pad", [b, g.init("pad_row", np.array([0, 0, 0, 0, 0, 0, 1, 0], np.int64))],
                             name=f"{b}_pad_row")[0])  # [1, 1, S+1, T+1]: the pad row sees all
    positions = g.node("Pad", ["position_ids", g.init("pad_seq2", np.array([0, 0, 0, 1], np.int64))],
                       name="positions_pad")[0]
    return padded, positions


@contextmanager
def _branch(g: _Builder):
    """Nodes made inside this block go to the list it yields (an If branch), not to the graph."""
    outer, g.nodes = g.nodes, []
    try:
        yield g.nodes
    finally:
        g.nodes = outer


def _call_slots(g: _Builder, prefix: str, positions: str, total: str, kv_heads: int) -> tuple[str, str]:
    """The committed length P = T - S' as [1] (S' the call's rows, the pad query's included) and ScatterND
    indices [1, kv_heads, S', 3] of the slots the call writes: (0, head, P + row) for every head and row."""
    i64 = lambda name, v: g.init(name, np.array(v, np.int64))  # noqa: E731
    rows = g.node("Gather", [g.node("Shape", [positions], name=f"{prefix}/call_shape")[0], i64("const_1", 1)],
                  name=f"{prefix}/call_rows", axis=0)[0]
    past = g.node("Sub", [total, rows], name=f"{prefix}/past_len")[0]
    past1 = g.node("Reshape", [past, i64("shape_1", [1])], name=f"{prefix}/past_len1")[0]
    slots = g.node("Range", [past, total, i64("const_1", 1)], name=f"{prefix}/slots")[0]  # [S']
    grid = g.node("Concat", [i64("kv_heads_1", [kv_heads]), g.node("Shape", [slots], name=f"{prefix}/rows1")[0]],
                  name=f"{prefix}/grid", axis=0)[0]  # [kv_heads, S']
    parts = [g.node("Expand", [i64("const_0", 0), grid], name=f"{prefix}/batch")[0],
             g.node("Expand", [i64("kv_head_ids", np.arange(kv_heads).reshape(-1, 1)), grid], name=f"{prefix}/heads")[0],
             g.node("Expand", [slots, grid], name=f"{prefix}/rows")[0]]
    parts = [g.node("Unsqueeze", [x, i64("axis_last", [-1])], name=f"{prefix}/index{k}")[0] for k, x in enumerate(parts)]
    index = g.node("Concat", parts, name=f"{prefix}/index", axis=-1)[0]  # [kv_heads, S', 3]
    return past1, g.node("Unsqueeze", [index, i64("zero_i64", [0])], name=f"{prefix}/index4")[0]


def _attention_either_path(g: _Builder, i: int, gqa_in: list[str], outputs: list[str], attrs: dict,
                           call: tuple[str, str], kv_heads: int) -> str:
    """GroupQueryAttention over the int8 cache, by one of two paths the `dequantize_past` input picks per call:

    - false: the quantized kernel. Exact for speculation (a row computes the same in any call), but it reads the
      cache per query row, so a call of S rows costs ~S single-row calls.
    - true: the committed slots are dequantized once (codes · scale), the float kernel attends over them, and the
      call's new K/V are quantized with the same static scales and written into their slots. ~2.8× faster for a
      256-row prefill chunk, and it writes the same codes; but its rows see the call's own new K/V unquantized, so
      a row's result depends on the call's width: for prefill only, whose chunks both plain and speculative
      decoding run alike.

    `call`: the (padded) position_ids and the total length T as int64; the committed length P = T - S' and the
    slots the call writes (P .. T-1) are worked out inside the branch, so decode calls never compute them.
    """
    attn_out, ok, ov = outputs
    positions, total = call
    with _branch(g) as quantized:
        g.node("GroupQueryAttention", gqa_in, domain=MS, name=f"l{i}/attn_q",
               outputs=[f"l{i}/attn_q/out", f"l{i}/attn_q/key", f"l{i}/attn_q/value"], **attrs)
    float_attrs = {k: v for k, v in attrs.items() if k not in ("kv_cache_bit_width", "k_quant_type", "v_quant_type")}
    zero, axis, end = (g.init("zero_i64", np.array([0], np.int64)), g.init("axis_2", np.array([2], np.int64)),
                       g.init("int_max", np.array([2**62], np.int64)))
    lo, hi = g.init("int8_lo", np.array(-128, np.float32)), g.init("int8_hi", np.array(127, np.float32))
    with _branch(g) as dequantized:
        past1, index = _call_slots(g, f"l{i}/deq", positions, total, kv_heads)
        past, scales = [], gqa_in[12:14]
        for buf, scale, kind in zip(gqa_in[3:5], scales, ("key", "value")):
            codes = g.node("Slice", [buf, zero, past1, axis], name=f"l{i}/deq/{kind}_past")[0]
            x = g.node("Cast", [codes], name=f"l{i}/deq/{kind}_cast", to=TensorProto.FLOAT)[0]
            past.append(g.node("Mul", [x, scale], name=f"l{i}/deq/{kind}_float")[0])
        out, fk, fv = g.node("GroupQueryAttention", gqa_in[:3] + past + gqa_in[5:11], domain=MS,
                             name=f"l{i}/deq/attn", n_out=3, **float_attrs)
        written = [out]
        for buf, full, scale, kind in zip(gqa_in[3:5], (fk, fv), scales, ("key", "value")):
            new = g.node("Slice", [full, past1, end, axis], name=f"l{i}/deq/{kind}_new")[0]
            q = g.node("Round", [g.node("Div", [new, scale], name=f"l{i}/deq/{kind}_div")[0]], name=f"l{i}/deq/{kind}_round")[0]
            q = g.node("Cast", [g.node("Clip", [q, lo, hi], name=f"l{i}/deq/{kind}_clip")[0]],
                       name=f"l{i}/deq/{kind}_codes", to=TensorProto.INT8)[0]
            written.append(g.node("ScatterND", [buf, index, q], name=f"l{i}/deq/{kind}_write")[0])
    value_types = (TensorProto.FLOAT, TensorProto.INT8, TensorProto.INT8)
    branch_graph = lambda nodes, name, outs: helper.make_graph(  # noqa: E731
        nodes, name, [], [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, value_types)])
    return g.node("If", [DEQUANTIZE_PAST], outputs=[attn_out, ok, ov], name=f"l{i}/attn",
                  then_branch=branch_graph(dequantized, f"l{i}_dequantized", written),
                  else_branch=branch_graph(quantized, f"l{i}_quantized",
                                           [f"l{i}/attn_q/out", f"l{i}/attn_q/key", f"l{i}/attn_q/value"]))[0]


def _qk_norm(g: _Builder, qkv: str, c, L, i: int, eps: float) -> list[str]:
    """Split the packed projection into query, key, value and RMS-normalize every head of the query and key over
    its head_dim (Gemma 3's QK-norm): [1, S, H·D] → [1, S·H, D] → norm → [1, S, H·D]."""
    q_dim, kv_dim = c.heads * c.head_dim, c.kv_heads * c.head_dim
    q, k, v = g.node("Split", [qkv, g.init(f"qkv_split_{q_dim}_{kv_dim}", np.array([q_dim, kv_dim, kv_dim], np.int64))],
                     n_out=3, name=f"l{i}/qkv_split", axis=-1)
    heads = g.init("per_head_shape", np.array([1, -1, c.head_dim], np.int64))
    out = []
    for x, n, dim in ((q, "q", q_dim), (k, "k", kv_dim)):
        x = g.node("Reshape", [x, heads], name=f"l{i}/{n}_heads")[0]
        x = g.rms_norm(x, L(f"self_attn.{n}_norm.weight"), f"l{i}/{n}_norm", eps)
        out.append(g.node("Reshape", [x, g.init(f"rows_shape_{dim}", np.array([1, -1, dim], np.int64))],
                          name=f"l{i}/{n}_rows")[0])
    return out + [v]


def _window_bias(g: _Builder, window: int) -> str:
    """attention_bias with the sliding window applied: a query at position p may not see a key at position p - window
    or before. Key positions are the committed slots' indices (the cache holds committed tokens at their positions)
    followed by this call's position_ids, so tree nodes (position = prefix + depth) are windowed by their depth, as
    the path they lie on would be in plain decoding. [1, 1, S, T], computed once for every sliding layer."""
    i64 = lambda name, v: g.init(name, np.array(v, np.int64))  # noqa: E731
    shape = g.node("Shape", ["attention_bias"], name="window/bias_shape")[0]
    t = g.node("Gather", [shape, i64("const_3", 3)], name="window/T", axis=0)[0]
    s = g.node("Gather", [g.node("Shape", ["position_ids"], name="window/pos_shape")[0], i64("const_1", 1)],
               name="window/S", axis=0)[0]
    committed = g.node("Range", [i64("const_0", 0), g.node("Sub", [t, s], name="window/P")[0], i64("const_1", 1)],
                       name="window/committed")[0]
    keys = g.node("Concat", [committed, g.node("Reshape", ["position_ids", i64("shape_minus1", [-1])],
                                               name="window/call_pos")[0]], name="window/key_pos", axis=0)[0]  # [T]
    queries = g.node("Unsqueeze", ["position_ids", i64("axes_1_3", [1, 3])], name="window/query_pos")[0]  # [1,1,S,1]
    behind = g.node("Sub", [queries, keys], name="window/behind")[0]  # [1, 1, S, T]
    far = g.node("GreaterOrEqual", [behind, i64("window", window)], name="window/far")[0]
    neg = g.init("neg", np.array(np.finfo(np.float32).min, np.float32))
    return g.node("Where", [far, neg, "attention_bias"], name="window_bias")[0]


def build_graph(ck: Checkpoint, opts: GraphOptions, vocab_ids: np.ndarray | None = None,
                adapter: np.ndarray | None = None, kv_scales: np.ndarray | None = None) -> onnx.ModelProto:
    """The target graph (all layers, full vocabulary) or a drafter (`opts.layers`, `vocab_ids` = kept target ids).

    `adapter` [hidden, hidden] (drafters only): a correction fitted at export time, applied to the last layer's
    residual stream before the final norm (h ← h @ adapter), so an early exit looks more like the full model.
    `kv_scales` [layers ≥ N, 2, kv_heads, head_dim] (opts.kv_cache "int8"): the K and V step of each channel
    (`export.kvquant.kv_scales`)."""
    c = ck.config
    n_layers = c.layers if opts.layers is None else opts.layers
    if not 1 <= n_layers <= c.layers:
        raise ValueError(f"layers={n_layers}: the model has {c.layers}")
    int8_kv = opts.kv_cache == "int8"
    if int8_kv and (kv_scales is None or kv_scales.shape[1:] != (2, c.kv_heads, c.head_dim)
                    or kv_scales.shape[0] < n_layers):
        raise ValueError(f"an int8 KV cache needs kv_scales [{n_layers}, 2, {c.kv_heads}, {c.head_dim}]")
    ft = TensorProto.FLOAT16 if opts.precision == "fp16" else TensorProto.FLOAT
    g = _Builder(opts, ft)
    w = ck.weights
    bits = opts.bits
    max_len = opts.max_len or c.max_positions
    eps = float(c.rms_eps)

    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "S"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "S"]),
        helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT, [1, 1, "S", "T"]),
        helper.make_tensor_value_info("logits_keep", TensorProto.INT64, [1]),
    ]
    outputs = []

    # Gemma 3's sliding layers see a window of the cache: their own bias (only when the context can exceed it)
    windowed = bool(c.sliding_window) and max_len > c.sliding_window and \
        any(c.is_sliding(i) for i in range(n_layers))
    biases = ["attention_bias"] + ([_window_bias(g, c.sliding_window)] if windowed else [])
    positions = "position_ids"
    if opts.pad_query:
        biases, positions = _pad_query_inputs(g, biases)
    # T, seqlens_k = T - 1, from the (padded) mask's shape
    shape = g.node("Shape", [biases[0]], name="bias_shape")[0]
    t64 = g.node("Gather", [shape, g.init("const_3", np.array(3, np.int64))], name="total_len64", axis=0)[0]
    total = g.node("Cast", [t64], name="total_len", to=TensorProto.INT32)[0]
    seqlens = g.node("Sub", [total, g.init("const_one_i32", np.array(1, np.int32))], name="seqlens_scalar")[0]
    seqlens = g.node("Reshape", [seqlens, g.init("shape_1", np.array([1], np.int64))], name="seqlens_k")[0]
    if ft != TensorProto.FLOAT:
        biases = [g.node("Cast", [b], name=f"{b}_cast", to=ft)[0] for b in biases]
    bias = biases[0]

    # GroupQueryAttention wants cos/sin rows for every slot it may see, the pad query's scratch slot included;
    # sliding layers (Gemma 3) have their own rotary base
    rotary = {}
    for kind, layer in (("", None), ("local_", next((i for i in range(n_layers) if c.is_sliding(i)), None))):
        if kind and layer is None:
            continue
        cos, sin = rotary_tables(c.inv_freq(layer), max_len + int(opts.pad_query))
        rotary[kind] = g.init(f"{kind}cos_cache", cos.astype(g.np_ft)), g.init(f"{kind}sin_cache", sin.astype(g.np_ft))
    gemma = c.family == "gemma3"

    # quantized bodies store the embedding block-quantized like the LM head (113 → 28 MB here at 8 bits). Its own
    # initializer, not the tied head's: external data is memory-mapped and a Gather touches only the rows it reads,
    # while sharing would keep the head's whole packed table resident (measured: +28 MB RSS)
    # Gemma scales its embeddings by sqrt(hidden): folded into the table (the tied LM head keeps the unscaled rows)
    table = w["model.embed_tokens.weight"]
    h = g.embedding(_once(_scaled, table, c.embed_scale) if c.embed_scale != 1 else table,
                    opts.embedding_bits(c.hidden) or None)
    residual = h
    x = g.node("SimplifiedLayerNormalization", [h, g.init("l0.input_norm", w["model.layers.0.input_layernorm.weight"].astype(g.np_ft))],
               name="l0/input_norm", axis=-1, epsilon=eps, stash_type=1)[0]
    kv_shape = [1, c.kv_heads, "max_len", c.head_dim]
    kv_type = TensorProto.INT8 if int8_kv else ft
    wide = None
    if int8_kv and ft == TensorProto.FLOAT:
        inputs.append(helper.make_tensor_value_info(DEQUANTIZE_PAST, TensorProto.BOOL, []))
        wide = positions, t64
    for i in range(n_layers):
        L = lambda n: w[f"model.layers.{i}.{n}"]  # noqa: E731
        qkv_w = np.concatenate([L("self_attn.q_proj.weight"), L("self_attn.k_proj.weight"), L("self_attn.v_proj.weight")])
        qkv = g.linear(x, qkv_w, f"l{i}/qkv", bits)
        if c.qkv_bias:
            qkv_b = np.concatenate([L("self_attn.q_proj.bias"), L("self_attn.k_proj.bias"), L("self_attn.v_proj.bias")])
            qkv = g.node("Add", [qkv, g.init(f"l{i}/qkv.bias", qkv_b.astype(g.np_ft))], name=f"l{i}/qkv_bias")[0]
        pk, pv = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        ok, ov = f"present.{i}.key", f"present.{i}.value"
        inputs += [helper.make_tensor_value_info(pk, kv_type, kv_shape),
                   helper.make_tensor_value_info(pv, kv_type, kv_shape)]
        outputs += [helper.make_tensor_value_info(ok, kv_type, kv_shape),
                    helper.make_tensor_value_info(ov, kv_type, kv_shape)]
        if opts.pad_query:
            qkv = g.node("Pad", [qkv, g.init("pad_seq3", np.array([0, 0, 0, 0, 1, 0], np.int64))], name=f"l{i}/qkv_pad")[0]
        sliding = c.is_sliding(i)
        cos_n, sin_n = rotary["local_" if sliding else ""]
        gqa_in = [qkv, "", "", pk, pv, seqlens, total, cos_n, sin_n, positions,
                  biases[1] if sliding and windowed else bias]
        extra = {}
        if int8_kv:  # inputs 11-13: head_sink (unused), k_scale, v_scale, each [1, kv_heads, 1, head_dim]
            gqa_in += ["", g.init(f"l{i}.k_scale", kv_scales[i, 0].reshape(1, c.kv_heads, 1, c.head_dim).astype(np.float32)),
                       g.init(f"l{i}.v_scale", kv_scales[i, 1].reshape(1, c.kv_heads, 1, c.head_dim).astype(np.float32))]
            extra = dict(kv_cache_bit_width=8, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL")
        if gemma:  # QK-norm before the rotation (GroupQueryAttention's own q/k norm inputs are GPU-only)
            gqa_in[:3] = _qk_norm(g, qkv, c, L, i, eps)
        if c.attn_scale:
            extra["scale"] = float(c.attn_scale)
        attrs = dict(num_heads=c.heads, kv_num_heads=c.kv_heads, do_rotary=1, rotary_interleaved=0,
                     local_window_size=-1, **extra)
        if wide is None:
            attn = g.node("GroupQueryAttention", gqa_in, domain=MS, name=f"l{i}/attn",
                          outputs=[f"l{i}/attn/out", ok, ov], **attrs)[0]
        else:
            attn = _attention_either_path(g, i, gqa_in, [f"l{i}/attn/out", ok, ov], attrs, wide, c.kv_heads)
        if opts.pad_query:  # drop the pad row: the first S rows
            attn = g.node("Slice", [attn, g.init("zero_i64", np.array([0], np.int64)), g.init("minus_one_i64", np.array([-1], np.int64)),
                                    g.init("one_i64", np.array([1], np.int64))], name=f"l{i}/attn_unpad")[0]
        o = g.linear(attn, L("self_attn.o_proj.weight"), f"l{i}/o_proj", bits)
        if gemma:  # a norm on the attention output before the residual add, then the MLP's own input norm
            o = g.rms_norm(o, L("post_attention_layernorm.weight"), f"l{i}/post_attn_norm", eps)
        x, _, _, residual = g.node("SkipSimplifiedLayerNormalization",
                                   [o, residual, g.init(f"l{i}.post_norm", L("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight").astype(g.np_ft))],
                                   domain=MS, name=f"l{i}/post_norm", n_out=4, epsilon=eps)
        gu = g.linear(x, np.concatenate([L("mlp.gate_proj.weight"), L("mlp.up_proj.weight")]), f"l{i}/gate_up", bits)
        gate, up = g.node("Split", [gu, g.init(f"l{i}/split", np.array([c.intermediate] * 2, np.int64))],
                          n_out=2, name=f"l{i}/split", axis=-1)
        if gemma:
            gate = g.node("Gelu", [gate], name=f"l{i}/gelu", approximate="tanh")[0]
        else:
            gate = g.node("Mul", [gate, g.node("Sigmoid", [gate], name=f"l{i}/sigmoid")[0]], name=f"l{i}/silu")[0]
        act = g.node("Mul", [gate, up], name=f"l{i}/act")[0]
        down = g.linear(act, L("mlp.down_proj.weight"), f"l{i}/down", bits)
        if gemma:
            down = g.rms_norm(down, L("post_feedforward_layernorm.weight"), f"l{i}/post_mlp_norm", eps)
        last = i == n_layers - 1
        norm_w = w["model.norm.weight"] if last else w[f"model.layers.{i + 1}.input_layernorm.weight"]
        if last and adapter is not None:
            h = g.node("Add", [down, residual], name="final_residual")[0]
            h = g.node("MatMul", [h, g.init("adapter", adapter.astype(g.np_ft))], name="adapter")[0]
            x = g.node("SimplifiedLayerNormalization", [h, g.init("final_norm", norm_w.astype(g.np_ft))],
                       name="final_norm", axis=-1, epsilon=eps, stash_type=1)[0]
            break
        x, _, _, residual = g.node("SkipSimplifiedLayerNormalization",
                                   [down, residual, g.init(f"l{i + 1}.input_norm" if not last else "final_norm", norm_w.astype(g.np_ft))],
                                   domain=MS, name=f"l{i + 1}/input_norm" if not last else "final_norm", n_out=4, epsilon=eps)
    # logits only for the last `logits_keep` rows (0 = all): a 2k-token prefill needs one row, not 400 MB
    neg = g.node("Neg", ["logits_keep"], name="keep_neg")[0]
    x = g.node("Slice", [x, neg, g.init("int_max", np.array([2**62], np.int64)), g.init("axis_1", np.array([1], np.int64))],
               name="keep_rows")[0]
    head = ck.lm_head if vocab_ids is None else ck.lm_head[np.asarray(vocab_ids)]
    if opts.rescores(c.tie_embeddings, c.hidden, head.shape[0], trimmed=vocab_ids is not None):
        logits = g.rescored_head(x, head, c.embed_scale)
    else:
        logits = g.linear(x, head, "lm_head", opts.head_bits, rows="R")
    if ft != TensorProto.FLOAT:
        logits = g.node("Cast", [logits], name="logits_cast", to=TensorProto.FLOAT)[0]
    g.node("Identity", [logits], name="logits_out", outputs=["logits"])
    outputs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "R", head.shape[0]]))
    if opts.topk:
        # greedy verification needs only the argmax and Token Recycling the top-k, sampling the probabilities of the
        # best k: k ids (+ probabilities) per row instead of [R, V] floats for numpy to sort (kernels/postprocess.py)
        head_nodes, head_inputs, head_outputs = sampling_head(logits)
        g.nodes += head_nodes
        inputs += head_inputs
        outputs[1:1] = head_outputs

    graph = helper.make_graph(g.nodes, "edgespec_decoder", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="edgespec")
    model.ir_version = IR_VERSION
    return model


def save_model(model: onnx.ModelProto, path: str) -> None:
    """model.onnx + one external-data file beside it (weights > 2 GB and mmap-friendly)."""
    import os

    data = os.path.basename(path) + ".data"
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=1024)
