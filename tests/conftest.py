"""Shared fixtures: tiny random checkpoints built here (no downloads), one fp32 export of the tiny llama for the
session, engines and copies of that export, and the shared-buffer session and live server the graph and server tests
drive.

Weights are re-drawn at O(1) scale (not transformers' 0.02 init) so logits spread over several units and top-1
comparisons mean something; norms and biases are random too, so a dropped norm weight or bias shows up.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest

from kernels.postprocess import HEAD_INPUTS, head_feeds
from edge.manifest import DEQUANTIZE_PAST

REPO = Path(__file__).resolve().parents[1]
VOCAB = 384  # 3 specials + 256 byte symbols + 125 merges
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_LEN = 256  # KV capacity of the session export
TINY_EXPORT_DRAFTER = (1, 128)


# ----------------------------------------------------------------------------- builders (plain functions)

def build_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE trained on the calibration prompts: encodes any text, VOCAB ids, specials 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from export import calibration

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(calibration.PROMPTS * 3, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "bos_token": SPECIALS[BOS], "eos_token": SPECIALS[EOS],
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def _redraw(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or name == "lm_head.weight":  # logits std ≈ 2: top-1 not trivial
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
            else:  # Linear [out, in]
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def build_checkpoint(out_dir: Path, family: str = "llama", tie: bool = True, layers: int = 2, seed: int = 0,
                     dtype: str = "float32", hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                     intermediate: int = 128, vocab: int = VOCAB, **config):
    """A tiny random HF checkpoint directory (config, safetensors, tokenizer); returns the torch model (fp32).
    Every one shares the same tokenizer (a drafter checkpoint for another one only needs other dimensions).
    `family`: llama, qwen2, mistral or gemma3; `config`: more config keys (attention_bias, sliding_window, ...)."""
    import torch
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    out_dir.mkdir(parents=True, exist_ok=True)
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512, rope_theta=10000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=BOS, eos_token_id=EOS)
    kw.update(config)
    torch.manual_seed(seed)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**{"use_sliding_window": False, **kw})).eval()
    elif family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**{"head_dim": hidden // heads, "attn_implementation": "eager",
                                                      **kw})).eval()
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**kw)).eval()
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    _redraw(model, seed)
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.to(getattr(torch, dtype)).save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return model.float()


# ----------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ck") / "tiny-llama"
    build_checkpoint(d, "llama", tie=True, layers=3, seed=1)
    return d


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ck") / "tiny-qwen2"
    build_checkpoint(d, "qwen2", tie=True, layers=2, seed=2)
    return d


@pytest.fixture(scope="session")
def tiny_untied_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ck") / "tiny-untied"
    build_checkpoint(d, "llama", tie=False, layers=2, seed=3)
    return d


@pytest.fixture(scope="session")
def checkpoint_dirs(tiny_llama_dir, tiny_qwen2_dir, tiny_untied_dir) -> dict[str, Path]:
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "untied": tiny_untied_dir}


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    from export.checkpoint import load_hf_dir

    return load_hf_dir(tiny_llama_dir)


# ----------------------------------------------------------------------------- one export per session

def tiny_export_options(**kw):
    from export.pipeline import ExportOptions

    return ExportOptions(**{**dict(precision="fp32", drafters=(TINY_EXPORT_DRAFTER,), calib_new_tokens=8,
                                   max_len=MAX_LEN), **kw})


@pytest.fixture(scope="session")
def exported_llama(tmp_path_factory, tiny_llama_dir):
    """(model_dir, manifest) of the tiny llama exported in fp32 with one early-exit drafter (1 layer, 128 ids).
    Read-only: tests that modify a model directory copy it first."""
    from export.pipeline import export_model

    out = tmp_path_factory.mktemp("export") / "tiny-llama"
    m = export_model(tiny_llama_dir, out, tiny_export_options(), progress=False)
    return out, m


@pytest.fixture(scope="session")
def tiny_dir(exported_llama):
    """The session's tiny llama export directory (read-only)."""
    return exported_llama[0]


@pytest.fixture(scope="module")
def model(exported_llama) -> str:
    """The session export's directory as a command line takes it (read-only)."""
    return str(exported_llama[0])


