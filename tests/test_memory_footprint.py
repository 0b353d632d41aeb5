"""memory.footprint: byte counts checked by hand arithmetic on the embedded SmolLM2-135M export (30 layers, 3 KV
heads, head dim 64, hidden 576, intermediate 1536, vocab 49152; int4 body in blocks of 32 with zero points, 8-bit
head, fp32 embedding, rotary tables for 8192 positions), plus monotonicity properties.

The manifest (SMOLLM2, tests/helpers.py) holds the real one's numbers (edge_model.json of the embedded default), so
these tests need no export on disk.
"""
from __future__ import annotations

import math

import copy
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.manifest import Manifest
from helpers import SMOLLM2, smollm2_manifest
from memory import (MB, Calibration, LinearBytes, Speculation, graph_weight_bytes, kv_bytes_per_token, kv_capacity,
                    linear_bytes, predict_peak, predict_weight_bytes, resident_weight_bytes)
from memory.footprint import DEFAULT_CALIBRATIONS, LOOKUP_BYTES_PER_TOKEN

PROPERTY = settings(max_examples=150, deadline=None, database=None)

# external data files of the real export (model.onnx.data), i.e. weight_bytes without the graph protobuf
TARGET_DATA, DRAFTER_DATA = 216_233_216, 125_345_024

M = smollm2_manifest()  # an int4 export from before GRAPH_VERSION 6: integer zero points (block_min=False)
CPU = DEFAULT_CALIBRATIONS["cpu"]


# ------------------------------------------------------------------------------------------- KV and linears
@pytest.mark.parametrize("layers, kv_dtype, expected", [
    (30, "float32", 2 * 30 * 3 * 64 * 4),  # 46080: the target
    (2, "float32", 2 * 2 * 3 * 64 * 4),  # 3072: the 2-layer drafter
    (30, "float16", 2 * 30 * 3 * 64 * 2),  # 23040
])
def test_kv_bytes_per_token(layers, kv_dtype, expected):
    assert kv_bytes_per_token(M.arch, layers, kv_dtype) == expected
    g = replace(M.target, layers=layers, kv_dtype=kv_dtype)
    assert M.kv_bytes_per_token(g) == expected  # agrees with the manifest's own count
    assert expected in (46080, 3072, 23040)


@pytest.mark.parametrize("k, n, bits, fb, zp, expected", [
    # int4, blocks of 32: K·N/2 packed, (K/32)·N·4 scales, N·ceil((K/32)/2) zero points
    (576, 960, 4, 4, True, LinearBytes(packed=276_480, scales=69_120, zero_points=8_640)),  # qkv
    (1536, 576, 4, 4, True, LinearBytes(packed=442_368, scales=110_592, zero_points=13_824)),  # down
    (576, 960, 4, 4, False, LinearBytes(packed=276_480, scales=69_120)),  # symmetric: no zero points
    (576, 49152, 8, 4, True, LinearBytes(packed=28_311_552, scales=3_538_944, zero_points=884_736)),  # 8-bit head
    (576, 960, None, 4, True, LinearBytes(float_weight=576 * 960 * 4)),  # fp32 MatMul
    (576, 960, None, 2, True, LinearBytes(float_weight=576 * 960 * 2)),  # fp16 MatMul
    (40, 8, 4, 4, True, LinearBytes(packed=8 * 2 * 16, scales=8 * 2 * 4, zero_points=8 * 1)),  # K padded to 64
])
def test_linear_bytes(k, n, bits, fb, zp, expected):
    assert linear_bytes(k, n, bits, 32, fb, zp) == expected


# ------------------------------------------------------------------------------------------- weights
def test_predicted_weights_of_the_real_target_match_its_data_file_to_the_byte():
    w = predict_weight_bytes(M.arch, precision="int4", block_size=32, lm_head_bits=8, max_len=8192, block_min=False)
    assert w.embedding == 49152 * 576 * 4 == 113_246_208
    assert w.body == LinearBytes(packed=53_084_160, scales=13_271_040, zero_points=1_658_880)  # 30 layers
    assert w.head == LinearBytes(packed=28_311_552, scales=3_538_944, zero_points=884_736)
    assert w.rotary == 2 * 8192 * 32 * 4 == 2_097_152
    assert w.norms == 61 * 576 * 4 == 140_544
    assert w.total - w.proto == TARGET_DATA
    assert abs(w.total - M.target.weight_bytes) < 100  # the protobuf estimate


