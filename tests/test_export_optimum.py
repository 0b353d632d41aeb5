"""`edge-export --via optimum` (export/via_optimum.py): architectures our graph builder does not cover, exported by
Hugging Face optimum and driven by edge.runner.OptimumSession (plain + chain decoding, no trees). Tiny random GPT-2
and Phi-3 checkpoints built here; nothing is downloaded.

The rest runs without a torch trace: a hand-made graph with optimum's interface (input_ids, attention_mask,
position_ids, past and present K/V, logits) stands in for optimum's trace, and Gemm/MatMul graphs for the quantizer.
"""
from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import BOS, EOS, VOCAB, build_tokenizer, tiny_export_options
from export import via_optimum
from export.checkpoint import CheckpointError

import optimum.exporters.onnx  # noqa: F401  (in the [test] extra: a broken install fails, never skips)


# ----------------------------------------------------------------------------- optimum's own trace

def _gpt2(d):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    d.mkdir(parents=True)
    torch.manual_seed(5)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                   bos_token_id=BOS, eos_token_id=EOS)).eval()
    with torch.no_grad():  # O(1) logits so argmax comparisons mean something
        for p in m.parameters():
            p.mul_(8.0 if p.dim() == 2 else 1.0)
    m.save_pretrained(d)
    build_tokenizer(d)
    return m


def _phi3(d):
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    d.mkdir(parents=True)
    torch.manual_seed(6)
    m = Phi3ForCausalLM(Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0)).eval()
    m.save_pretrained(d)
    build_tokenizer(d)
    return m


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    from export.pipeline import export_model

    from conftest import tiny_export_options

    root = tmp_path_factory.mktemp("optimum")
    model = _gpt2(root / "gpt2")
    m = export_model(root / "gpt2", root / "gpt2-fp32", tiny_export_options(drafters=()), progress=False,
                     via="optimum")
    return root, model, m


def test_manifest_describes_an_optimum_graph(gpt2):
    root, _, m = gpt2
    t = m.target
    assert (t.io, t.tree_capable, t.precision) == ("optimum", False, "fp32")
    assert m.arch["layers"] == 2 and m.arch["kv_heads"] == 4 and m.arch["head_dim"] == 16 and m.arch["vocab"] == VOCAB
    assert m.drafters == [] and m.source["via"] == "optimum"
    # fp32: exact top-1 agreement with the source model, logits within 1e-3
    assert m.parity["top1_agreement"] == 1.0 and m.parity["max_abs_diff"] <= 1e-3, m.parity
    on_disk = json.loads((root / "gpt2-fp32" / "edge_model.json").read_text())
    assert on_disk["graphs"][0]["io"] == "optimum"


