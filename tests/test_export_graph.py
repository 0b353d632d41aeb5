"""The exported target graph: its I/O contract, tree-verify vs path parity, and prefill/decode through the runtime's
shared-buffer session, all fp32 against the numpy reference (itself checked against transformers).

Kinds: exact I/O tables; hand-drawn and random trees whose every node is compared with the reference decoding of
each root-to-leaf path separately; round trips through `edge.runner.GraphSession` (chunked prefill, stale slots,
rollback, tree commit) that must reproduce the one-shot reference.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from conftest import MAX_LEN, TINY_EXPORT_DRAFTER, VOCAB, causal
from edge.runner import GraphSession
from export import reference
from export.checkpoint import load_hf_dir
from export.graph import GraphOptions, build_graph, save_model
from kernels.postprocess import head_feeds, sampling_head_reference
from kernels.tree import TreeLayout

TOL = 1e-4


def io_table(model: onnx.ModelProto) -> tuple[dict, dict]:
    """{name: (elem_type, dims)} for inputs and outputs; dims are ints or symbolic names."""
    def dims(v):
        return tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)

    return ({v.name: (v.type.tensor_type.elem_type, dims(v)) for v in model.graph.input},
            {v.name: (v.type.tensor_type.elem_type, dims(v)) for v in model.graph.output})


def expected_io(layers: int, vocab: int, kv_type=TensorProto.FLOAT, topk: int = GraphOptions().topk):
    F, I = TensorProto.FLOAT, TensorProto.INT64
    ins = {"input_ids": (I, (1, "S")), "position_ids": (I, (1, "S")), "attention_bias": (F, (1, 1, "S", "T")),
           "logits_keep": (I, (1,))}
    outs = {"logits": (F, (1, "R", vocab))}
    if topk:  # the on-graph head (kernels/postprocess.py): k and the temperature per call
        ins.update({"top_k": (I, (1,)), "temperature": (F, (1,)), "sample": (TensorProto.BOOL, ())})
        outs.update({name: (t, (1, "R", "K")) for name, t in (("top_ids", I), ("top_logits", F), ("top_probs", F))})
    for i in range(layers):
        for kind in ("key", "value"):
            ins[f"past_key_values.{i}.{kind}"] = (kv_type, (1, 2, "max_len", 16))
            outs[f"present.{i}.{kind}"] = (kv_type, (1, 2, "max_len", 16))
    return ins, outs


def load_graph(path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


def check_header(model: onnx.ModelProto) -> None:
    assert 7 <= model.ir_version <= 13  # onnxruntime 1.31 rejects IR 14 (onnx 1.23's default)
    ops = {o.domain: o.version for o in model.opset_import}
    assert set(ops) == {"", "com.microsoft"}, ops
    assert 17 <= ops[""] <= 21 and ops["com.microsoft"] == 1
    used = {n.domain for n in model.graph.node}
    assert used <= {"", "com.microsoft"}, used


# ----------------------------------------------------------------------------- graph I/O

def test_target_graph_io(exported_llama):
    d, m = exported_llama
    model = load_graph(d / m.target.file)
    check_header(model)
    ins, outs = io_table(model)
    assert (ins, outs) == expected_io(3, VOCAB)
    assert len(model.graph.initializer) > 0
    ext = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert ext and all(e.key != "location" or e.value == "model.onnx.data" for t in ext for e in t.external_data)
    ops = {n.op_type for n in model.graph.node}
    assert {"GroupQueryAttention", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"} <= ops
    assert sum(n.op_type == "GroupQueryAttention" for n in model.graph.node) == 3
    assert "MatMulNBits" not in ops  # fp32 export


def test_drafter_graph_io(exported_llama):
    d, m = exported_llama
    (dr,) = m.drafters
    layers, k = TINY_EXPORT_DRAFTER
    model = load_graph(d / dr.file)
    check_header(model)
    assert io_table(model) == expected_io(layers, k)
    assert (dr.layers, dr.vocab) == (layers, k)


def test_ort_sees_the_same_io(exported_llama):
    import onnxruntime as ort

    d, m = exported_llama
    s = ort.InferenceSession(str(d / m.target.file), providers=["CPUExecutionProvider"])
    got = {i.name: (i.type, tuple(i.shape)) for i in s.get_inputs()}
    assert got["input_ids"] == ("tensor(int64)", (1, "S"))
    assert got["attention_bias"] == ("tensor(float)", (1, 1, "S", "T"))
    assert got["past_key_values.2.value"] == ("tensor(float)", (1, 2, "max_len", 16))
    assert {o.name: o.shape[-1] for o in s.get_outputs()}["logits"] == VOCAB


@pytest.mark.parametrize("precision,kv_type", [("fp16", TensorProto.FLOAT16), ("int4", TensorProto.FLOAT),
                                               ("int8", TensorProto.FLOAT), ("w8a8", TensorProto.FLOAT)])
def test_quantized_graph_io(tiny_llama, precision, kv_type):
    model = build_graph(tiny_llama, GraphOptions(precision=precision, max_len=64))
    check_header(model)
    assert io_table(model) == expected_io(3, VOCAB, kv_type)
    nbits = {n.name: {a.name: a.i for a in n.attribute}["bits"] for n in model.graph.node if n.op_type == "MatMulNBits"}
    if precision == "fp16":
        assert not nbits
        assert {t.data_type for t in model.graph.initializer if t.name.endswith(".weight")} == {TensorProto.FLOAT16}
        return
    # the tied 8-bit head is two-stage: a coarse 4-bit head, then its candidates' 8-bit embedding rows
    assert nbits.pop("lm_head_coarse") == 4
    assert [n.op_type for n in model.graph.node if n.name in ("head_rows", "lm_head")] == \
        ["GatherBlockQuantized", "ScatterElements"]
    if precision == "w8a8":  # qkv, o, gate_up, down per layer, all int8 x int8
        assert not nbits
        assert len([n for n in model.graph.node if n.op_type == "MatMulIntegerToFloat"]) == 4 * 3
    else:  # qkv, o, gate_up, down per layer
        assert len(nbits) == 4 * 3 and set(nbits.values()) == {int(precision[3:])}


def test_without_topk(tiny_llama):
    assert io_table(build_graph(tiny_llama, GraphOptions(precision="fp32", max_len=64, topk=0))) == \
        expected_io(3, VOCAB, topk=0)


def test_topk_outputs_match_logits(exported_llama, tiny_llama):
    """top_ids are the k largest logits in descending order (ties: lower id first), top_logits their values."""
    import onnxruntime as ort

    d, m = exported_llama
    s = ort.InferenceSession(str(d / m.target.file), providers=["CPUExecutionProvider"])
    c = tiny_llama.config
    ids = np.random.default_rng(4).integers(0, VOCAB, 19)
    feeds = {"input_ids": ids[None], "position_ids": np.arange(19)[None], "attention_bias": causal(19, 0),
             "logits_keep": np.array([0], np.int64), **head_feeds(8)}
    for i in range(c.layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, c.kv_heads, 0, c.head_dim), np.float32)
    logits, top_ids, top_logits = (a[0] for a in s.run(["logits", "top_ids", "top_logits"], feeds))
    k = top_ids.shape[-1]
    want = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(top_ids, want)
    np.testing.assert_array_equal(top_logits, np.take_along_axis(logits, want, -1))
    np.testing.assert_array_equal(top_ids[:, 0], reference.forward(tiny_llama, ids).argmax(-1))
    # a sampling call: k and the temperature fed, probabilities of the whole-vocabulary softmax at the top ids
    feeds.update(head_feeds(20, 0.6))
    logits, top_ids, top_probs = (a[0] for a in s.run(["logits", "top_ids", "top_probs"], feeds))
    _, want_ids, want_probs = sampling_head_reference(logits, 20, 0.6)
    np.testing.assert_array_equal(top_ids, want_ids)
    np.testing.assert_allclose(top_probs, want_probs, rtol=1e-5, atol=1e-7)


def test_layers_out_of_range(tiny_llama):
    with pytest.raises(ValueError, match="layers"):
        build_graph(tiny_llama, GraphOptions(precision="fp32", layers=4))
    with pytest.raises(ValueError, match="precision"):
        GraphOptions(precision="int3")


def test_zero_layers_is_refused(tiny_llama):
    # `--drafter-layers 0` would otherwise write a full-depth graph whose manifest entry says layers=0
    with pytest.raises(ValueError, match="layers"):
        build_graph(tiny_llama, GraphOptions(precision="fp32", layers=0))


# ----------------------------------------------------------------------------- graphs for the other families

@pytest.fixture(scope="module")
def fp32_graphs(exported_llama, tiny_qwen2_dir, tiny_untied_dir, tmp_path_factory):
    """{kind: (checkpoint, path of an fp32 target graph with MAX_LEN positions)}."""
    d, m = exported_llama
    out = {"llama": (load_hf_dir(m.source["path"]), d / m.target.file)}
    for kind, src in (("qwen2", tiny_qwen2_dir), ("untied", tiny_untied_dir)):
        ck = load_hf_dir(src)
        p = tmp_path_factory.mktemp(kind) / "model.onnx"
        save_model(build_graph(ck, GraphOptions(precision="fp32", max_len=MAX_LEN)), str(p))
        out[kind] = (ck, p)
    return out


def session(ck, path, shared_kv):
    c = ck.config
    return shared_kv(path, c.layers, c.kv_heads, c.head_dim, MAX_LEN)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "untied"])
def test_one_shot_and_logits_keep(fp32_graphs, shared_kv, kind):
    ck, path = fp32_graphs[kind]
    ids = np.random.default_rng(1).integers(0, VOCAB, 23)
    ref = reference.forward(ck, ids)
    s = session(ck, path, shared_kv)
    full = s.run(ids, np.arange(23), causal(23, 0))
    np.testing.assert_allclose(full, ref, atol=TOL, rtol=0)
    for keep in (1, 5, 23):
        got = s.run(ids, np.arange(23), causal(23, 0), keep=keep)
        assert got.shape == (keep, VOCAB)
        np.testing.assert_allclose(got, ref[-keep:], atol=TOL, rtol=0)


# ----------------------------------------------------------------------------- tree verify vs paths

HAND_DRAWN = {
    "root only": [-1],
    "chain": [-1, 0, 1, 2, 3],
    "star": [-1, 0, 0, 0, 0],
    "scratch": [-1, 0, 0, 1],
    "binary": [-1, 0, 0, 1, 1, 2, 2],
    "uneven": [-1, 0, 1, 1, 0, 4, 2, 5, 7, 3],
}


def random_parents(rng, n: int) -> list[int]:
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def check_tree(ck, s, prefix, parents, tokens) -> float:
    """Commit `prefix`, verify the tree in one call, compare every node with its path's reference; max |Δ|."""
    p = len(prefix)
    s.run(prefix, np.arange(p), causal(p, 0), keep=1)
    lay = TreeLayout.from_parents(parents)
    got = s.run(tokens, lay.position_ids(p), lay.attention_bias(p))  # [S, V]
    assert got.shape == (len(parents), VOCAB)
    children = {i for i in parents if i >= 0}
    worst, seen = 0.0, set()
    for leaf in (i for i in range(len(parents)) if i not in children):
        path = lay.path_to(leaf)
        ref = reference.forward(ck, np.concatenate([prefix, np.asarray(tokens)[path]]))[p:]
        np.testing.assert_allclose(got[path], ref, atol=TOL, rtol=0, err_msg=f"leaf {leaf} path {path}")
        worst = max(worst, float(np.abs(got[path] - ref).max()))
        seen.update(path)
    assert seen == set(range(len(parents)))
    return worst


