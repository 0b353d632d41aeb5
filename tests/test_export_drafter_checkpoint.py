"""A separate small checkpoint as the `model` drafter (`edge-export TARGET -o OUT --drafter-checkpoint SMALL`):
exported whole with its own shape (other hidden size, heads, KV heads and head dim than the target), its LM head
trimmed to the target's most frequent tokens; refused when its tokenizer differs; lossless at runtime, greedy and
sampling; its KV cache and weights counted by its own shape."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

import edge
from conftest import VOCAB, build_checkpoint, tiny_export_options
from edge.manifest import FORMAT_VERSION, load_manifest
from export.checkpoint import load_hf_dir
from export import pipeline
from export.pipeline import export_model
from helpers import check_against, exact_first_tokens, speculative_first_tokens

DRAFT_SHAPE = dict(layers=1, hidden=96, heads=3, kv_heads=3, intermediate=96)  # target: 3 layers, 64, 4, 2, 128
PROMPTS = ["the quick brown fox", "def add(a, b):", "Summarize: the council met"]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck") / "tiny-draft"
    build_checkpoint(d, "llama", tie=True, seed=11, **DRAFT_SHAPE)
    return d


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_llama_dir, draft_dir):
    out = tmp_path_factory.mktemp("export") / "with-draft"
    # the full vocabulary twice (0 and its size: one graph), a trimmed head, and another checkpoint of the same
    # directory name (its graph gets its own name); an early-exit drafter beside them
    twin = tmp_path_factory.mktemp("ck2") / draft_dir.name
    build_checkpoint(twin, "llama", tie=True, seed=12, **DRAFT_SHAPE)
    opts = tiny_export_options(drafter_checkpoints=((str(draft_dir), 0), (str(draft_dir), 96),
                                                    (str(draft_dir), VOCAB), (str(twin), 96)))
    bars = []

    class Steps(pipeline._Steps):
        def __init__(self, *a):
            super().__init__(*a)
            bars.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_Steps", Steps)
        m = export_model(tiny_llama_dir, out, opts, progress=False)
    # the progress bar ends full: the graph the duplicate would have been is not counted
    assert [(b.finished, b.total) for b in bars] == [(bars[0].total, bars[0].total)]
    return out, m


def test_manifest_records_the_drafters_own_shape(exported, draft_dir):
    out, m = exported
    again = load_manifest(out, verify="sha256")
    assert again == m and m.format_version == FORMAT_VERSION == 2  # an older edgespec is told to upgrade
    early, full, trimmed, twin = m.drafters
    assert early.arch is None and m.arch_of(early) == m.arch
    assert [g.name for g in (full, trimmed, twin)] == ["draft-tiny-draft-v384", "draft-tiny-draft-v96",
                                                       "draft-tiny-draft-v96-2"]
    dc = load_hf_dir(draft_dir).config
    for g in (full, trimmed):
        assert g.arch == dc.to_dict() and g.layers == 1 and m.arch_of(g)["kv_heads"] == 3
        assert m.arch_of(g)["head_dim"] == 32 != m.arch["head_dim"]
        assert g.stats["checkpoint"]["path"] == str(draft_dir.resolve())
    assert full.vocab == m.arch["vocab"] and trimmed.vocab == 96
    ids = np.load(out / trimmed.id_map)
    assert len(ids) == 96 and np.all(np.diff(ids) > 0) and ids.max() < m.arch["vocab"]
    assert m.arch_of(m.target) == m.arch and m.target.arch is None
    # the drafter's KV bytes per token follow its own shape: 2 · 1 layer · 3 KV heads · 32 · 4 bytes
    assert m.kv_bytes_per_token(full) == 2 * 1 * 3 * 32 * 4


@pytest.mark.parametrize("draft_len", [1, 3, 6])
def test_greedy_with_the_checkpoint_drafter_equals_plain(exported, draft_len):
    e = edge.load(exported[0], drafter="none", context=256)
    drafted = 0
    for p in PROMPTS:
        ref = e.generate(p, max_tokens=32, drafter="none")
        got = e.generate(p, max_tokens=32, drafter="model", draft_len=draft_len)
        assert got.token_ids == ref.token_ids, (p, draft_len)
        drafted += got.stats.drafted
    assert drafted > 0


def test_sampling_with_the_checkpoint_drafter_draws_the_targets_distribution(exported):
    e = edge.load(exported[0], drafter="none", context=256)
    sampling = dict(temperature=1.5, top_k=4)
    dist = exact_first_tokens(e, PROMPTS[2], 3, **sampling)
    counts, drafted, accepted = speculative_first_tokens(e, PROMPTS[2], 2000, "model", **sampling)
    assert 0 < accepted < drafted, (drafted, accepted)
    check = check_against(dist, counts)
    assert check.ok, check


def test_footprint_counts_the_drafter_by_its_own_shape(exported):
    from memory.footprint import Speculation, graph_weight_bytes, predict_peak

    out, m = exported
    g = m.drafters[1]
    fp = dict(predict_peak(m, Speculation(drafter="model", nodes=4, draft_graph=g.name), 200).parts)
    slots = 200 + 4 + 1 + 1  # context, draft tokens, the root, the scratch slot
    assert fp["drafter.kv"] == m.kv_bytes_per_token(g) * slots
    w = graph_weight_bytes(m, g)
    assert w.total == g.weight_bytes and abs(w.other) < 0.01 * w.total  # the prediction itself, from its own shape
    # what GraphSession allocates for it (the target's shape would give a third of that)
    assert fp["drafter.kv"] == 2 * 1 * 3 * 32 * 4 * slots != 2 * 1 * m.arch["kv_heads"] * m.arch["head_dim"] * 4 * slots
    e = edge.load(out, drafter="none", context=200)
    e.plan = SimpleNamespace(drafter="model", draft_graph=g.name)  # what a memory plan picked
    d = e._model_drafter(edge.GenerationParams(), None)
    layers, _, _, kv_heads, _, head_dim = d.sess.cache.buf.shape
    assert (layers, kv_heads, head_dim) == (1, 3, 32) and e._drafter_graph == g.name
    e.plan = SimpleNamespace(drafter="model", draft_graph=m.drafters[0].name)  # a re-plan to the early exit
    assert e._model_drafter(edge.GenerationParams(), None).sess.cache.buf.shape[3] == m.arch["kv_heads"]


def test_a_drafter_with_another_tokenizer_is_refused_before_the_long_steps(tmp_path, tiny_llama_dir, draft_dir,
                                                                          run_export_cli):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(draft_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens trade ids: same size, other meaning
    (other / "tokenizer.json").write_text(json.dumps(tok))
    r = run_export_cli(tiny_llama_dir, "-o", tmp_path / "out", "--precision", "fp32", "--drafter-layers",
                       "--drafter-checkpoint", other, "--max-len", "256", "-q")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "its tokenizer differs from the target's" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    r = run_export_cli(tiny_llama_dir, "-o", tmp_path / "out", "--drafter-checkpoint", tmp_path / "nope", "-q")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "nope" in r.stderr, r.stderr


def test_drafter_with_fewer_rows_than_the_targets_logits(tmp_path, tiny_llama_dir):
    """A target whose head has padding rows past the tokenizer (400 logits, 384 tokens) with a drafter of 384 rows
    (Qwen2.5-7B / 0.5B have 152064 / 151936): an id the drafter cannot embed is read as id 0, never a crash; the
    output stays the target's own."""
    target = tmp_path / "wide-target"
    build_checkpoint(target, "llama", tie=True, layers=2, seed=0, vocab=VOCAB + 16)
    draft = tmp_path / "draft"
    build_checkpoint(draft, "llama", tie=True, seed=11, **DRAFT_SHAPE)
    out = tmp_path / "m"
    m = export_model(target, out, tiny_export_options(drafters=(), drafter_checkpoints=((str(draft), 0),)),
                     progress=False)
    assert m.arch["vocab"] == VOCAB + 16 and m.drafters[0].vocab == VOCAB  # its head covers what it can embed
    e = edge.load(out, drafter="none", context=256)
    beyond = 0
    for p in PROMPTS + ["café 😀 日本", "rivers and mountains"]:
        ref = e.generate(p, max_tokens=24, drafter="none").token_ids
        assert e.generate(p, max_tokens=24, drafter="model", draft_len=3).token_ids == ref
        beyond += sum(t >= VOCAB for t in ref)
    assert beyond > 0  # the random target did write padding-row ids: the case was exercised


