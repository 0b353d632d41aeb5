"""Exporter behaviour pinned down by a mutation audit (session 23): each test fails under a plausible one-line bug
that every other export test let through.

Each test checks numbers the exporter produces against an independent recomputation: graph logits against the numpy
reference on de-quantized weights for shapes whose K does not split into whole blocks, SmoothQuant's balance property
on independently measured activation maxima, the manifest's drafter/target statistics and id map against a
recomputation from the exported graphs and calibration text, and the tokenizer's special ids from a checkpoint's
config files.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import MAX_LEN, TINY_EXPORT_DRAFTER, VOCAB, build_checkpoint, tiny_export_options
from export import reference, smooth
from export.checkpoint import Checkpoint, load_hf_dir
from export.evaluate import GraphRunner
from export.graph import GraphOptions, build_graph, save_model
from export.quant import (dequantize_block_min, quantize_asymmetric, quantize_block_min, unpack4)


# ----------------------------------------------------------------------------- helpers

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


def runner(path, ck) -> GraphRunner:
    c = ck.config
    return GraphRunner(str(path), c.layers, c.kv_heads, c.head_dim)


# ----------------------------------------------------------------------------- quant.py

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


# ----------------------------------------------------------------------------- graph.py: K not in whole blocks

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
    opts = GraphOptions(precision=precision, max_len=64, accuracy_level=0)
    model = build_graph(ck, opts)
    has_sums = any(n.name.endswith("/block_sums") for n in model.graph.node)
    assert opts.uses_block_min(c.hidden, c.heads * c.head_dim, c.intermediate) == has_sums
    p = tmp_path / "model.onnx"
    save_model(model, str(p))
    r = runner(p, ck)
    qck = _dequantized(ck, opts.bits, opts)
    for ids in (np.arange(5, 40), np.random.default_rng(1).integers(0, VOCAB, 23)):
        np.testing.assert_allclose(r.logits(ids), reference.forward(qck, ids), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- smooth.py

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


# ----------------------------------------------------------------------------- pipeline.py: stats and id map

def _recompute(d, m, ck, n_new: int) -> dict:
    """An export's calibration/held-out text and target predictions, recomputed from its exported target graph
    (fp32, deterministic) the way the manifest documents them: each chat prompt's last max_len - n_new tokens,
    the target's greedy continuation of n_new tokens, the ranking from the calibration prompts only."""
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
    calib_tokens = [list(r.logits(ids).argmax(-1)) + r.greedy(ids, n_new, eos) for ids in calib]
    always = tuple(eos) + (m.special_tokens["bos"],)
    ranked = rank_vocabulary(calib_tokens, c.vocab, always=always)
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


def test_latency_stats_are_consistent(exported_llama):
    """The target's latency_ms_s1 is its one-row entry of latency_ms_by_s, and a drafter's latency_vs_target is
    its one-row latency over the target's one-row latency."""
    _, m = exported_llama
    t = m.target.stats
    assert t["latency_ms_s1"] == t["latency_ms_by_s"][0]
    h = 0.0005 + 1e-9  # every recorded latency and ratio is rounded to 3 decimals
    for g in m.drafters:
        d, tt = g.stats["latency_ms_s1"], t["latency_ms_s1"]
        lo, hi = (d - h) / (tt + h) - h, (d + h) / (tt - h) + h
        assert lo <= g.stats["latency_vs_target"] <= hi, (g.stats, t)


def test_smoothing_stat_counts_the_calibration_prompts(tmp_path, tiny_llama_dir):
    """The maxima come from the calibration prompts (all but the held-out ones): that is the count recorded."""
    from export import calibration
    from export.pipeline import export_model

    m = export_model(tiny_llama_dir, tmp_path / "out",
                     tiny_export_options(precision="w8a8", drafters=(), parity=False), progress=False)
    assert m.target.stats["smoothing"]["prompts"] == len(calibration.PROMPTS) - calibration.HELD_OUT


# ----------------------------------------------------------------------------- tokenizer.py