@pytest.mark.parametrize("name", list(HAND_DRAWN))
def test_tree_matches_paths_hand_drawn(fp32_graphs, shared_kv, name):
    ck, path = fp32_graphs["llama"]
    rng = np.random.default_rng(len(name))
    parents = HAND_DRAWN[name]
    prefix = rng.integers(0, VOCAB, 11)
    tokens = rng.integers(0, VOCAB, len(parents))
    if name == "star":
        tokens[1:3] = tokens[3]  # identical siblings must give identical rows
    check_tree(ck, session(ck, path, shared_kv), prefix, parents, tokens)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "untied"])
def test_tree_matches_paths_random(fp32_graphs, shared_kv, kind):
    """Random trees, one session: each tree overwrites the previous tree's uncommitted slots."""
    ck, path = fp32_graphs[kind]
    rng = np.random.default_rng({"llama": 10, "qwen2": 11, "untied": 12}[kind])
    s = session(ck, path, shared_kv)
    for _ in range(6):
        n = int(rng.integers(2, 25))
        prefix = rng.integers(0, VOCAB, int(rng.integers(1, 40)))
        check_tree(ck, s, prefix, random_parents(rng, n), rng.integers(0, VOCAB, n))


def test_tree_mask_is_not_causal(fp32_graphs, shared_kv):
    """Guard the test itself: with a plain causal mask instead of the tree's, sibling rows must differ from their
    paths (otherwise the parity above proves nothing)."""
    ck, path = fp32_graphs["llama"]
    rng = np.random.default_rng(3)
    prefix, tokens, parents = rng.integers(0, VOCAB, 9), rng.integers(0, VOCAB, 3), [-1, 0, 0]
    s = session(ck, path, shared_kv)
    s.run(prefix, np.arange(9), causal(9, 0), keep=1)
    lay = TreeLayout.from_parents(parents)
    got = s.run(tokens, lay.position_ids(9), causal(3, 9))
    ref = reference.forward(ck, np.concatenate([prefix, tokens[[0, 2]]]))
    assert np.abs(got[2] - ref[-1]).max() > 1e-2


