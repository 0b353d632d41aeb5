"""GGUF input: a tiny GGUF written here with the `gguf` package the way llama.cpp's convert script writes one
(F32 tensors, q/k rows permuted for llama, metadata, a byte-level BPE tokenizer), read back by `load_gguf`."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import BOS, CHAT_TEMPLATE, EOS, VOCAB, tiny_export_options
from export import reference
from export.checkpoint import CheckpointError, load_checkpoint, load_gguf, load_hf_dir

HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (q/k rows → interleaved rotary layout)."""
    out, inp = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    mod, suffix = rest.rsplit(".", 1)
    return f"blk.{i}.{HF_TO_GGUF[mod]}.{suffix}"


def write_gguf(ck, tokenizer_dir, path, with_tokenizer: bool = True, skip=(), extra=None, rope_scaling=None,
               kv=None) -> None:
    """`extra`: more tensors by GGUF name; `rope_scaling`: a rope.scaling.type to record (factor 4); `kv`: more
    metadata, {key without the arch prefix: float or int}."""
    import gguf

    c = ck.config
    arch = c.family
    w = gguf.GGUFWriter(str(path), arch)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        w.add_rope_scaling_factor(4.0)
    for key, val in (kv or {}).items():
        (w.add_uint32 if isinstance(val, int) else w.add_float32)(f"{arch}.{key}", val)
    w.add_name("tiny")
    w.add_block_count(c.layers)
    w.add_context_length(c.max_positions)
    w.add_embedding_length(c.hidden)
    w.add_feed_forward_length(c.intermediate)
    w.add_head_count(c.heads)
    w.add_head_count_kv(c.kv_heads)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_vocab_size(c.vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if with_tokenizer:
        tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
        vocab = tj["model"]["vocab"]
        tokens = [None] * len(vocab)
        for t, i in vocab.items():
            tokens[i] = t
        special = {a["id"] for a in tj["added_tokens"] if a["special"]}
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                           for i in range(len(tokens))])
        w.add_token_merges(merges)
        w.add_bos_token_id(BOS)
        w.add_eos_token_id(EOS)
        w.add_unk_token_id(0)
        w.add_pad_token_id(EOS)
        w.add_add_bos_token(False)
        w.add_add_space_prefix(False)  # as llama.cpp writes for byte-level BPE (the SmolLM2 GGUF has it)
        w.add_chat_template(CHAT_TEMPLATE)
    for name, arr in ck.weights.items():
        if name in skip:
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = permute(arr, c.heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = permute(arr, c.kv_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(arr, np.float32))
    for name, arr in (extra or {}).items():
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["llama", "qwen2", "untied"])
def pair(request, checkpoint_dirs, tmp_path_factory):
    """(HF checkpoint, path of the same weights as GGUF)."""
    d = checkpoint_dirs[request.param]
    ck = load_hf_dir(d)
    p = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    write_gguf(ck, d, p)
    return ck, p


