"""A separate small checkpoint as the `model` drafter (`edge-export TARGET -o OUT --drafter-checkpoint SMALL`):
exported whole with its own shape (other hidden size, heads, KV heads and head dim than the target), its LM head
trimmed to the target's most frequent tokens; refused when its tokenizer differs; lossless at runtime, greedy and
sampling; its KV cache and weights counted by its own shape."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import edge
from conftest import build_checkpoint, tiny_export_options
from edge.manifest import FORMAT_VERSION, load_manifest
from export.checkpoint import load_hf_dir
from export.pipeline import export_model

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
    opts = tiny_export_options(drafters=(), drafter_checkpoints=((str(draft_dir), 0), (str(draft_dir), 96)))
    return out, export_model(tiny_llama_dir, out, opts, progress=False)


def test_manifest_records_the_drafters_own_shape(exported, draft_dir):
    out, m = exported
    again = load_manifest(out, verify="sha256")
    assert again == m and m.format_version == FORMAT_VERSION == 2  # an older edgespec is told to upgrade
    full, trimmed = m.drafters
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
    from test_engine import _check_against, _exact_first_tokens, _speculative_first_tokens

    e = edge.load(exported[0], drafter="none", context=256)
    sampling = dict(temperature=1.5, top_k=4)
    dist = _exact_first_tokens(e, PROMPTS[2], 3, **sampling)
    counts, drafted, accepted = _speculative_first_tokens(e, PROMPTS[2], 2000, "model", **sampling)
    assert 0 < accepted < drafted, (drafted, accepted)
    check = _check_against(dist, counts)
    assert check.ok, check


def test_footprint_counts_the_drafter_by_its_own_shape(exported):
    from memory.footprint import Speculation, graph_weight_bytes, predict_peak

    out, m = exported
    g = m.drafters[0]
    fp = dict(predict_peak(m, Speculation(drafter="model", nodes=4, draft_graph=g.name), 200).parts)
    slots = 200 + 4 + 1
    assert fp["drafter.kv"] == m.kv_bytes_per_token(g) * slots
    assert graph_weight_bytes(m, g).total == g.weight_bytes
    # what GraphSession allocates for it (the target's shape would give a third of that)
    assert fp["drafter.kv"] == 2 * 1 * 3 * 32 * 4 * slots != 2 * 1 * m.arch["kv_heads"] * m.arch["head_dim"] * 4 * slots
    d = edge.load(out, drafter="none", context=200)._model_drafter(edge.GenerationParams(), None)
    layers, _, _, kv_heads, _, head_dim = d.sess.cache.buf.shape
    assert (layers, kv_heads, head_dim) == (1, 3, 32)


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