# ----------------------------------------------------------------------------- the runtime session (edge.runner)

@pytest.fixture
def graph_session(exported_llama):
    d, m = exported_llama
    return GraphSession(str(d / m.target.file), m, m.target, capacity=MAX_LEN)


@pytest.fixture(scope="module")
def sequence(tiny_llama):
    ids = np.random.default_rng(7).integers(0, VOCAB, 90)
    return ids, reference.forward(tiny_llama, ids)


def feed(gs: GraphSession, ids, chunks) -> np.ndarray:
    out, at = [], 0
    for n in chunks:
        out.append(gs.forward(ids[at : at + n]).copy())
        gs.cache.append(n)
        at += n
    assert at == len(ids) == gs.cache.length
    return np.concatenate(out)


@pytest.mark.parametrize("chunks", [[90], [1] * 90, [13, 1, 1, 9, 20, 1, 25, 7, 13], [40, 50]])
def test_chunked_prefill_and_decode(graph_session, sequence, chunks):
    ids, ref = sequence
    np.testing.assert_allclose(feed(graph_session, ids, chunks), ref, atol=TOL, rtol=0)


def test_prefill_helper(graph_session, sequence):
    ids, ref = sequence
    last = graph_session.prefill(ids[:61], chunk=16)
    assert graph_session.cache.length == 61
    np.testing.assert_allclose(last, ref[60], atol=TOL, rtol=0)
    np.testing.assert_allclose(graph_session.forward(ids[61:64]), ref[61:64], atol=TOL, rtol=0)


