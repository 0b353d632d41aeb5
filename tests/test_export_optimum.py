"""`edge-export --via optimum`: architectures our graph builder does not cover, exported by Hugging Face optimum and
driven by edge.runner.OptimumSession (plain + chain decoding, no trees). Tiny random GPT-2 and Phi-3 checkpoints
built here; nothing is downloaded."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import BOS, EOS, VOCAB, build_tokenizer

import optimum.exporters.onnx  # noqa: F401  (in the [test] extra: a broken install fails, never skips)


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
    # fp32: the parity bar against the source model
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
