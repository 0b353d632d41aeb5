"""The numpy reference (`export/reference.py`) against transformers' torch forward, and the checkpoint reader.

The reference is the "source logits" of every parity report and of every graph test here, so it is checked first
against an independent implementation: transformers on the same tiny random checkpoints.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import VOCAB, build_checkpoint
from export import reference
from export.checkpoint import CheckpointError, load_checkpoint, load_hf_dir, read_safetensors

TOL = 1e-4


def torch_logits(model_dir, ids, positions=None) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        kw = {} if positions is None else {"position_ids": torch.tensor(positions)[None]}
        return model(torch.tensor(ids)[None], **kw).logits[0].numpy()


@pytest.fixture(scope="module")
def prompt() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, 29)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "untied"])
def test_reference_matches_transformers(checkpoint_dirs, kind, prompt):
    d = checkpoint_dirs[kind]
    ck = load_hf_dir(d)
    want = torch_logits(d, prompt)
    got = reference.forward(ck, prompt)
    assert got.shape == (len(prompt), VOCAB)
    assert np.abs(want).std() > 1.0  # logits spread: a tolerance of 1e-4 is a real constraint
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_reference_positions_offset(checkpoint_dirs, kind, prompt):
    """Explicit positions (what a tree node gets: prefix length + depth) match transformers' position_ids."""
    d = checkpoint_dirs[kind]
    pos = np.arange(len(prompt)) + 17
    np.testing.assert_allclose(reference.forward(load_hf_dir(d), prompt, positions=pos),
                               torch_logits(d, prompt, pos), atol=TOL, rtol=0)


def test_config_numbers(checkpoint_dirs):
    c = load_hf_dir(checkpoint_dirs["llama"]).config
    assert (c.family, c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.intermediate, c.vocab) == \
        ("llama", 64, 3, 4, 2, 16, 128, VOCAB)
    assert c.tie_embeddings and not c.qkv_bias and c.eos_token_ids == (2,) and c.bos_token_id == 1
    q = load_hf_dir(checkpoint_dirs["qwen2"]).config
    assert q.family == "qwen2" and q.qkv_bias
    u = load_hf_dir(checkpoint_dirs["untied"])
    assert not u.config.tie_embeddings
    assert not np.array_equal(u.lm_head, u.weights["model.embed_tokens.weight"])


def test_untied_head_is_used(checkpoint_dirs, prompt):
    """Swapping the untied head for the embedding must change the logits (the reference reads lm_head)."""
    ck = load_hf_dir(checkpoint_dirs["untied"])
    w = dict(ck.weights)
    w["lm_head.weight"] = w["model.embed_tokens.weight"]
    other = type(ck)(ck.config, w, ck.source, ck.source_format)
    assert np.abs(reference.forward(ck, prompt) - reference.forward(other, prompt)).max() > 0.1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_safetensors_widen_exactly(tmp_path, dtype):
    """F16 / BF16 tensors read by our own safetensors parser equal torch's widening to fp32, bit for bit."""
    import torch
    from safetensors.torch import load_file

    model = build_checkpoint(tmp_path, "llama", layers=1, seed=5, dtype=dtype)
    del model
    raw = load_file(str(tmp_path / "model.safetensors"))
    got = read_safetensors(tmp_path / "model.safetensors")
    assert set(got) == set(raw)
    for k, t in raw.items():
        assert t.dtype == getattr(torch, dtype)
        np.testing.assert_array_equal(got[k], t.float().numpy(), err_msg=k)


def test_mistral_alias_reads_as_llama(tmp_path, tiny_llama_dir):
    """MistralForCausalLM reads as the llama family; `load_checkpoint` on a HF dir gives the HF loader."""
    import shutil

    d = tmp_path / "mistral"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    ck = load_checkpoint(d)
    assert ck.config.family == "llama" and ck.source_format == "hf"


def test_rope_scaling_rejected(tmp_path, tiny_llama_dir):
    import shutil

    d = tmp_path / "scaled"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope scaling"):
        load_hf_dir(d)