@pytest.mark.parametrize("garbage", ["noise", "nan"])
def test_stale_slots_beyond_length_are_ignored(graph_session, sequence, garbage):
    ids, ref = sequence
    gs = graph_session
    feed(gs, ids[:30], [30])
    rng = np.random.default_rng(0)
    stale = gs.cache.buf[:, :, :, :, gs.cache.length :]
    stale[...] = np.nan if garbage == "nan" else 100 * rng.standard_normal(stale.shape)
    got = gs.forward(ids[30:45]).copy()
    gs.cache.append(15)
    np.testing.assert_allclose(got, ref[30:45], atol=TOL, rtol=0)
    stale = gs.cache.buf[:, :, :, :, gs.cache.length :]
    stale[...] = np.nan if garbage == "nan" else -100 * rng.standard_normal(stale.shape)
    np.testing.assert_allclose(feed_tail(gs, ids, 45), ref[45:], atol=TOL, rtol=0)


def feed_tail(gs, ids, start):
    out = []
    for t in range(start, len(ids)):
        out.append(gs.forward(ids[t : t + 1]).copy())
        gs.cache.append(1)
    return np.concatenate(out)


def test_rollback_then_regenerate(graph_session, sequence, tiny_llama):
    """append → trim → continue differently gives the logits of the new sequence (stale K/V left in place)."""
    ids, ref = sequence
    gs = graph_session
    feed(gs, ids[:40], [25, 15])
    wrong = (ids[40:52] + 1) % VOCAB
    gs.forward(wrong)
    gs.cache.append(12)
    gs.cache.trim(12)
    gs.forward(wrong[:5])  # uncommitted draft, never appended
    np.testing.assert_allclose(gs.forward(ids[40:52]), ref[40:52], atol=TOL, rtol=0)