@pytest.mark.parametrize("shape,needle", [
    (dict(layers=1, hidden=40, heads=2, kv_heads=2, intermediate=64), "head dim 20 is not a multiple of 16"),
    (dict(layers=1, hidden=64, heads=4, kv_heads=2, intermediate=64, vocab=300), "300 embedding rows"),
])
def test_drafters_our_graph_cannot_run_are_refused_before_the_long_steps(tmp_path, tiny_llama_dir, run_export_cli,
                                                                         shape, needle):
    draft = tmp_path / "draft"
    build_checkpoint(draft, "llama", tie=True, seed=3, **shape)
    r = run_export_cli(tiny_llama_dir, "-o", tmp_path / "out", "--precision", "fp32", "--drafter-layers",
                       "--drafter-checkpoint", draft, "--max-len", "256", "-q")
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_malformed_drafter_shape_is_a_clear_load_error(exported, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(exported[0], bad)
    raw = json.loads((bad / "edge_model.json").read_text())
    raw["graphs"][2]["arch"] = {"hidden": 96, "layers": 1, "kv_heads": 0, "head_dim": 32, "vocab": VOCAB}
    (bad / "edge_model.json").write_text(json.dumps(raw))
    with pytest.raises(edge.ModelDirError, match="malformed shape"):
        edge.load(bad, drafter="none", context=256)


def test_default_reuse_notices_a_changed_drafter_checkpoint(tmp_path, tiny_llama_dir, draft_dir):
    from export.cli import _reusable

    draft = tmp_path / "draft"
    shutil.copytree(draft_dir, draft)
    opts = tiny_export_options(drafters=(), drafter_checkpoints=((str(draft), 96),))
    export_model(tiny_llama_dir, tmp_path / "m", opts, progress=False)
    assert _reusable(tmp_path / "m", tiny_llama_dir, opts)
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))  # another drafter now
    assert not _reusable(tmp_path / "m", tiny_llama_dir, opts)