def test_generation_config_eos_ids_win_over_config(tmp_path, tiny_llama_dir):
    """Like transformers' generate(): generation_config.json's eos_token_id (here a list, as Llama 3 ships it)
    replaces config.json's; a chat template given as named templates takes the 'default' one."""
    from export.tokenizer import write_tokenizer

    src = tmp_path / "src"
    shutil.copytree(tiny_llama_dir, src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    ck = load_hf_dir(src)
    out = tmp_path / "out"
    out.mkdir()
    tf = write_tokenizer(ck, out)
    assert tf.eos == (2, 0) and tf.chat_template == "DEFAULT"
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


# ----------------------------------------------------------------------------- distill.py

def test_cross_validation_scores_each_fold_on_text_its_fit_never_saw():
    """Two calibration sequences, each with its own unrelated final-stream map: nothing generalizes from one to the
    other, so the cross-validated agreement must stay near chance (a fit that also saw its validation sequence
    scores ~0.3 here)."""
    from export import distill

    rng = np.random.default_rng(7)
    h, vocab, eps, n, s = 24, 60, 1e-6, 2, 400
    head, norm_w = rng.standard_normal((vocab, h)), np.ones(h)
    xs = [rng.standard_normal((s, h)) for _ in range(n)]
    ys = [x @ (3 * np.linalg.qr(rng.standard_normal((h, h)))[0]) for x in xs]
    teacher = [distill.top1(y, head, norm_w, eps) for y in ys]
    fit = distill.fit_adapter(xs, ys, teacher, [np.ones(s, bool)] * n, head, norm_w, eps)
    assert fit.val_agreement_raw < 0.1 and fit.val_agreement < 0.1, fit.stats()


# ----------------------------------------------------------------------------- pipeline.py: checkpoint drafters

def test_trimmed_checkpoint_drafter_keeps_only_ids_it_can_embed(tmp_path):
    """Target with 400 logits (16 padding rows past the 384-token tokenizer), a drafter checkpoint with 384 rows and
    a trimmed vocabulary larger than that: the id map holds only ids below 384 (every one of them), so the
    drafter's head is its own whole head and the export does not index past it."""
    from export.pipeline import export_model

    target, draft = tmp_path / "wide-target", tmp_path / "draft"
    build_checkpoint(target, "llama", tie=True, layers=1, seed=0, vocab=VOCAB + 16)
    build_checkpoint(draft, "llama", tie=True, layers=1, seed=11, hidden=64, heads=4, kv_heads=2, intermediate=64)
    out = tmp_path / "m"
    m = export_model(target, out, tiny_export_options(drafters=(), parity=False,
                                                      drafter_checkpoints=((str(draft), VOCAB + 8),)), progress=False)
    (g,) = m.drafters
    id_map = np.load(out / g.id_map)
    np.testing.assert_array_equal(id_map, np.arange(VOCAB))
    assert g.vocab == VOCAB


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



@pytest.mark.parametrize("max_len,long_past", [(300, 292), (40, None)])
def test_target_latency_is_timed_at_a_long_context_when_the_graph_has_room(tmp_path, tiny_llama_dir, monkeypatch,
                                                                          max_len, long_past):
    """The export times the target the engine's way at S = 1..8 over 128 cached tokens (fewer when --max-len leaves
    no room) and over up to 1,024 when the graph holds at least twice that first context; the manifest records
    both, and the planner prices contexts between them from it without a calibration. Each drafter graph is timed
    the same way over the first context, and the planner prices it from that rather than its numpy-fed figure."""
    import edge.measure
    from export.pipeline import VERIFY_SIZES, export_model
    from memory.planner import Latency

    timed = []
    real = edge.measure.call_latency

    def spy(session, sizes, context, reps, prog=None):
        timed.append((list(sizes), context, session.cache.capacity, session.vocab))
        return real(session, sizes, context, 1, prog)

    monkeypatch.setattr(edge.measure, "call_latency", spy)
    m = export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(max_len=max_len, distill=False,
                                                                         parity=False), progress=False)
    t, (d,) = m.target.stats, m.drafters
    past, sizes = min(128, max_len - VERIFY_SIZES), list(range(1, VERIFY_SIZES + 1))
    lat = Latency.from_calibration(m)
    if long_past:
        cap = long_past + VERIFY_SIZES
        assert timed == [(sizes, past, cap, VOCAB), (sizes, long_past, cap, VOCAB),
                         (sizes, past, past + VERIFY_SIZES, d.vocab)]
        assert [c for c, _ in t["latency_ms_by_s_at"]] == [past, long_past]
        assert all(len(by_s) == VERIFY_SIZES and all(x > 0 for x in by_s) for _, by_s in t["latency_ms_by_s_at"])
        assert lat.context == past and [c for c, _ in lat.target_at] == [long_past]
        assert lat.target(1) == t["latency_ms_by_s_at"][0][1][0]
        (c, by_s), = d.stats["latency_ms_by_s_at"]
        assert c == past and len(by_s) == VERIFY_SIZES and all(x > 0 for x in by_s)
        assert [lat.drafters[d.name](s) for s in sizes] == pytest.approx(by_s, rel=1e-12)
        assert m.parity["min_call"] == 1  # the target session's probe (fp32 graph with its pad row)
    else:
        assert timed == [] and "latency_ms_by_s_at" not in t and lat.target_at == ()
        assert "latency_ms_by_s_at" not in d.stats and lat.drafters[d.name](1) == d.stats["latency_ms_s1"]
        assert "min_call" not in m.parity