def test_tree_verify_then_commit_path(graph_session, tiny_llama):
    """Verify a tree through GraphSession, keep one root-to-leaf path (KVCache.keep), keep decoding: equals the
    reference of prefix + path + continuation."""
    gs = graph_session
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, VOCAB, 20)
    gs.prefill(prefix, chunk=8)
    parents = [-1, 0, 0, 1, 2, 2, 4, 6]
    tokens = rng.integers(0, VOCAB, len(parents))
    lay = TreeLayout.from_parents(parents)
    gs.forward(tokens, lay.position_ids(20), lay.attention_bias(20))
    path = lay.path_to(7)  # [0, 2, 4, 6, 7]: non-contiguous slots, so keep() must move K/V
    gs.cache.keep(path)
    assert gs.cache.length == 20 + len(path)
    tail = rng.integers(0, VOCAB, 3)
    got = gs.forward(tail).copy()
    full = np.concatenate([prefix, tokens[path], tail])
    np.testing.assert_allclose(got, reference.forward(tiny_llama, full)[-3:], atol=TOL, rtol=0)


def test_capacity_above_export_is_refused(exported_llama):
    from edge.errors import EngineError

    d, m = exported_llama
    with pytest.raises(EngineError, match="exported for"):
        GraphSession(str(d / m.target.file), m, m.target, capacity=MAX_LEN + 1)


# ----------------------------------------------------------------------------- call-length independence

def padded_and_unpadded(ck, tmp_path_factory, precision: str) -> dict[bool, object]:
    """{pad_query: graph path} for one precision."""
    out = {}
    for pad in (True, False):
        p = tmp_path_factory.mktemp(f"{precision}-pad{int(pad)}") / "model.onnx"
        save_model(build_graph(ck, GraphOptions(precision=precision, max_len=MAX_LEN, pad_query=pad)), str(p))
        out[pad] = p
    return out


@pytest.fixture(scope="module")
def int4_graphs(tiny_llama, tmp_path_factory):
    """int4 graphs with int8 activations, with and without the pad query row. Their 4-bit layers keep the blocks'
    float minimums, so the block-sum MatMul is part of what must not depend on the call's width."""
    return padded_and_unpadded(tiny_llama, tmp_path_factory, "int4")


def alone_and_in_calls(ck, path, shared_kv, prompt, token, widths=(2, 3, 5), min_call: int = 1):
    """Logits of `token` after `prompt` in a 1-token call (padded to `min_call` rows as the runtime pads a decode
    step), and as the first row of calls of other widths."""
    s = session(ck, path, shared_kv)
    n = len(prompt)
    s.run(prompt, np.arange(n), causal(n, 0), keep=1)
    alone = s.step(token, n, min_call)
    inside = [s.run([token] + [5] * (w - 1), np.arange(n, n + w), causal(w, n))[:1].copy() for w in widths]
    return alone, inside


def decode_steps_and_in_calls(ck, path, shared_kv, prompt, token, widths=(2, 3, 5)):
    """`alone_and_in_calls` as the runtime decodes on this host: the 1-token call padded where the runtime's probe
    says so. Where the probe finds no padding needed, the lone row is checked as it is."""
    min_call = session(ck, path, shared_kv).min_call()
    return alone_and_in_calls(ck, path, shared_kv, prompt, token, widths, min_call)


@pytest.fixture(scope="module")
def w8a8_graphs(tiny_llama, tmp_path_factory):
    """w8a8 graphs (int8 activations per row, integer sums: width-independent on every host) with and without the
    pad query row."""
    return padded_and_unpadded(tiny_llama, tmp_path_factory, "w8a8")