def test_auto_runs_a_drafter_that_earns_its_cost(exported, tmp_path):
    """`drafter="auto"` picks the model drafter when its chains (measured agreement, measured call cost) are
    expected to beat free chains, and runs that graph; a drafter that agrees rarely, or agrees often but costs
    half a target call, leaves it to the free drafters."""
    copy = tmp_path / "m"
    shutil.copytree(exported[0], copy)
    assert edge.load(copy, context=256).default_drafter == "hybrid"  # random tiny drafters agree rarely
    raw = json.loads((copy / "edge_model.json").read_text())
    # the target's verify curve as a steady host would time it: the export's own timings of a tiny model are tens
    # of microseconds, whose noise under a busy host could decide the cases below
    target_ms = 1.0
    raw["graphs"][0]["stats"].update(latency_ms_s1=target_ms, latency_ms_by_s_at=[
        [128, [target_ms * (1 + 0.15 * i) for i in range(8)]], [1024, [target_ms * (1.2 + 0.18 * i) for i in range(8)]]])
    stats = raw["graphs"][3]["stats"]  # the trimmed checkpoint drafter
    stats.update(top1_agreement=0.997, latency_ms_s1=target_ms / 2)
    (copy / "edge_model.json").write_text(json.dumps(raw))
    assert edge.load(copy, context=256).default_drafter == "hybrid"
    stats.update(top1_agreement=0.9, latency_ms_s1=target_ms / 50)
    (copy / "edge_model.json").write_text(json.dumps(raw))
    e = edge.load(copy, context=256)
    assert e.default_drafter == "model"
    ref = e.generate(PROMPTS[0], max_tokens=16, drafter="none")
    r = e.generate(PROMPTS[0], max_tokens=16)
    assert r.stats.drafter == "model" and r.token_ids == ref.token_ids
    assert e._drafter_graph == raw["graphs"][3]["name"]


def test_replanning_credits_measured_acceptance_to_the_graph_that_earned_it(exported, monkeypatch):
    """The model drafter's online acceptance was measured on the graph that ran; a re-plan must not credit it to
    every drafter graph (it would then move to a cheaper graph that never earned it). A switch starts the new
    graph from its own measured agreement."""
    import edge.planning
    from memory.acceptance import AcceptanceStats

    out, m = exported
    e = edge.load(out, drafter="model", context=256)
    e.generate(PROMPTS[0], max_tokens=8)  # runs the best-agreement graph
    ran = e._drafter_graph
    e.policy.acceptance["model"] = AcceptanceStats(0.9)
    seen = {}
    real = edge.planning.make_plan

    def spy(manifest, profile, context, budget, stats=None, **kw):
        seen.update(stats)
        return real(manifest, profile, context, budget, stats=stats, **kw)

    monkeypatch.setattr(edge.planning, "make_plan", spy)
    e._replan(64)
    assert "model" not in seen and seen[ran].rate[0, 0] == pytest.approx(0.9)
    other = next(g for g in m.drafters if g.name != ran)
    e.plan = SimpleNamespace(drafter="model", draft_graph=other.name)
    e._model_drafter(edge.GenerationParams(), None)
    assert e.policy.stats("model").rate[0, 0] == pytest.approx(other.stats.get("top1_agreement", 0.3))


def test_a_failed_drafter_switch_leaves_nothing_half_built(exported, monkeypatch):
    out, m = exported
    e = edge.load(out, drafter="none", context=256)
    ref = e.generate(PROMPTS[1], max_tokens=16).token_ids
    assert e.generate(PROMPTS[1], max_tokens=16, drafter="model").token_ids == ref
    first, early = e._drafter_graph, m.drafters[0]
    e.plan = SimpleNamespace(drafter="model", draft_graph=early.name)  # a plan moves to the early exit ...

    def unreadable(*a, **k):
        raise OSError("disk went away")

    monkeypatch.setattr(np, "load", unreadable)
    with pytest.raises(OSError):  # ... whose id map cannot be read this once
        e._model_drafter(edge.GenerationParams(), None)
    monkeypatch.undo()
    d = e._model_drafter(edge.GenerationParams(), None)  # rebuilt whole: session, id map and cache agree
    assert e._drafter_graph == early.name and len(d.id_map) == early.vocab and d.sess.vocab == early.vocab
    e.plan = None
    assert e.generate(PROMPTS[1], max_tokens=16, drafter="model").token_ids == ref
    assert e._drafter_graph == first


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
