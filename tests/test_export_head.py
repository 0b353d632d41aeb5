"""The two-stage LM head (`export.graph._Builder.rescored_head`): where the exporter builds it, what it computes
against the single 8-bit head and the float model, that a row's logits do not depend on the call, and what the
footprint model counts for it."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from conftest import VOCAB, build_checkpoint, causal
from export import reference
from export.checkpoint import load_hf_dir
from export.graph import GraphOptions, build_graph, save_model
from memory.footprint import COARSE_HEAD_BITS, predict_weight_bytes

MAX_LEN = 64
GEMMA = dict(hidden=64, heads=4, kv_heads=1, intermediate=128, layers=2, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16)


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_untied_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("ck") / "tiny-gemma3"
    build_checkpoint(d, "gemma3", seed=5, **GEMMA)
    return {"llama": tiny_llama, "gemma3": load_hf_dir(d), "untied": load_hf_dir(tiny_untied_dir)}


def head_ops(model) -> dict[str, str]:
    """The head's main nodes by name (block-minimum 4-bit heads add their block sums under lm_head/...)."""
    return {n.name: n.op_type for n in model.graph.node if n.name in ("lm_head", "lm_head_coarse", "head_rows")}


def graph_file(ck, tmp_path, name: str, **kw):
    p = tmp_path / name / "model.onnx"
    p.parent.mkdir()
    save_model(build_graph(ck, GraphOptions(max_len=MAX_LEN, **kw)), str(p))
    return p


def logits(ck, path, shared_kv, ids, keep: int = 0) -> np.ndarray:
    c = ck.config
    s = shared_kv(path, c.layers, c.kv_heads, c.head_dim, MAX_LEN)
    return s.run(ids, np.arange(len(ids)), causal(len(ids), 0), keep=keep)


@pytest.mark.parametrize("precision", ["int4", "int8", "w8a8"])
def test_tied_quantized_heads_are_two_stage(models, precision):
    m = build_graph(models["llama"], GraphOptions(precision=precision, max_len=MAX_LEN))
    ops = head_ops(m)
    assert ops == {"lm_head_coarse": "MatMulNBits", "head_rows": "GatherBlockQuantized", "lm_head": "ScatterElements"}
    coarse = next(n for n in m.graph.node if n.name == "lm_head_coarse")
    assert {a.name: a.i for a in coarse.attribute}["bits"] == COARSE_HEAD_BITS
    rows = next(n for n in m.graph.node if n.name == "head_rows")
    embed = next(n for n in m.graph.node if n.name == "embed")
    # the candidates' rows are the input embedding's own table: no second 8-bit copy of the vocabulary
    assert rows.input[0] == embed.input[0] and list(rows.input[2:]) == list(embed.input[2:])
    assert not any(t.name.startswith("lm_head.") for t in m.graph.initializer)


@pytest.mark.parametrize("kind,kw", [("untied", {}), ("llama", {"head_rescore": 0}), ("llama", {"lm_head_bits": 4}),
                                     ("llama", {"head_rescore": VOCAB}), ("llama", {"precision": "fp32"})])
def test_single_head_where_rescoring_does_not_apply(models, kind, kw):
    """An untied head has no 8-bit rows to rescore from, a 4-bit or float head nothing to gain, and a candidate
    count of the whole vocabulary nothing to rank."""
    m = build_graph(models[kind], GraphOptions(**{"precision": "int8", "max_len": MAX_LEN, **kw}))
    assert head_ops(m) == {"lm_head": "MatMulNBits" if kw.get("precision") != "fp32" else "MatMul"}


def test_trimmed_drafter_head_is_single(models):
    m = build_graph(models["llama"], GraphOptions(precision="int8", max_len=MAX_LEN, layers=1),
                    vocab_ids=np.arange(128))
    assert head_ops(m) == {"lm_head": "MatMulNBits"}


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_rescored_logits_are_closer_to_the_float_model(models, shared_kv, tmp_path, kind):
    """At the float model's best tokens the two-stage head's logits are float dot products with the 8-bit rows,
    where the single 8-bit head also rounds the activations to int8: they must be closer to the reference (a wrong
    row, or Gemma's embedding scale left in, would be far off), and pick the same best tokens at least as often."""
    ck = models[kind]
    ids = np.random.default_rng(2).integers(0, VOCAB, 24)
    ref = reference.forward(ck, ids)
    two = logits(ck, graph_file(ck, tmp_path, "two", precision="int8"), shared_kv, ids)
    one = logits(ck, graph_file(ck, tmp_path, "one", precision="int8", head_rescore=0), shared_kv, ids)
    top = np.argsort(-ref, axis=1)[:, :8]

    def err(x):
        return float(np.abs(np.take_along_axis(x, top, 1) - np.take_along_axis(ref, top, 1)).mean())

    assert err(two) < err(one)
    agree = lambda x: int((x.argmax(1) == ref.argmax(1)).sum())  # noqa: E731
    assert agree(two) >= agree(one) - 1
    # the tail keeps the coarse head's values: no logit outside a row's candidates is rescored
    assert np.abs(two - one).max() > 0