def edit_export(model_dir: Path, chat_template: str | None | bool = False, bos_rule: bool = False) -> Path:
    """Change an export in place: its manifest's chat template (None: a base model; False: as it is), and with
    `bos_rule` its tokenizer's post-processor, which then puts BOS before a text as Gemma's and Llama 2's do (the
    manifest's record of the tokenizer file follows)."""
    from tokenizers import Tokenizer, processors

    from edge.manifest import MANIFEST_NAME, sha256_file

    m = json.loads((model_dir / MANIFEST_NAME).read_text())
    if chat_template is not False:
        m["chat_template"] = chat_template
    if bos_rule:
        path = model_dir / "tokenizer.json"
        tok = Tokenizer.from_file(str(path))
        bos = SPECIALS[BOS]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, BOS)])
        tok.save(str(path))
        for f in m["files"]:
            if f["path"] == "tokenizer.json":
                f["bytes"], f["sha256"] = path.stat().st_size, sha256_file(path)
    (model_dir / MANIFEST_NAME).write_text(json.dumps(m))
    return model_dir


@pytest.fixture(scope="session")
def base_model(tmp_path_factory, exported_llama) -> Path:
    """The session export as a base model: no chat template, and a tokenizer that puts BOS before a text (as Gemma
    3's does). Read-only."""
    d = tmp_path_factory.mktemp("export") / "tiny-base"
    shutil.copytree(exported_llama[0], d)
    return edit_export(d, chat_template=None, bos_rule=True)


@pytest.fixture
def model_copy(exported_llama, tmp_path) -> Path:
    """A private copy of the session export, free to damage."""
    out = tmp_path / "model"
    shutil.copytree(exported_llama[0], out)
    return out


# ----------------------------------------------------------------------------- engines on the session export

@pytest.fixture
def fresh(tiny_dir):
    """A new engine for this test alone (plain decoding by default, context 256): free to change its state."""
    import edge

    return edge.load(tiny_dir, drafter="none", context=256)


@pytest.fixture(scope="module")
def plain_reference(tiny_dir):
    """generate(messages, **kw) on an engine with an empty cache and drafter state: the lossless reference. One
    engine per test module (`plain_reference.engine`), reset before every answer."""
    import edge

    engine = edge.load(tiny_dir, drafter="none")

    def generate(messages, **kw):
        engine.reset()
        return engine.generate(messages, **{"drafter": "none", **kw})

    generate.engine = engine
    return generate


# ----------------------------------------------------------------------------- ORT with shared KV buffers

class SharedKV:
    """A bare IOBinding session over an exported graph: one [1, kv_heads, capacity, head_dim] buffer per layer
    and kind, bound as both past and present (what edge.runner does), written independently of edge/ so graph
    tests do not rely on the runtime."""

    def __init__(self, path, layers: int, kv_heads: int, head_dim: int, capacity: int):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        so.log_severity_level = 3
        self.ort = ort
        self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.sess.get_inputs()}
        self.path, self.layers, self.kv_heads, self.head_dim, self.capacity = path, layers, kv_heads, head_dim, capacity
        kv_type = {i.name: i.type for i in self.sess.get_inputs()}["past_key_values.0.key"]
        dtype = {"tensor(int8)": np.int8, "tensor(float16)": np.float16}.get(kv_type, np.float32)
        # + 1: the graph's pad query row writes one K/V slot past the call's tokens (export/graph.py)
        self.kv = np.zeros((layers, 2, 1, kv_heads, capacity + 1, head_dim), dtype)
        self._vals = [ort.OrtValue.ortvalue_from_numpy(self.kv[i, j]) for i in range(layers) for j in range(2)]

    def run(self, ids, positions, bias, keep: int = 0, dequantize: bool = False) -> np.ndarray:
        """ids [S], positions [S], bias [1, 1, S, T] → logits [R, V] (copied). `dequantize`: an int8-cache graph's
        attention path (its `dequantize_past` input; default the quantized kernel)."""
        b = self.sess.io_binding()
        if DEQUANTIZE_PAST in self.inputs:
            b.bind_cpu_input(DEQUANTIZE_PAST, np.array(dequantize))
        b.bind_cpu_input("input_ids", np.asarray(ids, np.int64).reshape(1, -1))
        b.bind_cpu_input("position_ids", np.asarray(positions, np.int64).reshape(1, -1))
        b.bind_cpu_input("attention_bias", np.ascontiguousarray(bias, np.float32))
        b.bind_cpu_input("logits_keep", np.array([keep], np.int64))
        if set(HEAD_INPUTS) <= self.inputs:  # the on-graph head: its cheapest call
            for name, arr in head_feeds(1).items():
                b.bind_cpu_input(name, arr)
        b.bind_output("logits")  # first: copy_outputs_to_cpu() lists outputs in binding order
        for i in range(self.layers):
            for j, kind in enumerate(("key", "value")):
                b.bind_ortvalue_input(f"past_key_values.{i}.{kind}", self._vals[2 * i + j])
                b.bind_ortvalue_output(f"present.{i}.{kind}", self._vals[2 * i + j])
        self.sess.run_with_iobinding(b)
        return b.copy_outputs_to_cpu()[0][0]

    def min_call(self) -> int:
        """The runtime's load-time probe (edge.runner.probe_min_call), run on this graph in a session of its own:
        1 where a lone row equals the same row inside a 2-row call on this host, else 2 (the runtime then pads
        every 1-token call to 2 rows). A property of the host, recorded, never assumed."""
        from edge.runner import probe_min_call

        return probe_min_call(SessionView(SharedKV(self.path, self.layers, self.kv_heads, self.head_dim,
                                               self.capacity)))

    def step(self, token: int, n: int, min_call: int) -> np.ndarray:
        """Logits [1, V] of `token` after `n` cached tokens, as the runtime computes a decode step: a 1-row call, or
        with min_call 2 the first row of [token, pad] (causal: the pad row changes nothing the first row sees)."""
        if min_call == 1:
            return self.run([token], [n], causal(1, n)).copy()
        return self.run([token, token], [n, n + 1], causal(2, n))[:1].copy()