def test_cached_decoding_matches_transformers(gpt2):
    """Prefill, single steps, a rollback and a re-decode through the session's KV copies equal one full-sequence
    forward of the transformers model."""
    import torch

    from edge.manifest import load_manifest
    from edge.runner import OptimumSession

    root, model, _ = gpt2
    m = load_manifest(root / "gpt2-fp32")
    s = OptimumSession.from_manifest(str(root / "gpt2-fp32" / m.target.file), m, m.target, 64)
    ids = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    got = [s.forward(ids[:6])]
    s.cache.append(6)
    for t in ids[6:8]:
        got.append(s.forward([t]))
        s.cache.append(1)
    s.cache.trim(2)  # roll back two tokens, then verify the rest as one chain
    out = s.call(ids[6:])
    got.append(out.logits)
    s.cache.append(4)
    assert s.cache.length == len(ids)
    np.testing.assert_allclose(np.concatenate(got[:3]), ref[:8], atol=1e-4)
    np.testing.assert_allclose(got[3], ref[6:], atol=1e-4)
    # Token Recycling's candidates: the top-k of each returned row, best first
    np.testing.assert_array_equal(out.top_ids[:, 0], got[3].argmax(-1))
    assert out.top_ids.shape == (4, s.topk) and np.all(np.diff(np.take_along_axis(got[3], out.top_ids, -1)) <= 0)
    # explicit positions (also through the 1-token padding) give the same logits as the default ones
    one = s.forward(ids[-1:]).copy()
    np.testing.assert_array_equal(s.forward(ids[-1:], positions=np.array([len(ids)])), one)
    from edge.errors import EngineError

    with pytest.raises(EngineError, match="cannot verify a tree"):
        s.forward([1, 2], bias=np.zeros((1, 1, 2, s.cache.length + 2), np.float32))


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_lookup_decoding_is_lossless(gpt2, tmp_path, precision):
    from edge import load
    from export.pipeline import export_model

    from conftest import tiny_export_options

    root, _, _ = gpt2
    out = root / "gpt2-fp32"
    if precision != "fp32":
        out = tmp_path / precision
        export_model(root / "gpt2", out, tiny_export_options(drafters=(), precision=precision), progress=False,
                     via="optimum")
        import onnx

        ops = {n.op_type for n in onnx.load(str(out / "target" / "model.onnx"), load_external_data=False).graph.node}
        assert "MatMulNBits" in ops
    eng = load(str(out), drafter="auto")
    assert type(eng.target).__name__ == "OptimumSession" and eng.target.chains_exact
    assert eng.default_drafter == "hybrid" and not eng.target.tree_exact  # chains exact here, trees never
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    plain = eng.generate(prompt, max_tokens=40, drafter="none")
    for drafter in ("lookup", "recycling", "hybrid"):
        spec = eng.generate(prompt, max_tokens=40, drafter=drafter, draft_len=4)
        assert spec.token_ids == plain.token_ids, drafter
        assert spec.drafted > 0, drafter


def test_phi3_exports_and_chats(tmp_path):
    from edge import load
    from export.pipeline import export_model

    from conftest import tiny_export_options

    _phi3(tmp_path / "phi3")
    m = export_model(tmp_path / "phi3", tmp_path / "out", tiny_export_options(drafters=()), progress=False,
                     via="optimum")
    assert m.arch["kv_heads"] == 2 and m.parity["top1_agreement"] == 1.0
    r = load(str(tmp_path / "out")).generate([{"role": "user", "content": "hi"}], max_tokens=5)
    assert len(r.token_ids) == 5


def test_cli_errors_are_one_line(tmp_path, capsys, tiny_llama_dir):
    from export.cli import main

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert main([str(gguf), "-o", str(tmp_path / "o"), "--via", "optimum", "-q"]) == 2
    err = capsys.readouterr().err
    assert "directory" in err and "Traceback" not in err
    assert main([str(tiny_llama_dir), "-o", str(tmp_path / "o"), "--via", "optimum", "-q", "--precision",
                 "fp16"]) == 2
    assert "not available --via optimum" in capsys.readouterr().err
    assert main([str(tiny_llama_dir), "-o", str(tmp_path / "o"), "--via", "optimum", "-q",
                 "--drafter-layers", "1"]) == 2
    assert "no early-exit drafter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--default", "--via", "optimum"])
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_attention_softcapping_is_refused_not_traced_away(tmp_path, capsys):
    """gemma2 caps attention logits; optimum's trace takes the sdpa path, which drops the cap (measured: max
    |Δlogit| 6.3 against eager transformers at a cap of 5, while parity against sdpa transformers read 1e-5)."""
    import json

    from export.cli import main

    d = tmp_path / "gemma2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                                               "attn_logit_softcapping": 5.0}))
    assert main([str(d), "-o", str(tmp_path / "o"), "--via", "optimum", "-q"]) == 2
    err = capsys.readouterr().err
    assert "softcapping (5.0) is lost" in err and "Traceback" not in err and not (tmp_path / "o").exists()


def test_unsupported_architecture_points_to_optimum(tmp_path):
    from export.checkpoint import CheckpointError, load_checkpoint

    _gpt2(tmp_path / "g")
    with pytest.raises(CheckpointError, match="--via optimum"):
        load_checkpoint(tmp_path / "g")


