"""The int8 KV cache: static per-channel scales (export/kvquant.py) and GroupQueryAttention's quantized cache.

Kinds: exact cases for the scales (rotary pair bounds, empty channels); round trips through the graph (the cache
holds round(x / scale) of the float-cache graph's K/V); the property speculation rests on (a token's logits do not
depend on how many tokens share its call, nor on where a prompt was split); end to end on a tiny export (speculative
greedy output equals plain)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import AttributeProto, TensorProto

from conftest import MAX_LEN, VOCAB, SessionView, causal, logits_alone_and_together, tiny_export_options
from edge.manifest import DEQUANTIZE_PAST
from export import kvquant
from export.evaluate import GraphRunner
from export.graph import GraphOptions, build_graph, save_model


def test_k_scales_bound_every_rotation_of_a_channel_pair():
    """K is cached after rotary, which turns channel pair (i, i + d/2) by a position's angle: the scale must
    cover the pair's norm, not just the values calibration happened to see."""
    rng = np.random.default_rng(0)
    d = 8
    k = rng.normal(size=(1, 1, 5, d)).astype(np.float32)
    v = rng.normal(size=(1, 1, 5, d)).astype(np.float32)
    m = kvquant.fold_maxima(None, [k, v], rows=5)
    s = kvquant.scales_from_maxima(m, margin=1.0)
    half = d // 2
    for angle in np.linspace(0, 2 * np.pi, 17):
        c, si = np.cos(angle), np.sin(angle)
        a, b = k[0, 0, :, :half], k[0, 0, :, half:]
        rot = np.concatenate([a * c - b * si, a * si + b * c], -1)
        assert np.all(np.abs(rot) <= s[0, 0, 0] * 127 * (1 + 1e-6))
    np.testing.assert_allclose(s[0, 1, 0] * 127, np.abs(v[0, 0]).max(0), rtol=1e-6)


def test_scales_only_count_the_calls_rows_and_never_reach_zero():
    k = np.zeros((1, 1, 4, 4), np.float32)
    k[0, 0, 3] = 100.0  # a slot past the call's rows (the pad query's scratch) is not the model's
    v = np.zeros_like(k)
    m = kvquant.fold_maxima(None, [k, v], rows=3)
    assert np.all(m == 0)
    s = kvquant.scales_from_maxima(m)
    assert np.all(s > 0) and np.all(np.isfinite(s))


def test_an_int8_cache_needs_scales_of_the_models_shape(tiny_llama):
    with pytest.raises(ValueError, match="kv_scales"):
        build_graph(tiny_llama, GraphOptions(precision="fp32", max_len=MAX_LEN, kv_cache="int8"))
    c = tiny_llama.config
    with pytest.raises(ValueError, match="kv_scales"):
        build_graph(tiny_llama, GraphOptions(precision="fp32", max_len=MAX_LEN, kv_cache="int8"),
                    kv_scales=np.ones((c.layers, 2, c.kv_heads + 1, c.head_dim), np.float32))
    with pytest.raises(ValueError, match="kv_cache"):
        GraphOptions(kv_cache="int4")


@pytest.fixture(scope="module")
def kv_graphs(tiny_llama, tmp_path_factory):
    """{(precision, kv_cache): graph path}, the int8-cache graphs with scales fitted on random prompts through the
    float-cache graph of the same precision, as the exporter does."""
    c = tiny_llama.config
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, VOCAB, n)) for n in (9, 30, 57)]
    out = {}
    for precision in ("fp32", "w8a8", "int4"):
        d = tmp_path_factory.mktemp(f"kv-{precision}")
        opts = GraphOptions(precision=precision, max_len=MAX_LEN)
        save_model(build_graph(tiny_llama, opts), str(d / "float.onnx"))
        runner = GraphRunner(str(d / "float.onnx"), c.layers, c.kv_heads, c.head_dim)
        scales = kvquant.kv_scales(runner, prompts)
        save_model(build_graph(tiny_llama, GraphOptions(precision=precision, max_len=MAX_LEN, kv_cache="int8"),
                               kv_scales=scales), str(d / "int8.onnx"))
        out[(precision, "float32")], out[(precision, "int8")] = d / "float.onnx", d / "int8.onnx"
        out[(precision, "scales")] = scales
    return out


