"""Gemma 3 in the fast exporter: its config and GGUF fields, the numpy reference against transformers, the graph
against the reference (sliding window past its width, in one-shot, decode, chain and tree calls), and lossless
speculation through the engine on a tiny random Gemma 3."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import BOS, VOCAB, build_checkpoint, causal, tiny_export_options
from export import reference
from export.checkpoint import CheckpointError, load_checkpoint, load_gguf, load_hf_dir
from export.graph import GraphOptions, build_graph, save_model
from kernels.tree import TreeLayout

WINDOW = 8  # far below the test sequences, so every sliding layer drops keys
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA = dict(hidden=64, heads=4, kv_heads=1, intermediate=128, layers=3, sliding_window=WINDOW,
             layer_types=LAYER_TYPES, query_pre_attn_scalar=24, rope_theta=100000.0, rope_local_base_freq=1000.0)
TOL = 2e-3
CAPACITY = 96


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck") / "tiny-gemma3"
    model = build_checkpoint(d, "gemma3", seed=7, **GEMMA)
    return d, model


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    return load_hf_dir(gemma_dir[0])


@pytest.fixture(scope="module")
def gemma_graph(gemma, tmp_path_factory):
    p = tmp_path_factory.mktemp("g3") / "model.onnx"
    save_model(build_graph(gemma, GraphOptions(precision="fp32", max_len=CAPACITY)), str(p))
    return p


def session(ck, path, shared_kv):
    c = ck.config
    return shared_kv(path, c.layers, c.kv_heads, c.head_dim, CAPACITY)


# ----------------------------------------------------------------------------- config

def test_config_reads_what_gemma3_computes(gemma):
    c = gemma.config
    assert c.family == "gemma3" and c.tie_embeddings
    assert c.sliding_window == WINDOW and c.sliding_layers == (0, 2)
    assert c.is_sliding(0) and not c.is_sliding(1)
    assert c.embed_scale == pytest.approx(64 ** 0.5) and c.softmax_scale == pytest.approx(24 ** -0.5)
    assert not np.allclose(c.inv_freq(0), c.inv_freq(1))  # local and global rotary bases
    assert c.to_dict()["sliding_layers"] == [0, 2]


def test_norm_weights_are_kept_as_one_plus_w(gemma_dir, gemma):
    _, model = gemma_dir
    hf = model.model.layers[0].post_feedforward_layernorm.weight.detach().numpy()
    np.testing.assert_allclose(gemma.layer(0, "post_feedforward_layernorm.weight"), 1 + hf, rtol=0, atol=1e-6)


def test_llama_manifest_keeps_its_fields(tiny_llama):
    assert not {"sliding_window", "sliding_layers", "embed_scale", "attn_scale"} & set(tiny_llama.config.to_dict())


@pytest.mark.parametrize("key,value,match", [
    ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("hidden_activation", "relu", "hidden_act"),
    ("use_bidirectional_attention", True, "bidirectional"),
])
def test_what_the_builder_does_not_compute_is_refused(gemma_dir, tmp_path, key, value, match):
    src, _ = gemma_dir
    d = tmp_path / "ck"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), key: value}))
    with pytest.raises(CheckpointError, match=match):
        load_hf_dir(d)


# ----------------------------------------------------------------------------- reference and graph

def test_reference_matches_transformers_past_the_window(gemma_dir, gemma):
    _, model = gemma_dir
    ids = np.random.default_rng(0).integers(0, VOCAB, 40)
    with torch.no_grad():
        want = model(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(reference.forward(gemma, ids), want, atol=1e-4, rtol=0)


def test_reference_window_changes_the_logits(gemma):
    """The window is not a no-op at this length: without it the sliding layers would see everything."""
    from dataclasses import replace

    from export.checkpoint import Checkpoint

    ids = np.random.default_rng(1).integers(0, VOCAB, 30)
    unwindowed = Checkpoint(replace(gemma.config, sliding_window=10**6), gemma.weights, gemma.source, "hf")
    a, b = reference.forward(gemma, ids), reference.forward(unwindowed, ids)
    np.testing.assert_allclose(a[:WINDOW], b[:WINDOW], atol=1e-5)
    assert np.abs(a[WINDOW:] - b[WINDOW:]).max() > 1e-2


def test_graph_matches_reference_one_shot_and_decode(gemma, gemma_graph, shared_kv):
    ids = np.random.default_rng(2).integers(0, VOCAB, 50)
    ref = reference.forward(gemma, ids)
    s = session(gemma, gemma_graph, shared_kv)
    np.testing.assert_allclose(s.run(ids, np.arange(50), causal(50, 0)), ref, atol=TOL, rtol=0)
    s.run(ids[:20], np.arange(20), causal(20, 0), keep=1)  # then one token per call past the window
    for t in range(20, 50):
        got = s.run(ids[t : t + 1], [t], causal(1, t))
        np.testing.assert_allclose(got[0], ref[t], atol=TOL, rtol=0, err_msg=f"position {t}")


@pytest.mark.parametrize("seed", range(4))
def test_tree_verify_matches_each_path_past_the_window(gemma, gemma_graph, shared_kv, seed):
    """A tree node sits at position prefix + depth in slot prefix + index: the window follows its position, so each
    node computes what plain decoding of its own path computes, also where the slot and the position differ by more
    than the window's width."""
    rng = np.random.default_rng(seed)
    s = session(gemma, gemma_graph, shared_kv)
    n = 24  # wider than the window: the deepest slots are far from their positions
    parents = [-1] + [int(rng.integers(max(0, i - 3), i)) for i in range(1, n)]
    prefix = rng.integers(0, VOCAB, int(rng.integers(WINDOW + 1, 40)))
    tokens = rng.integers(0, VOCAB, n)
    p = len(prefix)
    s.run(prefix, np.arange(p), causal(p, 0), keep=1)
    lay = TreeLayout.from_parents(parents)
    got = s.run(tokens, lay.position_ids(p), lay.attention_bias(p))
    children = {i for i in parents if i >= 0}
    for leaf in (i for i in range(n) if i not in children):
        path = lay.path_to(leaf)
        ref = reference.forward(gemma, np.concatenate([prefix, tokens[path]]))[p:]
        np.testing.assert_allclose(got[path], ref, atol=TOL, rtol=0, err_msg=f"leaf {leaf} path {path}")