def test_predicted_weights_of_the_real_drafter_match_its_data_file_to_the_byte():
    w = predict_weight_bytes(M.arch, layers=2, vocab=8192, precision="int4", lm_head_bits=8, max_len=8192,
                             block_min=False)
    assert w.embedding == 113_246_208  # a drafter embeds the full target vocabulary
    assert w.head == LinearBytes(packed=4_718_592, scales=589_824, zero_points=147_456)  # trimmed to 8192 rows
    assert w.total - w.proto == DRAFTER_DATA
    assert abs(w.total - M.drafters[0].weight_bytes) < 100


@pytest.mark.parametrize("precision, head_bits, embedding, body_total, head_total", [
    # the exporter's defaults: an 8-bit head for int bodies, a float head otherwise; fp16 halves every float
    ("fp32", None, 113_246_208, 30 * 3_538_944 * 4, 576 * 49152 * 4),
    ("fp16", None, 56_623_104, 30 * 3_538_944 * 2, 576 * 49152 * 2),
    ("int8", None, 113_246_208, 30 * (3_538_944 + 3_538_944 // 32 * 4 + 3_538_944 // 32), 32_735_232),
    ("int4", 0, 113_246_208, 68_014_080, 576 * 49152 * 4),  # lm_head_bits=0: float head
])
def test_what_if_precisions(precision, head_bits, embedding, body_total, head_total):
    w = predict_weight_bytes(M.arch, precision=precision, lm_head_bits=head_bits, max_len=8192, block_min=False)
    assert (w.embedding, w.body.total, w.head.total) == (embedding, body_total, head_total)


def test_graph_weight_bytes_reconciles_with_the_manifest():
    for g in M.graphs:
        w = graph_weight_bytes(M, g)
        assert w.total == g.weight_bytes
        assert abs(w.other) < 100
    # an unrecorded export option (here a 576x576 fp32 adapter) shows up in `other`, not lost
    g = replace(M.drafters[0], weight_bytes=M.drafters[0].weight_bytes + 576 * 576 * 4)
    assert graph_weight_bytes(M, g).other == 576 * 576 * 4 - 5  # -5: the protobuf estimate's error
    assert predict_weight_bytes(M.arch, layers=2, vocab=8192, max_len=8192, adapter=True, block_min=False).other == 576 * 576 * 4


def touched(ctx: int) -> int:
    """The SmolLM2 embedding's resident bytes at `ctx` tokens: 1728 windows of 64 KB, ctx^0.8 distinct rows."""
    return round(1728 * -math.expm1(-ctx ** 0.8 / 1728) * 65536)


def test_resident_weights_on_the_cpu():
    """CPU EP: MatMulNBits repacked with a second scale-sized block; the embedding paged in 64 KB fault-around
    windows around the rows of the distinct tokens seen (Heaps' law: 1000^0.8 ≈ 251 of them)."""
    w = predict_weight_bytes(M.arch, max_len=8192, block_min=False)
    prepacked = 53_084_160 + 2 * 13_271_040 + 1_658_880 + 28_311_552 + 2 * 3_538_944 + 884_736
    assert prepacked == 117_559_296
    ctx = 1000
    assert w.embedding == 49152 * 576 * 4 == 1728 * 65536  # 1728 windows of 64 KB
    assert 14 * MB < touched(ctx) < 15 * MB  # ≈ 234 windows
    assert resident_weight_bytes(w, CPU, ctx) == prepacked + touched(ctx) + 2_097_152 + 140_544
    assert resident_weight_bytes(w, CPU, 10**6) == prepacked + w.embedding + 2_097_152 + 140_544  # capped
    full = DEFAULT_CALIBRATIONS["gpu"]
    assert resident_weight_bytes(w, full, ctx) == w.total - w.proto


# ------------------------------------------------------------------------------------------- peak
def test_plain_decoding_breakdown_at_1024():
    fp = predict_peak(M, Speculation(), 1024)
    span = 1025  # 1024 committed + the 1-token call
    assert fp["baseline"] == 85 * MB
    assert fp["target.kv"] == 46080 * (span + 1)  # + the pad row's scratch slot (edge.kv.KVCache)
    assert fp["target.logits"] == 1 * 49152 * 4
    # the prefill chunk of 256 rows (memory.footprint.PREFILL_CHUNK) dominates: b·S·hidden + e·S·T
    assert fp["target.arena"] == 80 * 256 * 576 + 8 * 256 * span == 13_895_680
    assert fp["runtime.bias"] == 256 * span * 4
    assert fp["target.session"] == round(16.5 * MB) + (span + 256) * 4 + 256 * 256 * 4
    assert fp["target.weights"] == 117_559_296 + touched(1024) + 2_097_152 + 140_544 + 17
    assert fp.total_bytes == sum(b for _, b in fp.parts)
    # the engine holds the lookup history and Token Recycling's tables whatever drafter runs
    assert set(fp.breakdown_mb()) == {"baseline", "target.weights", "target.session", "target.kv", "target.logits",
                                      "target.arena", "runtime.bias", "lookup.state", "recycling.matrix",
                                      "recycling.pairs"}
    assert fp.to_dict()["total_mb"] == round(fp.total_mb, 2)


def test_chain_extras_over_plain():
    ctx, k = 2048, 4
    plain, spec = predict_peak(M, Speculation(), ctx), predict_peak(M, Speculation("lookup", k), ctx)
    assert spec["target.kv"] - plain["target.kv"] == k * 46080  # K uncommitted slots
    assert spec["target.logits"] == (k + 1) * 49152 * 4
    assert spec["lookup.state"] == ctx * LOOKUP_BYTES_PER_TOKEN == ctx * 488
    assert spec.total_bytes > plain.total_bytes


def test_model_drafter_components():
    ctx, k = 1024, 4
    fp = predict_peak(M, Speculation("model", k, "drafter-l2-v8192"), ctx)
    assert fp["drafter.kv"] == 3072 * (ctx + k + 1 + 1)
    assert fp["drafter.logits"] == 8192 * 4
    assert fp["drafter.id_map"] == 8192 * 8
    drafter_prepacked = 3_538_944 + 2 * 884_736 + 110_592 + 4_718_592 + 2 * 589_824 + 147_456
    assert fp["drafter.weights"] == drafter_prepacked + touched(1024) + 2_097_152 + 5 * 576 * 4 - 5  # other: -5 B
    assert fp["drafter.session"] == round(2.5 * MB) + (ctx + k + 1 + 256) * 4 + 256 * 256 * 4
    # the first drafter is the default graph
    assert predict_peak(M, Speculation("model", k), ctx) == fp


def test_preallocated_capacity_sizes_only_the_kv_buffers():
    """A runtime that allocated 4096 slots but holds 750 tokens: KV is paid in full, the rest follows use."""
    spec = Speculation("model", 4)
    fp = predict_peak(M, spec, 750, capacity=4096)
    used = predict_peak(M, spec, 750)
    assert fp["target.kv"] == 46080 * 4097 and fp["drafter.kv"] == 3072 * 4097  # + one scratch slot each
    for part in ("target.arena", "drafter.arena", "runtime.bias", "target.weights", "target.logits"):
        assert fp[part] == used[part]
    # a full preallocated cache: the buffers, not the last call's rows (the runtime drafts less there)
    full = predict_peak(M, spec, 4095, capacity=4096)
    assert full["target.kv"] == 46080 * 4097 and full["drafter.kv"] == 3072 * 4097
    small = predict_peak(M, spec, 750, capacity=10)  # never fewer slots than the context and one call need
    assert small["target.kv"] == 46080 * 752 and small["drafter.kv"] == 3072 * 752


def test_recycling_matrix_dtype_follows_vocab():
    fp = predict_peak(M, Speculation("recycling", 16), 512)
    assert fp["recycling.matrix"] == 49152 * 8 * 2 + 49152  # uint16 ids (V < 65536) + the seen mask
    big = copy.deepcopy(SMOLLM2)
    big["arch"]["vocab"] = 128256
    for g in big["graphs"]:
        g["vocab"], g["weight_bytes"] = 128256, 0
    fp = predict_peak(Manifest.from_dict(big), Speculation("recycling", 16, recycling_k=4), 512)
    assert fp["recycling.matrix"] == 128256 * 4 * 4 + 128256  # int32 ids
    assert fp["recycling.pairs"] == (1 << 17) * (8 + 4)  # 128256² does not fit uint32 keys


@pytest.mark.parametrize("vocab,k", [(49152, 8), (128256, 4)])
def test_recycling_bytes_are_the_drafters_own(vocab, k):
    """The footprint model counts exactly the arrays RecyclingDrafter allocates (matrix, mask, pair table)."""
    from edge.drafters import RecyclingDrafter

    big = copy.deepcopy(SMOLLM2)
    big["arch"]["vocab"] = vocab
    for g in big["graphs"]:
        g["vocab"], g["weight_bytes"] = vocab, 0
    fp = predict_peak(Manifest.from_dict(big), Speculation("recycling", 16, recycling_k=k), 512)
    assert fp["recycling.matrix"] + fp["recycling.pairs"] == RecyclingDrafter(vocab, k=k).nbytes


def test_soak_checks_every_drafter_state_against_its_bound(tiny_dir):
    """edge.tools.soak's per-turn check: every size has a "<name>_bound" entry and is compared with it, Token Recycling's
    bytes against the footprint model's fixed size (two bounds were once keyed "recycling_bound" and
    "cached_bound", so those two checks never ran)."""
    import numpy as np

    import edge
    from edge.tools.soak import drafter_state, within_bounds

    e = edge.load(tiny_dir, drafter="none", context=256)
    state = drafter_state(e)
    assert {k for k in state if not k.endswith("_bound") and k + "_bound" not in state} == set(), state
    assert state["recycling_bytes"] == state["recycling_bytes_bound"] and within_bounds(state) == []
    e.recycling.pair_next = np.zeros(2 * e.recycling.PAIR_SLOTS, e.recycling.pair_next.dtype)  # as if it had grown
    assert within_bounds(drafter_state(e)) == ["recycling_bytes"]


def test_hybrid_holds_both_model_free_states():
    fp = predict_peak(M, Speculation("hybrid", 8), 1000)
    assert fp["lookup.state"] == 1000 * 488 and fp["recycling.matrix"] == 49152 * 17


def test_on_graph_topk_and_sampling_work_arrays():
    fp = predict_peak(M, Speculation("lookup", 4, verify_topk=8), 256)
    assert fp["target.logits"] == 5 * 8 * 12 + 49152 * 4  # ids int64 + probs fp32, plus one full prefill row
    fp = predict_peak(M, Speculation("model", 4, sampling=True), 256)
    assert fp["verify.work"] == 5 * 49152 * 4 + 4 * 49152 * 8  # p [S, V] fp32 + q [K, V] fp64


def test_min_call_padding_and_kv_capacity():
    fp = predict_peak(M, Speculation(), 100, min_call=2)
    assert fp["target.logits"] == 2 * 49152 * 4
    assert kv_capacity(100, Speculation()) == 101
    assert kv_capacity(100, Speculation("lookup", 7)) == 108
    assert kv_capacity(100, Speculation(), min_call=2) == 102


def test_calibration_overrides_and_errors():
    c = Calibration.from_dict({"baseline_mb": 100, "attn_bytes_per_row_token": 36}, "cpu")
    assert c.baseline_mb == 100.0 and c.attn_bytes_per_row_token == 36.0 and c.weights == "prepacked"
    assert Calibration.from_dict(None, "gpu").weights == "full"
    with pytest.raises(ValueError, match="unknown memory calibration key"):
        Calibration.from_dict({"baseline": 1})
    with pytest.raises(ValueError, match=r"embedding_distinct_exp must be in \[0, 1\]"):  # was an OverflowError
        Calibration.from_dict({"embedding_distinct_exp": 1000})  # traceback when the planner used it
    with pytest.raises(ValueError, match="device class"):
        Calibration.from_dict({}, "tpu")
    with pytest.raises(ValueError, match=">= 0"):
        Calibration(baseline_mb=-1.0)
    a = predict_peak(M, Speculation(), 512, c)
    b = predict_peak(M, Speculation(), 512)
    assert a["baseline"] - b["baseline"] == 15 * MB


@pytest.mark.parametrize("kw, msg", [
    (dict(drafter="tree"), "choose one of"),
    (dict(drafter="none", nodes=3), "'none' has 0"),
    (dict(drafter="lookup", nodes=0), "'none' has 0"),
    (dict(drafter="lookup", nodes=2, draft_width=0), "draft_width"),
])
def test_speculation_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Speculation(**kw)


def test_context_must_be_positive_and_plans_typed():
    with pytest.raises(ValueError, match="context"):
        predict_peak(M, Speculation(), 0)
    with pytest.raises(TypeError, match="Speculation or a Plan"):
        predict_peak(M, {"drafter": "none"}, 10)
    with pytest.raises(ValueError, match="no drafter graph"):
        predict_peak(Manifest.from_dict({**SMOLLM2, "graphs": SMOLLM2["graphs"][:1]}),
                     Speculation("model", 2), 10)


# ------------------------------------------------------------------------------------------- properties
archs = st.fixed_dictionaries({
    "hidden": st.sampled_from([64, 576, 896, 2048]), "layers": st.integers(1, 40), "heads": st.sampled_from([4, 8]),
    "kv_heads": st.sampled_from([1, 2, 4]), "head_dim": st.sampled_from([32, 64, 128]),
    "intermediate": st.sampled_from([128, 1536, 4864]), "vocab": st.sampled_from([384, 49152, 151936]),
    "max_positions": st.just(16384)})


def _manifest(arch, precision, drafter_layers, drafter_vocab):
    d = copy.deepcopy(SMOLLM2)
    d["arch"] = arch
    d["graphs"][0].update(layers=arch["layers"], vocab=arch["vocab"], precision=precision, weight_bytes=0)
    d["graphs"][1].update(layers=min(drafter_layers, arch["layers"]), vocab=min(drafter_vocab, arch["vocab"]),
                          precision=precision, weight_bytes=0)
    return Manifest.from_dict(d)


@PROPERTY
@given(arch=archs, precision=st.sampled_from(["fp32", "fp16", "int8", "int4"]), dl=st.integers(1, 4),
       dv=st.sampled_from([128, 8192]), drafter=st.sampled_from(["none", "lookup", "recycling", "hybrid", "model"]),
       ctx=st.integers(1, 8192), dctx=st.integers(0, 4096), k=st.integers(1, 64), dk=st.integers(0, 16),
       device=st.sampled_from(["cpu", "gpu", "npu"]), chunk=st.sampled_from([128, 512]))
def test_peak_is_monotone_in_context_and_draft_length(arch, precision, dl, dv, drafter, ctx, dctx, k, dk, device,
                                                      chunk):
    m = _manifest(arch, precision, dl, dv)
    cal = DEFAULT_CALIBRATIONS[device]
    n0, n1 = (0, 0) if drafter == "none" else (k, k + dk)
    p = lambda n, c: predict_peak(m, Speculation(drafter, n), c, cal, prefill_chunk=chunk).total_bytes  # noqa
    assert p(n0, ctx) <= p(n0, ctx + dctx)
    assert p(n0, ctx) <= p(n1, ctx)
    assert p(n0, ctx) >= predict_peak(m, Speculation(), ctx, cal, prefill_chunk=chunk).total_bytes  # >= plain


def test_memory_never_imports_onnxruntime():
    code = "import sys, memory, memory.planner; assert 'onnxruntime' not in sys.modules, 'memory imported ORT'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