def test_width_dependent_graph_decodes_plainly(gpt2, monkeypatch):
    """If a verify call's width changed a token's logits, drafts could change the output: auto then decodes
    plainly, and the planner only offers what the graph can do."""
    from edge import load, runner
    from edge.planning import capabilities

    root, _, m = gpt2
    assert capabilities(m) == {"drafters": ("none", "lookup", "recycling", "hybrid"), "tree_drafters": ()}
    monkeypatch.setattr(runner, "width_independent", lambda session: False)
    eng = load(str(root / "gpt2-fp32"), drafter="auto")
    assert not eng.target.chains_exact and eng.default_drafter == "none"


@pytest.mark.parametrize("via,expected", [("optimum", "int4"), ("builder", "auto")])
def test_default_precision_follows_the_export_path(tmp_path, monkeypatch, via, expected):
    """No --precision: the builder's default (auto: chosen by measuring int4 and w8a8 targets) is not something
    optimum's path can build; it gets int4."""
    import export.cli as cli

    seen = {}

    def record(src, out, opts, progress, via):
        seen["p"] = opts.precision
        raise ValueError("recorded")

    monkeypatch.setattr(cli, "export_model", record)
    assert cli.main([str(tmp_path), "-o", str(tmp_path / "o"), "--via", via, "-q"]) == 2
    assert seen["p"] == expected


# ----------------------------------------------------------------------------- on a fake trace: the whole path

KV_HEADS, HEAD_DIM, LAYERS = 2, 16, 2
HIDDEN = KV_HEADS * HEAD_DIM
LOGGER = "onnxruntime.quantization.matmul_nbits_quantizer"  # one INFO line per MatMul unless silenced


def _weights(vocab: int = VOCAB):
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((vocab, HIDDEN)).astype(np.float32)  # [V, H]
    head = (rng.standard_normal((HIDDEN, vocab)) / HIDDEN**0.5).astype(np.float32)  # [H, V]
    return emb, head


def _optimum_like_graph(vocab: int = VOCAB, static_vocab: bool = True, past: bool = True, ir_version: int = 14):
    """logits = emb[ids] @ head (each row depends on its own token only); present K/V = past ++ emb[ids] split
    into heads, for LAYERS layers."""
    emb, head = _weights(vocab)
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info("input_ids", i64, [1, "s"]),
              helper.make_tensor_value_info("attention_mask", i64, [1, "t"]),
              helper.make_tensor_value_info("position_ids", i64, [1, "s"])]
    outputs = [helper.make_tensor_value_info("logits", f, [1, "s", vocab if static_vocab else "vocab"])]
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
             helper.make_node("MatMul", ["x", "head"], ["logits"]),
             helper.make_node("Reshape", ["x", "split"], ["x4"]),
             helper.make_node("Transpose", ["x4"], ["kv"], perm=[0, 2, 1, 3])]
    for layer in range(LAYERS if past else 0):
        for kind in ("key", "value"):
            p, o = f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"
            inputs.append(helper.make_tensor_value_info(p, f, [1, KV_HEADS, "p", HEAD_DIM]))
            outputs.append(helper.make_tensor_value_info(o, f, [1, KV_HEADS, "t", HEAD_DIM]))
            nodes.append(helper.make_node("Concat", [p, "kv"], [o], axis=2))
    inits = [numpy_helper.from_array(emb, "emb"), numpy_helper.from_array(head, "head"),
             numpy_helper.from_array(np.array([1, -1, KV_HEADS, HEAD_DIM], np.int64), "split")]
    g = helper.make_graph(nodes, "optimum_like", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=ir_version)


def _checkpoint(d, **cfg):
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "model_type": "fakelm", "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_attention_heads": 4,
        "intermediate_size": 64, "max_position_embeddings": 64, "bos_token_id": BOS, "eos_token_id": [EOS, 0],
        **cfg}))
    build_tokenizer(d)
    return d