# ----------------------------------------------------------------------------- GGUF

def _write_gemma3_gguf(ck, path):
    """A GGUF laid out as llama.cpp's gemma3 conversion writes it (f32 tensors, norms stored as 1 + w, no rotary
    permutation), with llama.cpp's fixed layer pattern: every 6th layer is full attention."""
    import gguf

    c = ck.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(512)
    w.add_embedding_length(c.hidden)
    w.add_block_count(c.layers)
    w.add_feed_forward_length(c.intermediate)
    w.add_head_count(c.heads)
    w.add_head_count_kv(c.kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_sliding_window(c.sliding_window)
    w.add_bos_token_id(BOS)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm":
             "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm":
             "post_ffw_norm", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for name, arr in ck.weights.items():
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            g = f"blk.{i}.{names[rest.rsplit('.', 1)[0]]}.weight"
        w.add_tensor(g, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loads_as_its_hf_checkpoint(tmp_path):
    """Six layers so llama.cpp's fixed pattern (every 6th layer full) is the config's own."""
    d = tmp_path / "hf"
    build_checkpoint(d, "gemma3", seed=8, **{**GEMMA, "layers": 6, "layer_types": None, "query_pre_attn_scalar": 16})
    hf = load_hf_dir(d)
    _write_gemma3_gguf(hf, tmp_path / "m.gguf")
    g = load_checkpoint(tmp_path / "m.gguf")
    assert g.source_format == "gguf"
    assert g.config.sliding_layers == hf.config.sliding_layers == (0, 1, 2, 3, 4)
    assert g.config.embed_scale == hf.config.embed_scale and g.config.softmax_scale == hf.config.softmax_scale
    assert set(g.weights) == set(hf.weights)
    for n in hf.weights:
        np.testing.assert_array_equal(g.weights[n], hf.weights[n], err_msg=n)


def test_unsupported_gguf_architecture_is_refused_before_reading_tensors(tmp_path, monkeypatch):
    import gguf.quants

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("a tensor was read"))
    with pytest.raises(CheckpointError, match="architecture 'phi3' not supported"):
        load_gguf(tmp_path / "m.gguf")


# ----------------------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def gemma_export(gemma_dir, tmp_path_factory):
    from export.pipeline import export_model

    out = tmp_path_factory.mktemp("export") / "tiny-gemma3"
    m = export_model(gemma_dir[0], out, tiny_export_options(precision="int4", drafters=((3, 128), (1, 0))),
                     progress=False)
    return out, m


def test_export_parity_and_manifest(gemma_export):
    _, m = gemma_export
    assert m.arch["family"] == "gemma3" and m.arch["sliding_window"] == WINDOW
    assert 0.3 < m.parity["top1_agreement"] <= 1  # int4 of a tiny random model; chance is 1 / 384


@pytest.mark.parametrize("drafter", ["model", "lookup", "recycling", "hybrid"])
def test_greedy_speculative_equals_plain_past_the_window(gemma_export, drafter):
    import edge

    eng = edge.load(gemma_export[0], drafter="none", context=CAPACITY)
    for prompt in ("the quick brown fox", "def add(a, b): return a + b; def add(a, b):"):
        ref = eng.generate(prompt, max_tokens=40, drafter="none", raw=True)
        for k in (2, 5):
            got = eng.generate(prompt, max_tokens=40, drafter=drafter, draft_len=k, raw=True)
            assert got.token_ids == ref.token_ids, (prompt, drafter, k)


def test_the_exporter_picks_a_full_depth_trimmed_head_drafter_where_the_head_dominates(gemma, tiny_llama):
    """Gemma 3 270M's shapes (head 168M weights, layers 100M) against SmolLM2-135M's (head 28M, layers 106M)."""
    from dataclasses import replace

    from export.pipeline import DEFAULT_DRAFTER, HEAD_DRAFTER_VOCAB, default_drafters

    g270 = replace(gemma.config, hidden=640, layers=18, heads=4, kv_heads=1, head_dim=256, intermediate=2048,
                   vocab=262144)
    smol = replace(tiny_llama.config, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                   vocab=49152)
    assert default_drafters(g270) == ((18, HEAD_DRAFTER_VOCAB),)
    assert default_drafters(smol) == (DEFAULT_DRAFTER,)