def test_padded_graph_logits_do_not_depend_on_call_length(tiny_llama, w8a8_graphs, shared_kv):
    """With int8 activations and the pad query row, a decode step is bit-identical to the same token inside any
    wider call, so plain decoding stays exactly what verification computes. The step is a 1-token call, or 2 rows
    where the runtime's probe finds a lone row computed another way on this host (the two-stage head's
    MatMulNBits on AVX2 without VNNI)."""
    prompt = np.random.default_rng(3).integers(0, VOCAB, 37)
    for token in (11, 200, 301):
        alone, inside = decode_steps_and_in_calls(tiny_llama, w8a8_graphs[True], shared_kv, prompt, token)
        for got in inside:
            assert np.array_equal(alone, got)


def test_unpadded_graph_probe_agrees_with_what_it_computes(tiny_llama, w8a8_graphs, shared_kv, exported_llama):
    """Without the pad row, a 1-token call takes GroupQueryAttention's single-query path. Whether that path sums
    as the multi-query one does is a property of the host (on some x86 hosts it differs by ~2e-7, which int8
    activations move across rounding steps; on others it is bit-identical). The runtime's load-time probe must
    report exactly what the graph computes here: min_call 1 where a lone row equals the same row in wider calls,
    else 2 (the runtime pads)."""
    from dataclasses import replace

    prompt = np.random.default_rng(3).integers(0, VOCAB, 37)
    same = []
    for token in (11, 200, 301):
        alone, inside = alone_and_in_calls(tiny_llama, w8a8_graphs[False], shared_kv, prompt, token)
        same.append(all(np.array_equal(alone, got) for got in inside))
        for got in inside[1:]:  # multi-row calls agree with each other on every host
            assert np.array_equal(inside[0], got)
    d, m = exported_llama
    entry = replace(m.target, precision="w8a8", w8a8_kernel=GraphOptions(precision="w8a8").w8a8_kernel)
    gs = GraphSession(str(w8a8_graphs[False]), m, entry, capacity=MAX_LEN)
    if all(same):
        assert gs.min_call == 1
    elif not any(same):
        assert gs.min_call == 2
    print("unpadded w8a8 1-row call equals the multi-row ones:", same, "min_call", gs.min_call)


def test_int4_one_row_calls_are_padded_where_matmulnbits_takes_another_path(tiny_llama, int4_graphs, shared_kv,
                                                                          exported_llama):
    """MatMulNBits' int8-activation kernels: calls of 2 or more rows always agree row for row; a 1-row call agrees
    too on hosts with VNNI, but not on x86 AVX2 hosts (measured on an AMD EPYC Zen 3: MLAS computes a single row
    another way, ~1e-6 here). The runtime's load-time probe must see exactly that and pad 1-token calls to 2 rows
    there (min_call 2), so plain and speculative decoding still compute the same numbers."""
    from dataclasses import replace

    prompt = np.random.default_rng(3).integers(0, VOCAB, 37)
    alone, inside = alone_and_in_calls(tiny_llama, int4_graphs[True], shared_kv, prompt, 11, widths=(2, 3, 5, 8))
    for got in inside[1:]:
        assert np.array_equal(inside[0], got)
    d, m = exported_llama  # the tiny export's manifest, describing this graph of the same checkpoint instead
    entry = replace(m.target, precision="int4", accuracy_level=4, block_size=32)
    gs = GraphSession(str(int4_graphs[True]), m, entry, capacity=MAX_LEN)
    assert gs.min_call == (1 if np.array_equal(alone, inside[0]) else 2)
    print("int4 1-row call equals the multi-row ones:", np.array_equal(alone, inside[0]), "min_call", gs.min_call)


@pytest.mark.parametrize("precision,kernel,exact,warned", [
    ("w8a8", "u8s8", False, True), ("w8a8", "u8s8", True, False), ("w8a8", "u8u8", False, False),
    ("int4", "u8s8", False, False)])
