"""Trimmed-vocabulary early-exit drafters: the id map, the drafter graph's logits, and `rank_vocabulary`; the id map and
the drafter's statistics recomputed from the exported target graph and the calibration text (also for a context
shorter than the chat prompts).

The drafter's logits must be exactly the reference early exit (first N layers + the self-distilled adapter, if the
export fitted one + final norm + LM head) restricted to the id map's rows; the id map must be a sorted set of valid
target ids that keeps EOS.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from conftest import BOS, EOS, MAX_LEN, TINY_EXPORT_DRAFTER, VOCAB, tiny_export_options
from edge.runner import GraphSession
from export import reference
from export.distill import read_adapter
from export.evaluate import GraphRunner, rank_vocabulary
from export.graph import GraphOptions, build_graph, save_model

TOL = 1e-4
LAYERS, K = TINY_EXPORT_DRAFTER


@pytest.fixture(scope="module")
def drafter(exported_llama):
    d, m = exported_llama
    (g,) = m.drafters
    return d, m, g, np.load(d / g.id_map)


def test_id_map_is_a_sorted_set_of_target_ids_with_eos(drafter):
    _, _, g, id_map = drafter
    assert id_map.dtype == np.int64 and id_map.shape == (K,)
    assert np.all(np.diff(id_map) > 0)  # sorted and unique
    assert id_map[0] >= 0 and id_map[-1] < VOCAB
    assert EOS in id_map and BOS in id_map
    assert g.vocab == K and g.layers == LAYERS and g.role == "drafter"


def test_drafter_graph_width_is_k(drafter):
    d, _, g, _ = drafter
    out = {o.name: o for o in onnx.load(str(d / g.file), load_external_data=False).graph.output}
    assert out["logits"].type.tensor_type.shape.dim[-1].dim_value == K


def test_drafter_logits_equal_reference_early_exit(drafter, tiny_llama):
    d, _, g, id_map = drafter
    c = tiny_llama.config
    r = GraphRunner(str(d / g.file), LAYERS, c.kv_heads, c.head_dim)
    rng = np.random.default_rng(0)
    for n in (1, 17, 50):
        ids = rng.integers(0, VOCAB, n)
        got = r.logits(ids)
        assert got.shape == (n, K)
        want = reference.forward(tiny_llama, ids, layers=LAYERS, adapter=read_adapter(d / g.file))[:, id_map]
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    # and it is an early exit, not the full model restricted to id_map
    full = reference.forward(tiny_llama, ids)[:, id_map]
    assert np.abs(got - full).max() > 0.1


def test_drafter_through_runtime_session(drafter, tiny_llama):
    """The manifest entry (layers, vocab, max_len) is enough for edge's session to drive the drafter."""
    d, m, g, id_map = drafter
    gs = GraphSession(str(d / g.file), m, g, capacity=MAX_LEN)
    ids = np.random.default_rng(1).integers(0, VOCAB, 30)
    want = reference.forward(tiny_llama, ids, layers=LAYERS, adapter=read_adapter(d / g.file))[:, id_map]
    gs.prefill(ids[:20], chunk=6)
    first = gs.forward(ids[20:25]).copy()
    gs.cache.append(5)
    got = np.concatenate([first, gs.forward(ids[25:26]).copy()])
    np.testing.assert_allclose(got, want[20:26], atol=TOL, rtol=0)


def test_manifest_reports_drafter_stats(drafter):
    _, _, g, _ = drafter
    s = g.stats
    assert 0.0 <= s["top1_agreement"] <= 1.0 and 0.0 < s["vocab_coverage"] <= 1.0
    assert s["held_out_positions"] > 0 and s["latency_ms_s1"] > 0


def test_trimmed_vocab_narrower_than_topk(tiny_llama, tmp_path):
    from export.graph import GraphOptions, build_graph, save_model

    keep = np.array([1, 2, 5, 7])
    save_model(build_graph(tiny_llama, GraphOptions(precision="fp32", max_len=64, layers=1), vocab_ids=keep),
               str(tmp_path / "model.onnx"))
    c = tiny_llama.config
    got = GraphRunner(str(tmp_path / "model.onnx"), 1, c.kv_heads, c.head_dim).logits([3, 4])
    np.testing.assert_allclose(got, reference.forward(tiny_llama, [3, 4], layers=1)[:, keep], atol=TOL, rtol=0)


