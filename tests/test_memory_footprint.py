"""memory.footprint: byte counts checked by hand arithmetic on the embedded SmolLM2-135M export (30 layers, 3 KV
heads, head dim 64, hidden 576, intermediate 1536, vocab 49152; int4 body in blocks of 32 with zero points, 8-bit
head, fp32 embedding, rotary tables for 8192 positions), plus monotonicity properties and more byte counts by hand
(zero points, ragged K, biases, quantized embeddings and their resident windows, arenas, drafter calls).

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
from memory.footprint import (DEFAULT_CALIBRATIONS, LOOKUP_BYTES_PER_TOKEN, WeightBytes, block_min_extra, drafter_graph,
                              embedding_resident_bytes)

PROPERTY = settings(max_examples=150, deadline=None, database=None)

# external data files of the real export (model.onnx.data), i.e. weight_bytes without the graph protobuf
TARGET_DATA, DRAFTER_DATA = 216_233_216, 125_345_024

M = smollm2_manifest()  # an int4 export from before GRAPH_VERSION 6: integer zero points (block_min=False)
CPU = DEFAULT_CALIBRATIONS["cpu"]
DRAFT = "drafter-l2-v8192"


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
    """CPU EP: MatMulNBits repacked (bits, scales and zero points once each); the embedding paged in 64 KB
    fault-around windows around the rows of the distinct tokens seen (Heaps' law: 1000^0.8 ≈ 251 of them)."""
    w = predict_weight_bytes(M.arch, max_len=8192, block_min=False)
    prepacked = 53_084_160 + 13_271_040 + 1_658_880 + 28_311_552 + 3_538_944 + 884_736
    assert prepacked == 100_749_312
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
    assert fp["baseline"] == 70 * MB
    assert fp["tokenizer"] == 0  # this manifest lists no tokenizer file (test_the_tokenizer_is_counted_by_its_file)
    assert fp["target.kv"] == 46080 * (span + 1)  # + the pad row's scratch slot (edge.kv.KVCache)
    assert fp["target.logits"] == 1 * 49152 * 4
    # the prefill chunk of 256 rows (memory.footprint.PREFILL_CHUNK) dominates: b·S·hidden + e·S·T
    assert fp["target.arena"] == 80 * 256 * 576 + 8 * 256 * span == 13_895_680
    assert fp["runtime.bias"] == 256 * span * 4
    assert fp["target.session"] == round(16.5 * MB) + (span + 256) * 4 + 256 * 256 * 4
    assert fp["target.weights"] == 100_749_312 + touched(1024) + 2_097_152 + 140_544 + 17
    assert fp.total_bytes == sum(b for _, b in fp.parts)
    # the engine holds the lookup history and Token Recycling's tables whatever drafter runs
    assert set(fp.breakdown_mb()) == {"baseline", "tokenizer", "target.weights", "target.session", "target.kv", "target.logits",
                                      "target.arena", "runtime.bias", "lookup.state", "recycling.matrix",
                                      "recycling.pairs"}
    assert fp.to_dict()["total_mb"] == round(fp.total_mb, 2)


def test_the_tokenizer_is_counted_by_its_file():
    """The tokenizers library holds ~8 bytes per byte of tokenizer.json (measured: 15 MB for SmolLM2's 1.9 MB
    file, 93 MB for Gemma 3's 11.7 MB): a 262k-token vocabulary is not in a fixed baseline."""
    from dataclasses import replace

    from edge.manifest import FileEntry

    m = replace(M, files=M.files + (FileEntry(M.tokenizer, 12_000_000, "0" * 64),))
    plain, big = predict_peak(M, Speculation(), 512), predict_peak(m, Speculation(), 512)
    assert big["tokenizer"] == 96_000_000 and big.total_bytes - plain.total_bytes == 96_000_000


def test_compact_tokenizer_tables_are_counted_in_place_of_the_library():
    """An export with edge.bpe's tables beside tokenizer.json is read through them: their file's bytes are what the
    runtime holds (Gemma 3: 13 MB against the library's 93), wherever the tokenizer sits in the model directory."""
    from dataclasses import replace

    from edge.manifest import FileEntry
    from memory.footprint import TOKENIZER_TABLES, tokenizer_bytes

    json_only = replace(M, files=M.files + (FileEntry(M.tokenizer, 12_000_000, "0" * 64),))
    both = replace(json_only, files=json_only.files + (FileEntry(TOKENIZER_TABLES, 13_000_000, "0" * 64),))
    assert tokenizer_bytes(json_only) == 96_000_000 and tokenizer_bytes(both) == 13_000_000
    nested = replace(both, tokenizer="tok/tokenizer.json",
                     files=(FileEntry("tok/tokenizer.json", 12_000_000, "0" * 64),
                            FileEntry(TOKENIZER_TABLES, 13_000_000, "0" * 64)))  # tables of another directory
    assert tokenizer_bytes(nested) == 96_000_000
    assert predict_peak(both, Speculation(), 512)["tokenizer"] == 13_000_000


def test_a_rescored_head_puts_two_vocabulary_rows_per_kept_row_in_the_arena():
    """The coarse logits and their rescored copy are [R, vocab] floats in ORT's arena (beyond the bound logits):
    the term grows with the verify call's rows, for a two-stage head only."""
    from dataclasses import replace

    t = replace(M.target, embedding_bits=8, lm_head_bits=8, precision="int8", weight_bytes=0)
    one = replace(M, graphs=(t,) + tuple(M.drafters))
    two = replace(M, graphs=(replace(t, head_rescore=16),) + tuple(M.drafters))

    from memory.footprint import arena_bytes

    def arena(m, k):
        return predict_peak(m, Speculation("lookup", k), 512)["target.arena"]

    per_row = CPU.rescore_bytes_per_row_vocab * t.vocab
    assert per_row > 0
    for rows in (1, 9, 33):
        plain = arena_bytes(CPU, 576, t.vocab, rows, rows, 600)
        assert arena_bytes(CPU, 576, t.vocab, rows, rows, 600, rescored=True) - plain == round(rows * per_row)
    # past the prefill chunk's workspace, each verify row adds its logits rows to a rescored target's arena only
    assert arena(one, 48) - arena(one, 40) < per_row / 4
    assert arena(two, 48) - arena(two, 40) >= round(8 * per_row)


def test_a_rescored_head_keeps_the_whole_embedding_table():
    """A two-stage head reads its candidates' rows of the memory-mapped table on every call: the whole table is
    counted, where a one-stage head's graph counts the rows its context looked up."""
    from dataclasses import replace

    t = replace(M.target, embedding_bits=8, lm_head_bits=8, precision="int8", weight_bytes=0)
    one = replace(M, graphs=(t,) + tuple(M.drafters))
    two = replace(M, graphs=(replace(t, head_rescore=16),) + tuple(M.drafters))
    w1, w2 = graph_weight_bytes(one, one.target), graph_weight_bytes(two, two.target)
    assert w2.embedding == w1.embedding and w2.head.total < w1.head.total / 1.5  # the coarse 4-bit head
    extra = resident_weight_bytes(w2, CPU, 64, rescored=True) - resident_weight_bytes(w2, CPU, 64)
    assert extra == w2.embedding - embedding_resident_bytes(w2, CPU, 64) > 0
    assert predict_peak(two, Speculation(), 64)["target.weights"] == resident_weight_bytes(w2, CPU, 64, rescored=True)
    assert predict_peak(one, Speculation(), 64)["target.weights"] == resident_weight_bytes(w1, CPU, 64)


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
    drafter_prepacked = 3_538_944 + 884_736 + 110_592 + 4_718_592 + 589_824 + 147_456
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
    assert a["baseline"] - b["baseline"] == (100 - Calibration().baseline_mb) * MB


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


# ------------------------------------------------------------------------------------------- byte counts by hand
def test_linear_bytes_round_zero_points_and_skip_block_min_for_ragged_k():
    # K = 96: 3 blocks of 32; 4-bit zero points pack two per byte, so 2 bytes per output channel
    assert linear_bytes(96, 10, 4) == linear_bytes(96, 10, 4, block_min=False)
    assert linear_bytes(96, 10, 4).zero_points == 10 * 2 and linear_bytes(96, 10, 4).packed == 10 * 3 * 16
    # block minimums: ceil(blocks / 32) residual blocks, only for whole blocks (export.graph keeps ragged K plain)
    assert [block_min_extra(k, 32) for k in (576, 1024, 1056, 4096)] == [1, 1, 2, 4]
    assert linear_bytes(576, 8, 4, block_min=True).packed == 8 * (18 + 1) * 16
    assert linear_bytes(40, 8, 4, block_min=True) == linear_bytes(40, 8, 4)


def test_what_if_weights_for_biases_w8a8_quantized_embeddings_and_a_4bit_head():
    arch = {**SMOLLM2["arch"], "qkv_bias": True}
    hidden, q, kv, inter, layers, vocab = 576, 9 * 64, 3 * 64, 1536, 30, 49152
    w = predict_weight_bytes(arch, precision="fp32", block_min=False)
    assert w.other == layers * (q + 2 * kv) * 4
    w = predict_weight_bytes(SMOLLM2["arch"], precision="w8a8", block_min=False)
    per_layer = sum(k * n + n * 4 for k, n in ((hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)))
    assert w.body.total == layers * per_layer and w.head.total == hidden * vocab + vocab * 4
    w = predict_weight_bytes(SMOLLM2["arch"], precision="int4", embedding_bits=4)
    assert w.embedding_row == 18 * (16 + 4 + 1) and w.embedding == vocab * 18 * 21
    w = predict_weight_bytes(SMOLLM2["arch"], precision="int4", embedding_bits=4, zero_points=False)
    assert w.embedding_row == 18 * (16 + 4)
    # an int8 body with a 4-bit head: the head's block-sum matrix [hidden, 32 · extra] fp32 is the only one
    w = predict_weight_bytes(SMOLLM2["arch"], precision="int8", lm_head_bits=4, block_min=True)
    assert w.other == hidden * 32 * 1 * 4


def test_embedding_residency_windows():
    def occupancy(embedding, fault, distinct):
        windows = max(1, math.ceil(embedding / fault))
        return min(embedding, round(windows * -math.expm1(-distinct / windows) * fault))

    empty = WeightBytes(0, linear_bytes(32, 32, None), linear_bytes(32, 32, None), 0, 0, 0, 0)
    # rows wider than the fault-around window: a look-up maps at least its whole row
    w = replace(empty, embedding=1000 * 131072, embedding_row=131072)
    assert embedding_resident_bytes(w, CPU, 100) == occupancy(w.embedding, 131072, 100 ** 0.8)
    # a table that is not a whole number of windows: the last, partial window counts
    w = replace(empty, embedding=10 * 65536 + 4096, embedding_row=2304)
    assert embedding_resident_bytes(w, CPU, 3) == occupancy(w.embedding, 65536, 3 ** 0.8)
    cal = replace(CPU, embedding_distinct_coef=2.0)
    w = replace(empty, embedding=1728 * 65536, embedding_row=2304)
    assert embedding_resident_bytes(w, cal, 500) == occupancy(w.embedding, 65536, 2.0 * 500 ** 0.8)


def test_arena_and_bias_terms_by_hand():
    # context 100 < the 256-row prefill chunk: the prompt is one 100-row call
    fp = predict_peak(M, Speculation(), 100)
    assert fp["target.arena"] == 80 * 100 * 576 + 8 * 100 * 101
    assert fp["runtime.bias"] == 100 * 101 * 4
    # context 1: only 1-row calls, which reuse a view of the session's bias row
    assert predict_peak(M, Speculation(), 1)["runtime.bias"] == 0
    # a fixed arena (act_mb) is in MB
    cal = replace(CPU, act_mb=2.0)
    assert predict_peak(M, Speculation(), 100, cal)["target.arena"] == 2 * MB + 80 * 100 * 576 + 8 * 100 * 101
    # GPU: c·R·vocab counts the logits rows a call keeps (a prefill chunk keeps 1)
    gpu = DEFAULT_CALIBRATIONS["gpu"]
    fp = predict_peak(M, Speculation("lookup", 3), 2048, gpu)
    assert fp["target.arena"] == round(max(80 * 4 * 576 + 4 * 4 * 49152, 80 * 256 * 576 + 4 * 1 * 49152))


def test_a_wide_prefill_chunk_over_an_int8_cache_adds_its_float_copies_by_hand():
    """An int8-cache graph prefills chunks of 16 rows or more over a dequantized copy of the cache: the chunk's
    arena holds K and V of every position in use as float, three times (codes cast, scaled, the kernel's present)."""
    m = replace(M, graphs=[replace(M.target, kv_dtype="int8")] + list(M.drafters))
    fp = predict_peak(m, Speculation(), 100)
    assert fp["target.arena"] == 80 * 100 * 576 + 8 * 100 * 101 + 2 * 3 * (3 * 64 * 4) * 101
    # 2,048 tokens in 256-row chunks: the last chunk spans all of them
    fp = predict_peak(m, Speculation(), 2048)
    assert fp["target.arena"] == 80 * 256 * 576 + 8 * 256 * 2049 + 2 * 3 * (3 * 64 * 4) * 2049
    # a chunk narrower than WIDE_PREFILL_MIN takes the quantized kernel: no copies
    assert predict_peak(m, Speculation(), 15)["target.arena"] == 80 * 15 * 576 + 8 * 15 * 16
    # and the session holds two attention paths per layer (If branches)
    two_paths, one_path = (predict_peak(x, Speculation(), 100)["target.session"] for x in (m, M))
    assert two_paths - one_path == round(0.25 * MB * 30)


def test_model_drafter_calls_by_hand():
    """The drafter's call is its width + 1 rows (the accepted token and the draft), padded to min_call."""
    fp = predict_peak(M, Speculation("model", 4, DRAFT), 1)
    assert fp["drafter.arena"] == 80 * 2 * 576 + 8 * 2 * 3  # 2 rows over context 1 + 2
    fp = predict_peak(M, Speculation("model", 4, DRAFT), 1, min_call=2)
    assert fp["drafter.logits"] == 2 * 8192 * 4 and fp["drafter.arena"] == 80 * 3 * 576 + 8 * 3 * 4


def test_sampling_work_for_model_free_drafters_has_no_q():
    fp = predict_peak(M, Speculation("lookup", 4, sampling=True), 256)
    assert fp["verify.work"] == 5 * 49152 * 4


def test_calibration_bounds():
    with pytest.raises(ValueError, match="finite number >= 0"):
        Calibration(baseline_mb=math.inf)
    with pytest.raises(ValueError, match="finite number >= 0"):
        Calibration.from_dict({"session_mb": "inf"})
    assert Calibration(embedding_distinct_exp=1.0).embedding_distinct_exp == 1.0  # distinct = context: allowed


def test_the_default_drafter_is_the_best_agreeing_graph():
    d = copy.deepcopy(SMOLLM2)
    better = copy.deepcopy(d["graphs"][1])
    better.update(name="drafter-better", stats={"top1_agreement": 0.5})
    d["graphs"].append(better)
    m2 = Manifest.from_dict(d)
    assert drafter_graph(m2).name == "drafter-better"
    assert predict_peak(m2, Speculation("model", 2), 100) == predict_peak(m2, Speculation("model", 2, "drafter-better"),
                                                                          100)


def test_kv_capacity_is_the_wider_of_the_call_and_min_call():
    assert kv_capacity(100, Speculation("lookup", 7), min_call=4) == 108
    assert kv_capacity(100, Speculation("lookup", 2), min_call=4) == 104


@pytest.mark.parametrize("bad", [float("nan"), "0.9", True, 1.5, -0.1, None])
def test_a_malformed_agreement_in_the_manifest_falls_back_to_the_default_prior(bad):
    """A hand-edited top1_agreement that is not a probability: the planner's prior, the engine's, and the choice of
    drafter graph use the default instead of a NaN plan (the prior check refuses NaN) or a TypeError."""
    from types import SimpleNamespace

    from memory.footprint import drafter_graph, top1_agreement
    from memory.planner import DEFAULT_MODEL_PRIOR, default_stats

    bad_g = SimpleNamespace(name="bad", stats={"top1_agreement": bad})
    good = SimpleNamespace(name="good", stats={"top1_agreement": 0.2})
    assert top1_agreement(bad_g, 0.3) == 0.3 and top1_agreement(good, 0.3) == 0.2
    m = SimpleNamespace(name="m", drafters=(bad_g, good))
    assert drafter_graph(m) is good
    assert default_stats(m)["bad"].rate[0, 0] == pytest.approx(DEFAULT_MODEL_PRIOR)