def test_int8_weights_warn_at_load_on_a_host_whose_int8_gemm_saturates(monkeypatch, exported_llama, precision,
                                                                       kernel, exact, warned):
    """An export with int8 w8a8 weights (from a VNNI machine, or an older edgespec) still runs where the u8s8 GEMM
    saturates, deterministically, but its logits are off: loading it says so and names the re-export."""
    import warnings
    from dataclasses import replace

    import devices
    from edge.runner import warn_int8_gemm

    monkeypatch.setattr(devices, "int8_gemm_exact", lambda: exact)
    entry = replace(exported_llama[1].target, precision=precision, w8a8_kernel=kernel)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert warn_int8_gemm("m/model.onnx", entry) == warned
    assert [("edge-export --default --force" in str(w.message), w.category) for w in seen] == (
        [(True, RuntimeWarning)] if warned else [])


def test_graph_session_warns_for_int8_weights_on_a_saturating_host(monkeypatch, tiny_llama, exported_llama, tmp_path):
    from dataclasses import replace

    import devices

    p = tmp_path / "model.onnx"
    save_model(build_graph(tiny_llama, GraphOptions(precision="w8a8", max_len=MAX_LEN, w8a8_kernel="u8s8")), str(p))
    monkeypatch.setattr(devices, "int8_gemm_exact", lambda: False)
    d, m = exported_llama
    with pytest.warns(RuntimeWarning, match="saturating 16-bit pairs"):
        GraphSession(str(p), m, replace(m.target, precision="w8a8", w8a8_kernel="u8s8"), capacity=MAX_LEN)


def test_w8a8_graph_logits_do_not_depend_on_call_length(tiny_llama, tmp_path, shared_kv):
    """w8a8 (per-row int8 activations, integer accumulation) with the pad query row: a token's logits are
    bit-identical in a decode step (padded where the runtime's probe says so) and inside calls of 2 to 16 rows."""
    p = tmp_path / "model.onnx"
    save_model(build_graph(tiny_llama, GraphOptions(precision="w8a8", max_len=MAX_LEN)), str(p))
    prompt = np.random.default_rng(5).integers(0, VOCAB, 41)
    for token in (7, 123):
        alone, inside = decode_steps_and_in_calls(tiny_llama, p, shared_kv, prompt, token, widths=(2, 3, 5, 8, 16))
        for got in inside:
            assert np.array_equal(alone, got)


def test_pad_query_row_changes_nothing_else(tiny_llama, int4_graphs, shared_kv):
    """Multi-token calls of the padded and the unpadded graph agree exactly: the pad row is invisible."""
    ids = np.random.default_rng(4).integers(0, VOCAB, 29)
    got = {pad: session(tiny_llama, p, shared_kv).run(ids, np.arange(29), causal(29, 0)) for pad, p in int4_graphs.items()}
    np.testing.assert_array_equal(got[True], got[False])


def test_runtime_probe_agrees_with_a_direct_check_on_the_export(exported_llama, shared_kv, tiny_llama):
    """The engine's min_call on the session export is what a lone row computes here, checked without edge/."""
    d, m = exported_llama
    gs = GraphSession(str(d / m.target.file), m, m.target, capacity=MAX_LEN)
    s = session(tiny_llama, d / m.target.file, shared_kv)
    s.run([1, 2], np.arange(2), causal(2, 0), keep=1)
    lone_equals_wide = np.array_equal(s.run([3], [2], causal(1, 2)), s.run([3, 0], [2, 3], causal(2, 2))[:1])
    assert gs.min_call == (1 if lone_equals_wide else 2)


def test_call_that_fills_the_cache_exactly(graph_session, tiny_llama):
    """The pad row's K/V goes to the scratch slot after the last real one: a cache filled to capacity still works
    and gives the reference logits (a pad written over the last real slot would not)."""
    ids = np.random.default_rng(5).integers(0, VOCAB, MAX_LEN)
    graph_session.cache.trim(graph_session.cache.length)
    graph_session.prefill(ids[:-3])
    out = graph_session.forward(ids[-3:]).copy()
    graph_session.cache.append(3)
    assert graph_session.cache.length == MAX_LEN
    np.testing.assert_allclose(out, reference.forward(tiny_llama, ids)[-3:], atol=TOL, rtol=0)
    graph_session.cache.trim(1)  # the last token again, alone: a 1-row call padded into the scratch slot
    np.testing.assert_allclose(graph_session.forward(ids[-1:]), out[-1:], atol=TOL, rtol=0)