# ----------------------------------------------------------------------------- rank_vocabulary

RANK_CASES = {
    # name: (token lists, vocab, always, expected order)
    "by count": ([[3, 3, 1], [1, 3, 0]], 5, (), [3, 1, 0, 2, 4]),
    "ties: lower id first": ([[4, 2], [2, 4]], 5, (), [2, 4, 0, 1, 3]),
    "always first, in order": ([[1, 1, 1, 4]], 5, (4, 0), [4, 0, 1, 2, 3]),
    "always out of range ignored": ([[2]], 4, (9, -1), [2, 0, 1, 3]),
    "nothing produced": ([], 4, (), [0, 1, 2, 3]),
    "empty lists": ([[], []], 3, (2,), [2, 0, 1]),
}


@pytest.mark.parametrize("name", list(RANK_CASES))
def test_rank_vocabulary(name):
    lists, vocab, always, want = RANK_CASES[name]
    got = rank_vocabulary(lists, vocab, always=always)
    assert got.tolist() == want


def test_rank_vocabulary_always_with_repeats_is_a_permutation():
    got = rank_vocabulary([[1, 1, 3]], 5, always=(2, 2))
    assert sorted(got.tolist()) == [0, 1, 2, 3, 4]
    assert got.tolist()[:3] == [2, 1, 3]


def test_rank_vocabulary_ranks_unproduced_ids_by_probability_mass():
    """Ids the target never produced follow the ones it did, most probable first; mass adds to the counts."""
    mass = np.array([0.0, 0.1, 0.5, 0.2, 0.0, 0.3])
    assert rank_vocabulary([[4, 4, 0]], 6, mass=mass).tolist() == [4, 0, 2, 5, 3, 1]
    assert rank_vocabulary([[1]], 3, mass=np.array([0.0, 0.0, 1.5])).tolist() == [2, 1, 0]


def test_rank_vocabulary_is_a_permutation_randomized():
    rng = np.random.default_rng(0)
    for _ in range(50):
        vocab = int(rng.integers(1, 40))
        lists = [list(rng.integers(0, vocab, int(rng.integers(0, 30)))) for _ in range(3)]
        always = tuple(int(x) for x in rng.choice(vocab, size=min(vocab, 2), replace=False))
        got = rank_vocabulary(lists, vocab, always=always)
        assert sorted(got.tolist()) == list(range(vocab))
        counts = np.bincount(np.concatenate([np.asarray(x, int) for x in lists] + [np.zeros(0, int)]),
                             minlength=vocab)
        rest = [t for t in got.tolist() if t not in always]
        assert all(counts[a] > counts[b] or (counts[a] == counts[b] and a < b) for a, b in zip(rest, rest[1:]))


# ----------------------------------------------------------------------------- recomputed from the exported graphs

def _recompute(d, m, ck, n_new: int) -> dict:
    """An export's calibration/held-out text and target predictions, recomputed from its exported target graph
    (fp32, deterministic) the way the manifest documents them: each chat prompt's last max_len - n_new tokens,
    the target's greedy continuation of n_new tokens, the ranking from the calibration prompts only (counts of
    what the target produced, plus the probability it gave each id over the prompt and its continuation)."""
    from edge.text import TextCodec
    from export import calibration
    from export.evaluate import rank_vocabulary

    c = ck.config
    t = m.target
    codec = TextCodec(d / m.tokenizer, m.chat_template, m.special_tokens["bos"], tuple(m.special_tokens["eos"]))
    room = t.max_len - n_new
    prompts = [codec.encode_chat([{"role": "user", "content": p}])[-room:] for p in calibration.PROMPTS]
    calib, held = prompts[: -calibration.HELD_OUT], prompts[-calibration.HELD_OUT:]
    r = GraphRunner(str(d / t.file), c.layers, c.kv_heads, c.head_dim)
    eos = tuple(m.special_tokens["eos"])
    calib_tokens, mass = [], np.zeros(c.vocab)
    for ids in calib:
        gen = r.greedy(ids, n_new, eos)
        calib_tokens.append(list(r.logits(ids).argmax(-1)) + gen)
        logits = r.logits(list(ids) + gen[:-1]).astype(np.float64)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        mass += (p / p.sum(-1, keepdims=True)).sum(0)
    always = tuple(eos) + (m.special_tokens["bos"],)
    ranked = rank_vocabulary(calib_tokens, c.vocab, always=always, mass=mass)
    texts, tgts, scored = [], [], []
    for ids in held:
        gen = r.greedy(ids, n_new, eos)
        text = list(ids) + gen
        s = np.zeros(len(text), bool)
        s[len(ids) - 1 : len(text) - 1] = True  # the positions whose next token the target generated
        texts.append(text)
        tgts.append(r.logits(text).argmax(-1))
        scored.append(s)
    return dict(ranked=ranked, texts=texts, tgts=tgts, scored=scored, room=room, prompts=prompts)