def _attention_nodes(graph):
    """Every GroupQueryAttention of a graph, inside If branches too."""
    for n in graph.node:
        if n.op_type == "GroupQueryAttention":
            yield n
        for a in n.attribute:
            if a.type == AttributeProto.GRAPH:
                yield from _attention_nodes(a.g)


def test_int8_cache_graph_io(tiny_llama, kv_graphs):
    import onnx

    m = onnx.load(str(kv_graphs[("fp32", "int8")]), load_external_data=False)
    kv = [v for v in list(m.graph.input) + list(m.graph.output) if v.name.startswith(("past_key", "present"))]
    assert kv and all(v.type.tensor_type.elem_type == TensorProto.INT8 for v in kv)
    path = [v for v in m.graph.input if v.name == DEQUANTIZE_PAST]
    assert len(path) == 1 and path[0].type.tensor_type.elem_type == TensorProto.BOOL
    assert not path[0].type.tensor_type.shape.dim  # a scalar
    gqa = list(_attention_nodes(m.graph))
    quantized = [n for n in gqa if any(a.name == "kv_cache_bit_width" for a in n.attribute)]
    # one quantized kernel and one over the dequantized copy per layer, each in a branch of the layer's If
    assert len(quantized) == tiny_llama.config.layers and len(gqa) == 2 * len(quantized)
    assert not [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    for n in quantized:
        attrs = {a.name: a for a in n.attribute}
        assert attrs["kv_cache_bit_width"].i == 8
        assert attrs["k_quant_type"].s == attrs["v_quant_type"].s == b"PER_CHANNEL"
        assert n.input[12].endswith("k_scale") and n.input[13].endswith("v_scale")
    m = onnx.load(str(kv_graphs[("fp32", "float32")]), load_external_data=False)
    assert DEQUANTIZE_PAST not in {v.name for v in m.graph.input}  # a float cache has one path


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_the_dequantized_path_writes_the_same_codes_and_reads_only_the_committed_slots(tiny_llama, kv_graphs,
                                                                                      shared_kv, precision):
    """The prefill path (`dequantize_past` true) quantizes a call's new K/V with the same scales, so layer 0's
    codes (computed before any attention) equal the quantized kernel's bit for bit; it attends over the committed
    slots dequantized, so its logits stay close to the quantized kernel's, a second chunk included, and slots past
    the call's are never read or written."""
    c = tiny_llama.config
    path = kv_graphs[(precision, "int8")]
    ids = np.random.default_rng(21).integers(0, VOCAB, 40)
    runs = {}
    for wide in (False, True):
        s = shared_kv(path, c.layers, c.kv_heads, c.head_dim, MAX_LEN)
        s.kv[:, :, :, :, 40:] = np.random.default_rng(3).integers(-128, 128, s.kv[:, :, :, :, 40:].shape)
        stale = s.kv[:, :, :, :, 41:].copy()  # slot 40: the pad query row's scratch, where the graph has one
        first = s.run(ids[:24], np.arange(24), causal(24, 0), dequantize=wide)
        second = s.run(ids[24:], np.arange(24, 40), causal(16, 24), dequantize=wide)
        assert np.array_equal(s.kv[:, :, :, :, 41:], stale)
        runs[wide] = np.concatenate([first, second]), s.kv[:, :, :, :, :40].copy()
    (q_logits, q_kv), (d_logits, d_kv) = runs[False], runs[True]
    assert np.array_equal(q_kv[0], d_kv[0])
    assert np.abs(q_kv.astype(int) - d_kv.astype(int)).max() <= 8
    assert np.abs(q_logits - d_logits).max() < 0.1 * np.abs(q_logits).max()
    assert (q_logits.argmax(-1) == d_logits.argmax(-1)).mean() >= 0.9


def test_the_cache_holds_each_values_own_rounding(tiny_llama, kv_graphs, shared_kv):
    """What the kernel stores is round(x / scale) of the float-cache graph's K/V, value by value (clipped to the
    int8 range): nothing else in the call enters a token's codes. Layer 0's K/V come from the embeddings alone, so
    there the float graph's values are exactly what was quantized; later layers read attention over the quantized
    cache and only stay close."""
    c = tiny_llama.config
    ids = np.random.default_rng(8).integers(0, VOCAB, 21)
    fl = shared_kv(kv_graphs[("fp32", "float32")], c.layers, c.kv_heads, c.head_dim, MAX_LEN)
    q8 = shared_kv(kv_graphs[("fp32", "int8")], c.layers, c.kv_heads, c.head_dim, MAX_LEN)
    for s in (fl, q8):
        s.run(ids, np.arange(21), causal(21, 0), keep=1)
    scales = kv_graphs[("fp32", "scales")]
    for i in range(c.layers):
        for j in range(2):
            x = fl.kv[i, j, 0, :, :21]  # [kv_heads, 21, head_dim]
            want = np.clip(np.rint(x / scales[i, j][:, None, :]), -128, 127)
            got = q8.kv[i, j, 0, :, :21].astype(np.float64)
            if i == 0:  # a value within float error of a half step may round either way
                assert np.abs(got - want).max() <= 1 and np.mean(got == want) > 0.99
            else:
                assert np.abs(got - want).max() <= 8


@pytest.mark.parametrize("precision", ["fp32", "w8a8", "int4"])
def test_int8_cache_logits_do_not_depend_on_the_call(tiny_llama, kv_graphs, shared_kv, precision):
    """Lossless speculation with a quantized cache: a token's logits in a decode step (padded where the runtime's
    probe says so) equal its logits inside a verify call (bit for bit), and a prompt prefilled in one call or in
    chunks leaves the same cache and the same logits."""
    c = tiny_llama.config
    path = kv_graphs[(precision, "int8")]
    s = shared_kv(path, c.layers, c.kv_heads, c.head_dim, MAX_LEN)
    rng = np.random.default_rng(11)
    prompt, seq = rng.integers(0, VOCAB, 40), rng.integers(0, VOCAB, 8)

    min_call = s.min_call()  # 2 where the runtime pads a decode step on this host
    alone, together = logits_alone_and_together(SessionView(s, min_call), list(prompt), list(seq))
    assert np.array_equal(alone, together)
    whole = s.run(prompt, np.arange(40), causal(40, 0)).copy()
    cache_whole = s.kv[:, :, :, :, :40].copy()
    s.run(prompt[:13], np.arange(13), causal(13, 0))
    parts = s.run(prompt[13:], np.arange(13, 40), causal(27, 13)).copy()
    assert np.array_equal(whole[13:], parts)
    assert np.array_equal(cache_whole, s.kv[:, :, :, :, :40])


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_int8_cache_stays_close_to_the_float_cache(tiny_llama, kv_graphs, precision):
    c = tiny_llama.config
    rng = np.random.default_rng(2)
    f = GraphRunner(str(kv_graphs[(precision, "float32")]), c.layers, c.kv_heads, c.head_dim)
    q = GraphRunner(str(kv_graphs[(precision, "int8")]), c.layers, c.kv_heads, c.head_dim)
    agree = []
    for n in (12, 33, 50):
        ids = rng.integers(0, VOCAB, n)
        a, b = f.logits(ids), q.logits(ids)
        agree.append(a.argmax(-1) == b.argmax(-1))
        assert np.abs(a - b).max() < 0.1 * np.abs(a).max()
    assert np.concatenate(agree).mean() >= 0.9


def test_int8_cache_export_is_recorded_and_lossless(tiny_llama_dir, tmp_path):
    """An export with --kv-cache int8: the manifest says so (and the footprint counts one byte per value), and
    greedy speculative decoding through the engine gives plain decoding's tokens."""
    import edge
    from export.pipeline import export_model

    m = export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(precision="w8a8", kv_cache="int8"),
                     progress=False)
    assert m.target.kv_dtype == "int8" and all(g.kv_dtype == "int8" for g in m.drafters)
    assert m.source["options"]["kv_cache"] == "int8"
    c = m.arch
    assert m.kv_bytes_per_token(m.target) == 2 * c["layers"] * c["kv_heads"] * c["head_dim"]
    eng = edge.load(str(tmp_path / "m"))
    assert eng.target.cache.buf.dtype == np.int8
    prompt = "one two three one two three one two"
    plain = eng.generate(prompt, max_tokens=24, drafter="none", raw=True).token_ids
    for drafter in ("lookup", "recycling", "hybrid", "model"):
        r = eng.generate(prompt, max_tokens=24, drafter=drafter, raw=True)
        assert r.token_ids == plain, drafter
        assert r.drafted > 0, drafter  # speculation did run