def test_rescored_rows_do_not_depend_on_the_call(models, shared_kv, tmp_path):
    """A token's logits are the same in a decode step (after the prompt), inside a longer call, and with fewer rows
    kept. One row kept is a 1-row head call: equal too where the runtime's probe finds a lone row computed as wider
    calls compute it (elsewhere only a prompt's last row is kept alone, which plain and speculative decoding
    prefill alike)."""
    ck = models["gemma3"]
    p = graph_file(ck, tmp_path, "g", precision="int8", pad_query=True)
    ids = np.random.default_rng(4).integers(0, VOCAB, 20)
    whole = logits(ck, p, shared_kv, ids)
    c = ck.config
    s = shared_kv(p, c.layers, c.kv_heads, c.head_dim, MAX_LEN)
    min_call = s.min_call()  # 2 where this host's MatMulNBits computes a lone row another way: the runtime pads
    for keep in (1, 3, 7) if min_call == 1 else (2, 3, 7):
        np.testing.assert_array_equal(logits(ck, p, shared_kv, ids, keep=keep), whole[-keep:])
    s.run(ids[:15], np.arange(15), causal(15, 0), keep=1)
    for i in range(15, 20):  # one token a call, as plain decoding
        np.testing.assert_array_equal(s.step(ids[i], i, min_call)[0], whole[i])


def test_footprint_predicts_the_two_stage_head_to_the_byte(models):
    ck = models["llama"]
    c = ck.config
    opts = GraphOptions(precision="int8", max_len=MAX_LEN)
    m = build_graph(ck, opts)
    head = sum(numpy_helper.to_array(t).nbytes for t in m.graph.initializer if t.name.startswith("lm_head"))
    arch = {"layers": c.layers, "vocab": c.vocab, "hidden": c.hidden, "head_dim": c.head_dim,
            "intermediate": c.intermediate, "heads": c.heads, "kv_heads": c.kv_heads}
    w = predict_weight_bytes(arch, precision="int8", max_len=MAX_LEN, head_rescore=opts.head_rescore,
                             embedding_bits=opts.embedding_bits(c.hidden))
    assert w.head.total == head
    assert w.head.total < predict_weight_bytes(arch, precision="int8", max_len=MAX_LEN).head.total / 1.5


def test_parity_reads_the_reference_best_tokens():
    """The parity report keeps each position's best reference tokens (ties: lower id first, as argmax) and
    measures max |Δlogit| on them only; top-1 agreement is the same from the summary as from the whole logits."""
    from export.evaluate import PARITY_TOP, parity, reference_top

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((5, 300)).astype(np.float32)
    ref[0, [7, 3]] = 9.0  # a tie at the top: argmax says 3
    top = reference_top(ref)
    assert top.ids.shape == (5, PARITY_TOP) and top.ids[0, 0] == 3 and top.ids[0, 1] == 7
    assert (top.ids[:, 0] == ref.argmax(-1)).all() and (np.diff(top.logits, axis=1) <= 0).all()
    got = ref + rng.normal(0, 1e-3, ref.shape).astype(np.float32)
    got[0] = ref[0]  # the tie kept: argmax still says 3
    worst = np.argsort(ref[1])[0]  # the reference's least likely token: outside every best-k
    got[1, worst] = ref[1].max() - 0.1  # far off (~6), but in the tail: not counted, top-1 unchanged
    a, b = top.ids[2, :2]
    got[2, b] = ref[2, a] + 0.5  # the runner-up overtakes: one top-1 wrong, off by the gap + 0.5
    p = parity([top], [got])
    assert p == parity([ref], [got])
    assert p["positions"] == 5 and p["top1_agreement"] == 0.8
    assert p["max_abs_diff"] == pytest.approx(float(ref[2, a] - ref[2, b] + 0.5), abs=1e-5)