@pytest.fixture(scope="module")
def recomputed(exported_llama, tiny_llama):
    d, m = exported_llama
    return _recompute(d, m, tiny_llama, tiny_export_options().calib_new_tokens)


def test_drafter_id_map_is_the_targets_most_frequent_calibration_tokens(exported_llama, recomputed):
    """The trimmed vocabulary is the k ids the target produced most on the calibration prompts (not the held-out
    ones agreement is scored on), EOS/BOS always kept, sorted."""
    d, m = exported_llama
    (g,) = m.drafters
    want = np.sort(recomputed["ranked"][: g.vocab])
    np.testing.assert_array_equal(np.load(d / g.id_map), want)


def test_drafter_stats_are_what_its_graph_scores_on_the_held_out_text(exported_llama, tiny_llama, recomputed,
                                                                        tmp_path):
    """top1_agreement (the shipped graph, adapter included), top1_agreement_raw (the plain early exit),
    vocab_coverage and held_out_positions: recomputed over the positions the target generated."""
    d, m = exported_llama
    (g,) = m.drafters
    c = tiny_llama.config
    id_map = np.load(d / g.id_map)
    texts, tgts, scored = recomputed["texts"], recomputed["tgts"], recomputed["scored"]

    def agreement(path):
        dr = GraphRunner(str(path), g.layers, c.kv_heads, c.head_dim)
        hits = np.concatenate([(id_map[dr.logits(t).argmax(-1)] == tgt)[s] for t, tgt, s in zip(texts, tgts, scored)])
        return round(float(hits.mean()), 4)

    raw_path = tmp_path / "model.onnx"
    save_model(build_graph(tiny_llama, GraphOptions(precision="fp32", layers=g.layers, max_len=g.max_len), id_map),
               str(raw_path))
    s = g.stats
    covered = np.concatenate([np.isin(tgt[sc], id_map) for tgt, sc in zip(tgts, scored)])
    assert s["held_out_positions"] == int(covered.size)
    assert s["vocab_coverage"] == round(float(covered.mean()), 4)
    assert s["top1_agreement"] == agreement(d / g.file)
    assert s["top1_agreement_raw"] == agreement(raw_path)


def test_short_context_export_calibrates_on_each_prompts_end(tmp_path, tiny_llama_dir, tiny_llama):
    """--max-len below the chat prompts' length: each calibration prompt keeps its last max_len - new tokens (the
    generation prompt included, so the target writes a reply), and the id map is ranked from exactly that text."""
    from export.pipeline import export_model

    n_new = 8
    out = tmp_path / "short"
    m = export_model(tiny_llama_dir, out, tiny_export_options(max_len=40, drafters=((1, 64),), distill=False,
                                                              parity=False, calib_new_tokens=n_new), progress=False)
    rc = _recompute(out, m, tiny_llama, n_new)
    from export import calibration
    from edge.text import TextCodec
    codec = TextCodec(out / m.tokenizer, m.chat_template, m.special_tokens["bos"], tuple(m.special_tokens["eos"]))
    full = [codec.encode_chat([{"role": "user", "content": p}]) for p in calibration.PROMPTS]
    assert sum(len(f) > rc["room"] for f in full) >= len(full) // 2  # the case is exercised
    (g,) = m.drafters
    np.testing.assert_array_equal(np.load(out / g.id_map), np.sort(rc["ranked"][: g.vocab]))