def test_permutation_is_not_the_identity(tiny_llama):
    w = tiny_llama.weights["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(permute(w, tiny_llama.config.heads), w)


def test_weights_recovered_exactly(pair):
    ck, path = pair
    g = load_gguf(path)
    assert g.source_format == "gguf"
    assert set(g.weights) == set(ck.weights)
    for name, want in ck.weights.items():
        np.testing.assert_array_equal(g.weights[name], want, err_msg=name)


def test_config_recovered(pair):
    ck, path = pair
    a, b = load_checkpoint(path).config, ck.config
    for field in ("family", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                  "rope_theta", "max_positions", "tie_embeddings", "qkv_bias", "bos_token_id", "eos_token_ids"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.rms_eps == pytest.approx(b.rms_eps, rel=1e-6)  # stored as float32


def test_gguf_reference_logits_equal_hf(pair):
    ck, path = pair
    ids = np.random.default_rng(0).integers(0, VOCAB, 20)
    # same weights bit for bit; only BLAS summation order (array layout) may differ
    np.testing.assert_allclose(reference.forward(load_gguf(path), ids), reference.forward(ck, ids), atol=1e-9, rtol=0)


def test_dir_with_one_gguf_loads_it(pair, tmp_path):
    ck, path = pair
    (tmp_path / path.name).symlink_to(path)
    assert load_checkpoint(tmp_path).source_format == "gguf"


@pytest.mark.parametrize("extra,scaling,needle", [
    ({"rope_freqs.weight": np.ones(5)}, None, "rope_freqs.weight has 5 entries"),  # head dim 16: 8 factors
    ({"blk.0.attn_output.bias": np.ones(64), "blk.0.attn_q.bias": np.ones(64)}, None, "does not implement"),
    ({"blk.0.attn_q_norm.weight": np.ones(16)}, None, "does not implement"),  # a kind we do not map
    ({}, "yarn", "rope scaling 'yarn'"),
    ({}, None, "partial rotary"),  # with rope.dimension_count 8 of head dim 16 (below)
])
def test_what_the_graph_would_not_compute_is_refused(tiny_llama, tiny_llama_dir, tmp_path, extra, scaling, needle):
    """A GGUF whose model needs more than our graph computes is refused, not exported with parts dropped (biases
    and unmapped tensors exported before, ~10 max |Δlogit| from transformers, with a perfect parity report)."""
    p = tmp_path / "variant.gguf"
    kv = {"rope.dimension_count": 8} if needle == "partial rotary" else None
    write_gguf(tiny_llama, tiny_llama_dir, p, with_tokenizer=False, extra=extra, rope_scaling=scaling, kv=kv)
    with pytest.raises(CheckpointError, match=needle):
        load_gguf(p)


def test_llama3_rope_factors_and_linear_scaling_read_as_llama_cpp_writes_them(tmp_path):
    """llama.cpp's convert writes Llama 3.x rope scaling as rope_freqs.weight (a divisor per frequency) and linear
    scaling as rope.scaling.type/factor; both give the HF checkpoint's own logits."""
    from conftest import build_checkpoint

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    d = tmp_path / "ck"
    build_checkpoint(d, "llama", layers=2, rope_scaling=scaling)
    ck = load_hf_dir(d)
    p = tmp_path / "llama3.gguf"
    unscaled = replace(ck, config=replace(ck.config, rope_factors=()))
    write_gguf(unscaled, d, p, with_tokenizer=False,
               extra={"rope_freqs.weight": np.asarray(ck.config.rope_factors, np.float32)})
    g = load_gguf(p)
    np.testing.assert_allclose(g.config.rope_factors, ck.config.rope_factors, rtol=1e-6)
    ids = np.random.default_rng(0).integers(0, VOCAB, 100)
    want = reference.forward(ck, ids)
    np.testing.assert_allclose(reference.forward(g, ids), want, atol=1e-4, rtol=0)
    assert np.abs(reference.forward(unscaled, ids) - want).max() > 1e-2  # the factors matter at these positions
    # linear: the HF checkpoint with {"rope_type": "linear", "factor": 4} (tested against transformers in
    # test_export_variants) is the reference; llama.cpp also reads a factor without a type, or under the legacy
    # rope.scale_linear key, as linear, and a factor of 0 as none
    lin = tmp_path / "lin"
    build_checkpoint(lin, "llama", layers=2, rope_scaling={"rope_type": "linear", "factor": 4.0})
    want = reference.forward(load_hf_dir(lin), ids)
    for i, (scaling, kv) in enumerate((("linear", None), (None, {"rope.scaling.factor": 4.0}),
                                       (None, {"rope.scale_linear": 4.0}))):
        p2 = tmp_path / f"linear{i}.gguf"
        write_gguf(unscaled, d, p2, with_tokenizer=False, rope_scaling=scaling, kv=kv)
        np.testing.assert_allclose(reference.forward(load_gguf(p2), ids), want, atol=1e-4, rtol=0)
    p3 = tmp_path / "zero.gguf"
    write_gguf(unscaled, d, p3, with_tokenizer=False, kv={"rope.scaling.factor": 0.0})
    assert load_gguf(p3).config.rope_factors == ()


def test_missing_tensor_and_metadata(tiny_llama, tiny_llama_dir, tmp_path):
    p = tmp_path / "no-norm.gguf"
    write_gguf(tiny_llama, tiny_llama_dir, p, with_tokenizer=False, skip=("model.layers.1.input_layernorm.weight",))
    with pytest.raises(CheckpointError, match="weights missing.*layers.1.input_layernorm"):
        load_gguf(p)
    p = tmp_path / "no-embed.gguf"
    write_gguf(tiny_llama, tiny_llama_dir, p, with_tokenizer=False, skip=("model.embed_tokens.weight",))
    with pytest.raises(CheckpointError, match="embed_tokens"):
        load_gguf(p)


def test_gguf_tokenizer_conversion(pair, tmp_path):
    """transformers' GGUF converter rebuilds a tokenizer.json that encodes like the original (no BOS added, since
    the GGUF says add_bos_token=False), with the chat template and special ids from the metadata."""
    from tokenizers import Tokenizer

    from conftest import SPECIALS
    from export.tokenizer import write_tokenizer

    ck, path = pair
    tf = write_tokenizer(load_gguf(path), tmp_path)
    assert (tf.bos, tf.eos, tf.pad, tf.chat_template) == (BOS, (EOS,), EOS, CHAT_TEMPLATE)
    src = Tokenizer.from_file(str(Path(ck.source) / "tokenizer.json"))
    got = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "Explain how a refrigerator keeps food cold. Ünïcode, 12345 and\ttabs!"
    chat = f"{SPECIALS[BOS]}user\n{text}{SPECIALS[EOS]}\n"
    for t in (text, chat, " leading space"):
        assert got.encode(t).ids == src.encode(t).ids, t
        assert got.decode(got.encode(t).ids, skip_special_tokens=False) == t


def test_export_from_gguf(tiny_llama, tiny_llama_dir, tmp_path):
    """End to end: GGUF → model directory; fp32 parity against the reference of the HF weights."""
    from edge.manifest import load_manifest
    from export.evaluate import GraphRunner
    from export.pipeline import export_model

    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama, tiny_llama_dir, path)
    m = export_model(path, tmp_path / "m", tiny_export_options(), progress=False)
    load_manifest(tmp_path / "m", verify="sha256")
    assert m.source["format"] == "gguf" and m.parity["top1_agreement"] == 1.0 and m.parity["max_abs_diff"] <= 1e-3
    assert m.chat_template == CHAT_TEMPLATE and m.special_tokens == {"bos": BOS, "eos": [EOS], "pad": EOS}
    c = tiny_llama.config
    ids = np.random.default_rng(1).integers(0, VOCAB, 30)
    got = GraphRunner(str(tmp_path / "m" / m.target.file), c.layers, c.kv_heads, c.head_dim).logits(ids)
    np.testing.assert_allclose(got, reference.forward(tiny_llama, ids), atol=1e-4, rtol=0)