@pytest.mark.parametrize("kv_cache", ["float32", "int8"])
def test_a_cache_that_grows_mid_answer_gives_the_same_tokens(monkeypatch, tiny_llama_dir, tmp_path, kv_cache):
    """The KV arrays grow while an answer is generated (here every 8 slots) and are rebound in every binding of
    the session: plain and speculative answers equal those of a cache allocated whole at load."""
    import edge
    import memory.footprint as fp
    from export.pipeline import export_model

    export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(precision="w8a8", kv_cache=kv_cache),
                 progress=False)
    prompt = "one two three four one two three four one two"
    want = {}
    for grow in (MAX_LEN, 8):
        monkeypatch.setattr(fp, "KV_GROW_SLOTS", grow)
        eng = edge.load(str(tmp_path / "m"))
        got = {d: eng.generate(prompt, max_tokens=40, drafter=d, raw=True).token_ids
               for d in ("none", "lookup", "hybrid", "model")}
        if grow == 8:
            assert 8 < eng.target.cache.slots < MAX_LEN
            assert got == want
        else:
            assert eng.target.cache.slots == MAX_LEN
            want = got
    assert all(v == want["none"] for v in want.values())


def test_a_prompt_sent_again_recomputes_its_wide_chunk_and_answers_the_same(tiny_llama_dir, tmp_path):
    """A prompt prefilled in one wide chunk (the dequantized path) and sent again: the cache holds it all but its
    last token, yet the engine recomputes the chunk from its first token, and the answer is the first one's, in
    every mode; a narrow follow-up turn re-uses the cache up to the new tokens."""
    import edge
    from export.pipeline import export_model
    from memory.footprint import WIDE_PREFILL_MIN

    export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(precision="int4", kv_cache="int8"),
                 progress=False)
    eng = edge.load(str(tmp_path / "m"))
    assert eng.target.dequantizes
    prompt = " ".join(["one two three four"] * 6)
    n = len(eng.encode(prompt, raw=True))
    assert n >= WIDE_PREFILL_MIN
    first = eng.generate(prompt, max_tokens=12, drafter="none", raw=True)
    assert eng.target.cache.in_chunk[1:n] == [True] * (n - 1)  # the prompt's chunk, then the answer's steps
    assert not any(eng.target.cache.in_chunk[n:])
    for drafter in ("none", "hybrid", "lookup"):
        again = eng.generate(prompt, max_tokens=12, drafter=drafter, raw=True)
        assert again.stats.reused_tokens == 0 and again.token_ids == first.token_ids, drafter
    more = eng.generate(prompt + first.text + " one", max_tokens=4, drafter="none", raw=True)
    assert more.stats.reused_tokens >= n
