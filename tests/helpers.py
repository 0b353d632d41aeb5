"""Plain helpers shared by several test files (fixtures live in conftest.py): a command-line tool run as a user runs
it, requests to a server on loopback and its event streams, the target's exact distribution over its first sampled
tokens and the speculative counts to compare with it, the embedded SmolLM2-135M export's manifest numbers and the
expected accepted length of a chain for the memory tests, and `edge-serve` started as a user starts it."""
from __future__ import annotations

import copy
import math
import os
import subprocess
import sys

import numpy as np

from edge.manifest import Manifest


def run_module(args, stdin=None, timeout=240, env=None) -> subprocess.CompletedProcess:
    """`python -m ARGS` in a subprocess, offline, its output captured as text; `env` adds to this process's."""
    return subprocess.run([sys.executable, "-m", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


# ----------------------------------------------------------------------------- a server on loopback

def http_send(port, body, method="POST", path="/v1/chat/completions"):
    """A request (`body` as JSON) to a server on loopback → the open http.client connection, to read or drop."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
    return conn


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_edge_serve(model_dir, *args, stdout=subprocess.PIPE, preexec_fn=None, timeout: float = 120.0):
    """`edge-serve --model-dir DIR --port P ARGS` in a child process, offline, its output to `stdout` (a pipe, or
    an open log file) → (process, port) once GET /health answers 200. A child that exits first, or a server that
    does not answer within `timeout` s, is an AssertionError (with the child's output when it was piped)."""
    import time
    from pathlib import Path

    script = Path(sys.executable).with_name("edge-serve")
    assert script.exists(), "edge-serve console script missing: pip install -e ."
    port = free_port()
    proc = subprocess.Popen([str(script), "--model-dir", str(model_dir), "--port", str(port), *map(str, args)],
                            stdout=stdout, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec_fn,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout is not None else ""
            raise AssertionError(f"edge-serve exited {proc.returncode}: {out}")
        try:
            if http_call(port, None, "GET", "/health")[0] == 200:
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("edge-serve did not answer /health in time")


def http_call(port, body, method="POST", path="/v1/chat/completions"):
    """A request to a server on loopback → (status, headers, raw body)."""
    conn = http_send(port, body, method, path)
    try:
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def sse_events(raw: bytes) -> list:
    """An SSE body → its `data:` payloads (JSON objects, or the string "[DONE]"), each event on its own."""
    import json

    assert raw.endswith(b"\n\n")
    out = []
    for ev in raw[:-2].split(b"\n\n"):
        assert ev.startswith(b"data: ") and b"\n" not in ev, ev
        data = ev[len(b"data: "):]
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


# ----------------------------------------------------------------------------- sampling through the engine

def exact_first_tokens(engine, prompt, n: int, **sampling) -> dict[tuple[int, ...], float]:
    """The target's exact distribution over its first n sampled tokens: every prefix prefilled afresh, its last
    logits through the same temperature/top-k/top-p processing. Leaves the engine reset."""
    from kernels.sampling import process_logits

    ids = engine.encode(prompt)
    dist = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in dist.items():
            engine.reset()
            p = process_logits(engine.target.prefill(ids + list(prefix)).astype(np.float64), **sampling)
            for t in np.flatnonzero(p):
                nxt[prefix + (int(t),)] = pr * float(p[t])
        dist = nxt
    engine.reset()
    return dist


def speculative_first_tokens(engine, prompt, n_samples: int, drafter: str, seeded: bool = True, **sampling):
    """Counts of the first three tokens of `n_samples` speculative answers of four tokens (one token from the
    prefill, then a step that drafts two), and the drafted/accepted totals. Unseeded, a model drafter samples its
    drafts from q (seeded, it drafts its argmax)."""
    from collections import Counter

    counts, drafted, accepted = Counter(), 0, 0
    for i in range(n_samples):
        r = engine.generate(prompt, max_tokens=4, seed=5000 + i if seeded else None, drafter=drafter, draft_len=2,
                            **sampling)
        counts[tuple(r.token_ids[:3])] += 1
        drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
    return counts, drafted, accepted


def check_against(dist, counts):
    from distribution import compare_to_distribution

    keys = sorted(set(dist) | set(counts))  # an outcome the target cannot produce fails the check outright
    return compare_to_distribution(np.array([counts[k] for k in keys]), np.array([dist.get(k, 0.0) for k in keys]))


# ----------------------------------------------------------------------------- the embedded SmolLM2-135M export

SMOLLM2 = {
    "format_version": 1, "name": "SmolLM2-135M-Instruct",
    "arch": {"family": "llama", "hidden": 576, "layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64,
             "intermediate": 1536, "vocab": 49152, "rope_theta": 100000.0, "max_positions": 8192,
             "tie_embeddings": True, "qkv_bias": False},
    "graphs": [
        {"role": "target", "name": "target", "file": "target/model.onnx", "layers": 30, "vocab": 49152,
         "precision": "int4", "block_size": 32, "accuracy_level": 4, "lm_head_bits": 8, "max_len": 8192,
         "kv_dtype": "float32", "weight_bytes": 216340933, "stats": {"latency_ms_s1": 29.458}},
        {"role": "drafter", "name": "drafter-l2-v8192", "file": "drafter-l2-v8192/model.onnx", "layers": 2,
         "vocab": 8192, "precision": "int4", "block_size": 32, "accuracy_level": 4, "lm_head_bits": 8,
         "max_len": 8192, "kv_dtype": "float32", "id_map": "drafter-l2-v8192/id_map.npy",
         "weight_bytes": 125353879, "stats": {"top1_agreement": 0.0258, "latency_ms_s1": 0.872}},
    ],
    "files": [], "tokenizer": "tokenizer.json", "chat_template": None,
    "special_tokens": {"bos": 1, "eos": [2], "pad": 2}, "source": {}, "converter": {},
}


def smollm2_manifest(**graph_overrides) -> Manifest:
    d = copy.deepcopy(SMOLLM2)
    for g in d["graphs"]:
        g.update(graph_overrides)
    return Manifest.from_dict(d)


# ----------------------------------------------------------------------------- expected accepted tokens

def chain_acc(rates, k, h=1.0):
    """E[accepted] of a K-token chain with per-depth acceptance `rates`: h · sum_d prod_{j<=d} a_j."""
    return h * sum(math.prod(rates[:d]) for d in range(1, k + 1))