class SessionView:
    """SharedKV behind the session interface edge.runner's probes and `logits_alone_and_together` use (forward,
    cache.append/trim/length); a call narrower than `min_call` is a decode step as the runtime makes it."""

    def __init__(self, sk: SharedKV, min_call: int = 1):
        self.sk, self.min_call, self.cache, self.length, self.capacity = sk, min_call, self, 0, sk.capacity

    def append(self, n: int, ids=None) -> None:
        self.length += n

    def trim(self, n: int) -> None:
        self.length -= n

    def forward(self, ids, keep: int = 0) -> np.ndarray:
        n = len(ids)
        if n < self.min_call:
            return self.sk.step(ids[0], self.length, self.min_call)
        return self.sk.run(ids, np.arange(self.length, self.length + n), causal(n, self.length), keep=keep)


def causal(s: int, past: int) -> np.ndarray:
    """Additive bias [1, 1, s, past + s]: all of the past, causal within the s new tokens."""
    neg = np.finfo(np.float32).min
    tri = np.where(np.tril(np.ones((s, s), bool)), 0, neg)
    return np.concatenate([np.zeros((s, past)), tri], 1)[None, None].astype(np.float32)


@pytest.fixture
def shared_kv():
    return SharedKV


@pytest.fixture
def child_exports(monkeypatch):
    """subprocess.run stood in for, for the exports edge.resolve_model starts in a child process: `.calls` holds
    each command, `.rc` is the exit status each returns (0 unless a test sets it)."""
    import subprocess

    def run(cmd, **kw):
        run.calls.append(cmd)
        return subprocess.CompletedProcess(cmd, run.rc)

    run.calls, run.rc = [], 0
    monkeypatch.setattr(subprocess, "run", run)
    return run


@pytest.fixture
def run_export_cli():
    """`python -m export.cli ARGS` in a subprocess from the repository root → CompletedProcess."""
    import subprocess
    import sys

    def run(*args, timeout: float = 120):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        return subprocess.run([sys.executable, "-m", "export.cli", *map(str, args)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)

    return run


def logits_alone_and_together(session, prompt_ids, seq) -> tuple[np.ndarray, np.ndarray]:
    """Logits of `seq` after `prompt_ids`, computed one call per token and in one call: the property lossless
    speculation rests on is that both agree. Leaves the session's cache empty."""
    s = session
    s.cache.trim(s.cache.length)
    s.forward(prompt_ids, keep=1)
    s.cache.append(len(prompt_ids))
    alone = []
    for t in seq:
        alone.append(s.forward([t]).copy())
        s.cache.append(1)
    s.cache.trim(len(seq))
    together = s.forward(seq).copy()
    s.cache.trim(s.cache.length)
    return np.concatenate(alone), together


@contextlib.contextmanager
def serving(engine, limits=None, **kw):
    """edge.server.app.create_app(engine, **kw) behind the server's own uvicorn configuration (its connection guard) on a
    free loopback port → (port, app). Logging is left to the root logger (caplog sees uvicorn's lines too). An engine
    that holds its answers (a `go` semaphore) is let go at the end, so the server can shut down."""
    import socket
    import threading
    import time

    import uvicorn

    from edge.server.app import ConnectionLimits, create_app, uvicorn_config

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(engine, **kw)
    app.state.connections = limits = limits or ConnectionLimits()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, limits, log_config=None, log_level="warning",
                                           timeout_graceful_shutdown=2))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert th.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1], app
    finally:
        server.should_exit = True
        for _ in range(100 if hasattr(engine, "go") else 0):
            engine.go.release()
        th.join(20)
        sock.close()