@pytest.fixture
def fake_optimum(monkeypatch):
    """optimum's export replaced by writing `_optimum_like_graph()`; the transformers reference by its numpy math.
    Returns the list of recorded main_export calls (set `.raise_` on it to make the export fail)."""
    class Calls(list):
        raise_ = None  # an exception the export raises instead of writing the graph

    calls = Calls()

    def main_export(model, output, task, **kw):
        calls.append((model, output, task, kw))
        if calls.raise_ is not None:
            raise calls.raise_
        assert task == "text-generation-with-past", task  # the graph the runtime drives has past K/V
        Path(output).mkdir(parents=True)
        onnx.save(_optimum_like_graph(), str(Path(output) / "model.onnx"))

    emb, head = _weights()
    monkeypatch.setattr(via_optimum, "_require_optimum", lambda: main_export)
    monkeypatch.setattr(via_optimum, "_source_logits", lambda src, prompts: [emb[p] @ head for p in prompts])
    return calls


def _export(src, out, **kw):
    from export.pipeline import export_model

    return export_model(src, out, tiny_export_options(**{"drafters": (), **kw}), progress=False, via="optimum")


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
def test_the_manifest_describes_what_was_written(tmp_path, fake_optimum, precision):
    from edge.manifest import PARTIAL_MARKER, load_manifest
    from edge.planning import expected_min_call
    from export.pipeline import source_digest

    src = _checkpoint(tmp_path / "ck")
    out = tmp_path / "out"
    m = _export(src, out, precision=precision, block_size=16, accuracy_level=1, max_len=256, name="fake-name")
    assert len(fake_optimum) == 1 and fake_optimum[0][3]["local_files_only"] is True
    t = m.target
    assert (t.io, t.tree_capable, t.precision, t.layers, t.vocab) == ("optimum", False, precision, LAYERS, VOCAB)
    # the model's 64 positions cap --max-len 256
    assert t.max_len == 64 and m.arch["max_positions"] == 64
    if precision == "fp32":
        assert (t.block_size, t.accuracy_level) == (0, 0)
    else:
        assert (t.block_size, t.accuracy_level) == (16, 1)
    # the graph's weights are its proto and its external data, both under target/
    on_disk = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    assert t.weight_bytes == on_disk["target/model.onnx"] + on_disk["target/model.onnx.data"]
    # every file listed, and only those: optimum's raw export is gone, the partial marker was never listed
    assert {f.path for f in m.files} == set(on_disk) - {"edge_model.json"}
    assert not any(p.startswith("optimum") or p.endswith(PARTIAL_MARKER) for p in on_disk)
    load_manifest(out, verify="sha256")
    # latency for S = 1..8, the first one also as the one-token price
    assert len(t.stats["latency_ms_by_s"]) == 8 and t.stats["latency_ms_s1"] == t.stats["latency_ms_by_s"][0]
    # parity over three held-out prompts, and the probe results the planner reads without a session
    assert m.parity["prompts"] == 3 and (precision != "fp32" or m.parity["top1_agreement"] == 1.0), m.parity
    assert expected_min_call(m) == m.parity["min_call"] in (1, 2) and m.parity["chains_exact"] in (True, False)
    assert "export_seconds" in m.parity
    a = m.arch
    assert (a["family"], a["layers"], a["kv_heads"], a["head_dim"], a["heads"], a["hidden"]) == \
        ("fakelm", LAYERS, KV_HEADS, HEAD_DIM, 4, HIDDEN)
    assert a["eos_token_ids"] == [EOS, 0] and m.special_tokens["eos"] == [EOS, 0]
    assert m.name == "fake-name" and m.source["via"] == "optimum" and m.source["sha256"] == source_digest(src)
    assert {"optimum-onnx", "torch", "onnxruntime"} <= set(m.converter)
    g = onnx.load(str(out / "target" / "model.onnx"), load_external_data=False)
    assert g.ir_version <= via_optimum.IR_VERSION_MAX  # the trace wrote IR 14
    ops = [n for n in g.graph.node if n.op_type == "MatMulNBits"]
    if precision == "fp32":
        assert not ops
    else:
        attrs = {a.name: helper.get_attribute_value(a) for a in ops[0].attribute}
        assert (len(ops), attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == \
            (1, 8 if precision == "int8" else 4, 16, 1)


@pytest.mark.parametrize("error,first", [(ValueError("gpt-x is not supported\nsee the docs"), "gpt-x is not supported"),
                                         (NotImplementedError(), "NotImplementedError"),
                                         (KeyError("gpt-x"), "'gpt-x'")])
def test_optimum_refusing_the_model_is_one_clear_error(tmp_path, fake_optimum, error, first):
    fake_optimum.raise_ = error
    with pytest.raises(CheckpointError) as e:
        _export(_checkpoint(tmp_path / "ck"), tmp_path / "out")
    assert str(e.value).endswith(f"optimum cannot export this model for text generation: {first}"), e.value
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_softcapping_is_refused_before_the_trace_and_a_null_cap_is_not(tmp_path, fake_optimum):
    """A config with attention logit softcapping is refused before optimum traces it, naming the cap; a null cap is
    no cap and exports. The message is matched in full: a tmp_path named after the test would put "softcapping" into
    any error message."""
    with pytest.raises(CheckpointError, match=r"attention logit softcapping \(5.0\) is lost in optimum's trace"):
        _export(_checkpoint(tmp_path / "capped", attn_logit_softcapping=5.0), tmp_path / "out")
    assert fake_optimum == []
    _export(_checkpoint(tmp_path / "uncapped", attn_logit_softcapping=None), tmp_path / "out")
    assert len(fake_optimum) == 1


def test_a_separate_drafter_checkpoint_is_refused_through_the_api(tmp_path, fake_optimum):
    """The CLI refuses --drafter-checkpoint --via optimum itself; export_model callers reach this check."""
    with pytest.raises(ValueError, match="--drafter-checkpoint needs"):
        _export(_checkpoint(tmp_path / "ck"), tmp_path / "out", drafter_checkpoints=((str(tmp_path / "d"), 0),))
    assert fake_optimum == []


@pytest.mark.parametrize("bits", [0, 4, 8])
def test_lm_head_bits_are_refused_not_ignored(tmp_path, fake_optimum, capsys, bits):
    """ORT's quantizer quantizes the LM head with every other MatMul at --precision, so a head precision of its own
    is refused, never silently not what the export writes."""
    from export.cli import main

    with pytest.raises(ValueError, match="--lm-head-bits needs edgespec's own graph builder"):
        _export(_checkpoint(tmp_path / "ck"), tmp_path / "out", lm_head_bits=bits, precision="int4")
    assert fake_optimum == []
    assert main([str(tmp_path / "ck"), "-o", str(tmp_path / "o"), "--via", "optimum", "-q",
                 "--lm-head-bits", str(bits)]) == 2
    err = capsys.readouterr().err
    assert "--lm-head-bits needs" in err and "Traceback" not in err and fake_optimum == []


# ----------------------------------------------------------------------------- _graph_arch

def _arch(tmp_path, cfg, **graph):
    path = tmp_path / "model.onnx"
    onnx.save(_optimum_like_graph(**graph), str(path))
    return via_optimum._graph_arch(path, cfg)


@pytest.mark.parametrize("cfg,expected", [
    # GPT-2's names; the graph's vocabulary wins over config.json's
    ({"model_type": "gpt2", "n_embd": 32, "n_head": 8, "n_positions": 64, "n_inner": None, "layer_norm_epsilon": 1e-5,
      "vocab_size": 999, "bos_token_id": 1, "eos_token_id": 2},
     {"family": "gpt2", "hidden": 32, "heads": 8, "max_positions": 64, "intermediate": 128, "rms_eps": 1e-5,
      "vocab": VOCAB, "bos_token_id": 1, "eos_token_ids": [2], "tie_embeddings": True, "rope_theta": 0.0}),
    ({"n_embd": 32, "n_inner": 48}, {"hidden": 32, "intermediate": 48}),
    ({"d_model": 24}, {"hidden": 24, "intermediate": 96}),
    # llama's names
    ({"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 80, "max_position_embeddings": 100,
      "rms_norm_eps": 1e-6, "rope_theta": 5e5, "tie_word_embeddings": False, "eos_token_id": [2, 5]},
     {"hidden": 32, "heads": 4, "intermediate": 80, "max_positions": 100, "rms_eps": 1e-6, "rope_theta": 5e5,
      "tie_embeddings": False, "eos_token_ids": [2, 5]}),
    # nothing known: K/V heads stand in for the heads, 2048 positions, no end tokens
    ({}, {"family": "?", "hidden": 0, "heads": KV_HEADS, "max_positions": 2048, "eos_token_ids": [],
          "bos_token_id": None, "intermediate": 0, "rms_eps": 0.0, "tie_embeddings": True, "rope_theta": 0.0}),
])
def test_graph_arch_reads_each_config_dialect(tmp_path, cfg, expected):
    a = _arch(tmp_path, cfg)
    assert (a["layers"], a["kv_heads"], a["head_dim"]) == (LAYERS, KV_HEADS, HEAD_DIM)  # the graph's K/V shapes
    assert {k: a[k] for k in expected} == expected


def test_graph_arch_takes_the_vocabulary_from_config_when_the_graph_leaves_it_open(tmp_path):
    assert _arch(tmp_path, {"vocab_size": 300}, static_vocab=False)["vocab"] == 300


def test_graph_arch_refuses_a_graph_without_past_inputs(tmp_path):
    with pytest.raises(CheckpointError, match="no past_key_values inputs"):
        _arch(tmp_path, {}, past=False)


# ----------------------------------------------------------------------------- _gemm_to_matmul

def _gemm_graph():
    """Gemms the rewrite takes (g1 transB + bias, g2 no bias, g3 empty bias name, g10 explicit alpha = beta = 1) and
    ones it must leave (transA, alpha, beta, a weight that is no initializer, a weight two Gemms share)."""
    rng = np.random.default_rng(1)
    f = TensorProto.FLOAT

    def w(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    inits = [w("W1", 5, 3), w("b1", 5), w("W2", 3, 4), w("W3", 3, 4), w("W4", 3, 4), w("W5", 3, 4), w("b5", 4),
             w("W6", 3, 4), w("b6", 4), w("WS", 4, 3), w("W10", 3, 4), w("b10", 4)]
    gemm = helper.make_node
    nodes = [gemm("Gemm", ["x", "W1", "b1"], ["o1"], name="g1", transB=1),
             gemm("Gemm", ["x", "W2"], ["o2"], name="g2"),
             gemm("Gemm", ["x", "W3", ""], ["o3"], name="g3"),
             gemm("Gemm", ["xt", "W4"], ["o4"], name="g4", transA=1),
             gemm("Gemm", ["x", "W5", "b5"], ["o5"], name="g5", alpha=0.5),
             gemm("Gemm", ["x", "W6", "b6"], ["o6"], name="g6", beta=0.5),
             gemm("Gemm", ["x", "Y"], ["o7"], name="g7", transB=1),
             gemm("Gemm", ["x", "WS"], ["o8"], name="g8", transB=1),
             gemm("Gemm", ["x", "WS"], ["o9"], name="g9", transB=1),
             gemm("Gemm", ["x", "W10", "b10"], ["o10"], name="g10", alpha=1.0, beta=1.0)]
    ins = [helper.make_tensor_value_info("x", f, [2, 3]), helper.make_tensor_value_info("xt", f, [3, 2]),
           helper.make_tensor_value_info("Y", f, [4, 3])]
    outs = [helper.make_tensor_value_info(o, f, None) for n in nodes for o in n.output]
    g = helper.make_graph(nodes, "gemms", ins, outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _run(model, feeds):
    import onnxruntime as ort

    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))


def test_gemm_to_matmul_rewrites_exactly_the_plain_gemms_and_keeps_the_results(tmp_path):
    rng = np.random.default_rng(2)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in (("x", (2, 3)), ("xt", (3, 2)), ("Y", (4, 3)))}
    model = _gemm_graph()
    ref = _run(model, feeds)
    shared = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "WS")).copy()
    assert via_optimum._gemm_to_matmul(model) == 4
    assert sorted(n.name for n in model.graph.node if n.op_type == "Gemm") == ["g4", "g5", "g6", "g7", "g8", "g9"]
    assert [n.op_type for n in model.graph.node].count("Add") == 2  # g1's and g10's bias; g2, g3 have none
    np.testing.assert_array_equal(numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "WS")),
                                  shared)
    got = _run(model, feeds)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-5, err_msg=k)


