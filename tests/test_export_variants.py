"""Checkpoint options our graph builder does not compute are refused before any work, not exported with the option
dropped. Each refused case below used to export "successfully" with a perfect parity report (the numpy reference
shares the builder's assumptions) while computing another model: 2.1–11.0 max |Δlogit| from transformers, top-1
agreement 0.18–0.76. Sliding-window attention is exact below the window, so those exports are capped there; linear
and Llama 3 rope scaling are computed, and checked against transformers itself."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import VOCAB, build_checkpoint, tiny_export_options
from export.checkpoint import CheckpointError, load_hf_dir


def _legacy(d, rope_scaling: dict) -> None:
    """Older configs (deepseek-coder, the Qwen2.5 model cards' YaRN snippet) name the rope type "type"."""
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = rope_scaling
    (d / "config.json").write_text(json.dumps(cfg))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("family,config,legacy,needle", [
    ("qwen2", {}, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, "rope scaling"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}, None,
     "rope scaling"),
    ("llama", {}, {"type": "llama3", "factor": 8.0}, "rope scaling"),  # incomplete: no frequency factors
    ("llama", {}, {**LLAMA3, "low_freq_factor": 0.0}, "factors must be finite and positive"),
    ("llama", {}, {"type": "linear", "factor": 0.0}, "factors must be finite and positive"),
    ("llama", {"attention_bias": True}, None, "attention_bias"),
    ("llama", {"mlp_bias": True}, None, "mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, None, "hidden_act 'gelu'"),
])
def test_options_the_graph_does_not_compute_are_refused(tmp_path, family, config, legacy, needle):
    d = tmp_path / "ck"
    build_checkpoint(d, family, layers=1, **config)
    if legacy:
        _legacy(d, legacy)
    with pytest.raises(CheckpointError, match=needle) as e:
        load_hf_dir(d)
    assert "--via optimum" in str(e.value)


def test_partial_rotary_is_refused(tmp_path):
    d = tmp_path / "ck"
    build_checkpoint(d, "llama", layers=1)
    cfg = json.loads((d / "config.json").read_text())
    cfg["partial_rotary_factor"] = 0.5
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.5"):
        load_hf_dir(d)


def test_weights_the_graph_would_not_use_are_refused(tmp_path):
    """A config that does not announce its biases (or a layer kind we do not know): the weights give it away."""
    d = tmp_path / "ck"
    build_checkpoint(d, "llama", layers=1, attention_bias=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["attention_bias"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"does not implement, e\.g\. model\.layers\.0\.self_attn\.\w_proj\.bias"):
        load_hf_dir(d)


def test_refusal_is_one_line_from_the_cli(tmp_path):
    d = tmp_path / "ck"
    build_checkpoint(d, "llama", layers=1, mlp_bias=True)
    r = subprocess.run([sys.executable, "-m", "export.cli", str(d), "-o", str(tmp_path / "out"), "-q"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "mlp_bias" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("scaling,legacy", [
    (LLAMA3, False),
    ({"rope_type": "linear", "factor": 4.0}, False),
    ({"type": "linear", "factor": 4.0}, True),  # deepseek-coder's form
])
def test_rope_scaling_is_computed_as_transformers_does(tmp_path, scaling, legacy):
    """Llama 3.x (rope_type llama3) and linear scaling: the numpy reference and the exported graph against
    transformers' own forward, over positions past the original context; the same weights without the scaling
    are the negative control."""
    import torch

    from edge.runner import GraphSession
    from export import reference
    from export.pipeline import export_model

    d = tmp_path / "ck"
    model = build_checkpoint(d, "llama", layers=2, **({} if legacy else {"rope_scaling": scaling}))
    if legacy:
        _legacy(d, scaling)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ck = load_hf_dir(d)
    assert ck.config.rope_factors and len(ck.config.rope_factors) == ck.config.head_dim // 2
    ids = [int(t) for t in np.random.default_rng(0).integers(3, VOCAB, 120)]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(reference.forward(ck, ids), ref, atol=2e-4, rtol=0)
    m = export_model(d, tmp_path / "out", tiny_export_options(drafters=(), parity=False), progress=False)
    sess = GraphSession(str(tmp_path / "out" / m.target.file), m, m.target, 128)
    np.testing.assert_allclose(sess.forward(ids, keep=len(ids)), ref, atol=2e-4, rtol=0)
    assert m.arch["rope_factors"] == list(ck.config.rope_factors)
    plain = build_checkpoint(tmp_path / "plain", "llama", layers=2)  # same weights, no scaling
    with torch.no_grad():
        assert np.abs(plain(torch.tensor([ids])).logits[0].numpy() - ref).max() > 1e-2


def test_rope_variants_that_equal_plain_rope_inside_the_export_load(tmp_path):
    """Dynamic NTK scaling only changes positions past max_position_embeddings, which the export never reaches;
    newer transformers' `rope_parameters` carry rope_theta (and a scaling we refuse like the old key)."""
    d = tmp_path / "ck"
    build_checkpoint(d, "llama", layers=1)
    _legacy(d, {"type": "dynamic", "factor": 2.0})
    assert load_hf_dir(d).config.max_positions == 512
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rope_scaling"], cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_hf_dir(d).config.rope_theta == 500000.0
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope scaling"):
        load_hf_dir(d)
    cfg["rope_parameters"] = {**LLAMA3, "rope_theta": 500000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    c = load_hf_dir(d).config
    assert c.rope_theta == 500000.0 and len(c.rope_factors) == c.head_dim // 2


def test_only_the_transformers_weights_are_read(tmp_path):
    """Mistral's repos ship consolidated.safetensors (native tensor names) beside the HF weights; a sharded
    checkpoint's index names its files."""
    from safetensors.numpy import save_file

    d = tmp_path / "ck"
    build_checkpoint(d, "llama", layers=1)
    want = set(load_hf_dir(d).weights)
    save_file({"layers.0.attention.wq.weight": np.ones((4, 4), np.float32)}, str(d / "consolidated.safetensors"))
    assert set(load_hf_dir(d).weights) == want
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    assert set(load_hf_dir(d).weights) == want  # transformers' order: model.safetensors before a (stale) index
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00001-of-00001.safetensors" for n in want}}))
    assert set(load_hf_dir(d).weights) == want
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002.safetensors"):
        load_hf_dir(d)


def test_a_config_without_architectures_uses_its_model_type(tmp_path):
    d = tmp_path / "ck"
    build_checkpoint(d, "llama", layers=1)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["architectures"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_hf_dir(d).config.family == "llama"


@pytest.mark.parametrize("family,config", [
    ("mistral", {"sliding_window": 32}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0}),
])
def test_sliding_window_exports_are_capped_at_the_window_and_exact_there(tmp_path, family, config):
    import torch

    from edge.runner import GraphSession
    from export.pipeline import export_model

    d = tmp_path / "ck"
    model = build_checkpoint(d, family, layers=2, **config)
    m = export_model(d, tmp_path / "out", tiny_export_options(drafters=(), parity=False), progress=False)
    assert m.target.max_len == 32 and m.arch["max_positions"] == 32
    ids = [int(t) for t in np.random.default_rng(0).integers(3, VOCAB, 32)]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    sess = GraphSession(str(tmp_path / "out" / m.target.file), m, m.target, 32)
    got = sess.forward(ids, keep=len(ids))
    np.testing.assert_allclose(got, ref, atol=2e-4, rtol=0)
    # the negative control: past the window, the checkpoint is another function of the tokens than the same
    # weights with full attention (what an uncapped export computes)
    full = build_checkpoint(tmp_path / "full", family, layers=2)
    longer = [int(t) for t in np.random.default_rng(1).integers(3, VOCAB, 48)]
    with torch.no_grad():
        assert np.array_equal(full(torch.tensor([ids])).logits[0].numpy(), ref)  # same weights
        windowed = model(torch.tensor([longer])).logits[0, -1].numpy()
        unwindowed = full(torch.tensor([longer])).logits[0, -1].numpy()
    assert np.abs(windowed - unwindowed).max() > 1e-2


@pytest.mark.parametrize("edit,tensor", [
    ({"num_key_value_heads": 1}, "k_proj.weight"),  # weights for 2 KV heads
    ({"vocab_size": VOCAB + 16}, "embed_tokens.weight"),  # used to export "fine" and fail at the first generate
    ({"intermediate_size": 96}, "gate_proj.weight"),
    ({"head_dim": 32}, "q_proj.weight"),  # a config that gained (or, for Mistral-Nemo-like models, lost) head_dim
    ({"num_attention_heads": 8, "num_key_value_heads": 4}, "q_proj.weight"),
])
def test_a_config_that_does_not_describe_its_weights_is_refused(tmp_path, edit, tensor):
    """As transformers refuses it ("size mismatch"): one line naming the tensor, its shape and the config's, instead
    of an ONNX Runtime error mid-export or an export that cannot run."""
    build_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(CheckpointError, match=rf"{tensor} has shape \[\d+, \d+\] but the config .* implies"):
        load_hf_dir(tmp_path)


def test_a_short_model_context_is_named_when_calibration_does_not_fit(tmp_path):
    """The cap came from the model (max_position_embeddings 64), not from --max-len; the advice used to be
    "use --max-len 256 or more", which changes nothing."""
    from export.pipeline import export_model

    build_checkpoint(tmp_path / "ck", "llama")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match=r"model's context of 64 positions .* use --calib-tokens 48 or fewer$"):
        export_model(tmp_path / "ck", tmp_path / "out", tiny_export_options(calib_new_tokens=64), progress=False)