# ----------------------------------------------------------------------------- _quantize

def _linear_graph():
    """x [2, 32] → Gemm(transB, bias) [2, 64] → MatMul [2, 48], written as IR 14 (newer than ONNX Runtime loads)."""
    rng = np.random.default_rng(3)
    wg = rng.standard_normal((64, 32)).astype(np.float32) / 32**0.5
    bg = rng.standard_normal(64).astype(np.float32)
    wm = rng.standard_normal((64, 48)).astype(np.float32) / 8
    f = TensorProto.FLOAT
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "wg", "bg"], ["h"], transB=1), helper.make_node("MatMul", ["h", "wm"], ["y"])],
        "linear", [helper.make_tensor_value_info("x", f, [2, 32])], [helper.make_tensor_value_info("y", f, [2, 48])],
        [numpy_helper.from_array(wg, "wg"), numpy_helper.from_array(bg, "bg"), numpy_helper.from_array(wm, "wm")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=14), (wg, bg, wm)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_writes_asymmetric_blocks_of_the_asked_shape(tmp_path, caplog, bits):
    import onnxruntime as ort

    model, (wg, bg, wm) = _linear_graph()
    onnx.save(model, str(tmp_path / "raw.onnx"))
    dst = tmp_path / "q" / "model.onnx"
    dst.parent.mkdir()
    with caplog.at_level(logging.DEBUG):
        via_optimum._quantize(tmp_path / "raw.onnx", dst, bits, 16, 1)
    assert not [r for r in caplog.records if r.levelno < logging.WARNING and r.name == LOGGER]
    assert (dst.parent / "model.onnx.data").is_file()
    q = onnx.load(str(dst), load_external_data=False)
    assert q.ir_version <= via_optimum.IR_VERSION_MAX
    assert not {"Gemm", "MatMul"} & {n.op_type for n in q.graph.node}  # both linears quantized, the Gemm too
    nbits = [n for n in q.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2
    for n in nbits:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (bits, 16, 1)
        assert len(n.input) >= 4 and n.input[3], "asymmetric blocks carry zero points"
    x = np.random.default_rng(4).standard_normal((2, 32)).astype(np.float32)
    ref = (x @ wg.T + bg) @ wm
    (y,) = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.abs(y - ref).max() <= (0.05 if bits == 8 else 0.25) * np.abs(ref).max()


def test_quantize_names_a_missing_dependency(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime.quantization.matmul_nbits_quantizer", None)
    with pytest.raises(CheckpointError, match=r"int4/int8 needs onnxruntime\.quantization.*edgespec\[optimum\]"):
        via_optimum._quantize(tmp_path / "raw.onnx", tmp_path / "q.onnx", 4, 32, 4)


# ----------------------------------------------------------------------------- _require_optimum, read_hf_config

def test_require_optimum_names_what_is_missing(monkeypatch):
    exporters = types.ModuleType("optimum.exporters.onnx")
    exporters.main_export = object()
    monkeypatch.setitem(sys.modules, "optimum.exporters.onnx", exporters)
    monkeypatch.setitem(sys.modules, "torch", None)  # optimum importable, torch not
    with pytest.raises(CheckpointError, match=r"\(torch is missing\).*edgespec\[optimum\]"):
        via_optimum._require_optimum()
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    assert via_optimum._require_optimum() is exporters.main_export
    monkeypatch.setitem(sys.modules, "optimum.exporters.onnx", None)
    with pytest.raises(CheckpointError, match=r"\(optimum\.exporters\.onnx is missing\)"):
        via_optimum._require_optimum()


def test_read_hf_config_errors_name_the_problem(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="GGUF files: use the default fast path"):
        via_optimum.read_hf_config(gguf)
    d = tmp_path / "ck"
    d.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        via_optimum.read_hf_config(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        via_optimum.read_hf_config(d)
    (d / "config.json").write_text('{"model_type": "gpt2"}')
    assert via_optimum.read_hf_config(d) == {"model_type": "gpt2"}


@pytest.mark.parametrize("text", ['["llama"]', '"llama"', "3", "null"])
def test_a_config_that_is_json_but_no_object_is_one_clear_error_on_both_paths(tmp_path, capsys, text):
    """Valid JSON that is not an object is one clear error in both exporters, not an AttributeError traceback."""
    from export.cli import main

    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="not an object of config fields"):
        via_optimum.read_hf_config(d)
    for via in ("builder", "optimum"):
        assert main([str(d), "-o", str(tmp_path / via), "--via", via, "-q"]) == 2
        err = capsys.readouterr().err
        assert "config.json: a JSON" in err and "Traceback" not in err, (via, err)


def test_source_logits_use_the_eager_attention_in_float32(tmp_path, monkeypatch):
    """Parity is against the checkpoint's own math: sdpa kernels skip e.g. softcapping."""
    import torch
    import transformers

    seen = {}

    class Auto:
        @staticmethod
        def from_pretrained(path, **kw):
            seen.update(kw, path=path)
            return types.SimpleNamespace(eval=lambda: lambda ids: types.SimpleNamespace(
                logits=torch.arange(ids.shape[1] * 3, dtype=torch.float32).reshape(1, -1, 3)))

    monkeypatch.setattr(transformers, "AutoModelForCausalLM", Auto)
    got = via_optimum._source_logits(tmp_path, [[5, 6], [7]])
    assert seen == {"path": str(tmp_path), "local_files_only": True, "dtype": torch.float32,
                    "attn_implementation": "eager"}
    assert [g.shape for g in got] == [(2, 3), (1, 3)]


# ----------------------------------------------------------------------------- a context shorter than the latency calls

@pytest.mark.parametrize("max_len", [8, 12])
def test_a_short_max_len_still_measures_its_latency(tmp_path, fake_optimum, max_len):
    """Below --max-len 16 the 8-token latency calls still fit after their prefill: the export measures its latency
    instead of failing with CacheFull once the whole torch trace has run."""
    m = _export(_checkpoint(tmp_path / "ck"), tmp_path / "out", max_len=max_len)
    assert m.target.max_len == max_len and len(m.target.stats["latency_ms_by_s"]) == 8


def test_a_context_shorter_than_the_latency_calls_is_refused_before_the_trace(tmp_path, fake_optimum):
    with pytest.raises(ValueError, match="--max-len 7 is shorter than the 8-token calls .* use --max-len 8 or more"):
        _export(_checkpoint(tmp_path / "ck"), tmp_path / "out", max_len=7)
    with pytest.raises(CheckpointError, match="the model's context of 4 positions is shorter"):
        _export(_checkpoint(tmp_path / "ck4", max_position_embeddings=4), tmp_path / "out")
    assert fake_optimum == [] and not (tmp_path / "out.partial").exists()
