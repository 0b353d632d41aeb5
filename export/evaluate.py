"""Export-time measurements on freshly written graphs: parity against the numpy reference, the target's
next-token statistics for vocabulary trimming, drafter agreement and one-call latency.

Deliberately simple ONNX Runtime calls (numpy feeds, no shared buffers): this is measurement, not the runtime.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kernels.postprocess import HEAD_INPUTS, head_feeds
from edge.manifest import DEQUANTIZE_PAST

NEG = np.finfo(np.float32).min


def causal_bias(s: int, past: int = 0) -> np.ndarray:
    allow = np.tril(np.ones((s, s), bool))
    return np.concatenate([np.zeros((s, past), np.float32), np.where(allow, 0, NEG).astype(np.float32)], 1)[None, None]


class GraphRunner:
    def __init__(self, path: str, layers: int, kv_heads: int, head_dim: int, threads: int = 2,
                 kv_dtype=None):
        import onnxruntime as ort

        from edge.runner import session_options

        # the runtime's options: latencies measured here price the runtime's calls
        self.sess = ort.InferenceSession(path, session_options(threads), providers=["CPUExecutionProvider"])
        types = {i.name: i.type for i in self.sess.get_inputs()}
        if kv_dtype is None:  # the graph's own: an fp16 graph keeps an fp16 cache, an int8-cache graph int8 codes
            kv_dtype = {"tensor(float16)": np.float16, "tensor(int8)": np.int8}.get(
                types.get("past_key_values.0.key"), np.float32)
        self.layers, self.kv_heads, self.head_dim, self.kv_dtype = layers, kv_heads, head_dim, kv_dtype
        names = set(types)
        # what every call feeds alike: the on-graph head's cheapest call (logits only), and an int8 cache's
        # quantized kernel (what every decode and verify call computes)
        self._fixed = head_feeds(1) if set(HEAD_INPUTS) <= names else {}
        if DEQUANTIZE_PAST in names:
            self._fixed[DEQUANTIZE_PAST] = np.zeros((), bool)

    def _feeds(self, ids, pos, bias, past, keep=0):
        f = {"input_ids": np.asarray(ids, np.int64)[None], "position_ids": np.asarray(pos, np.int64)[None],
             "attention_bias": bias, "logits_keep": np.array([keep], np.int64), **self._fixed}
        for i in range(self.layers):
            f[f"past_key_values.{i}.key"], f[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
        return f

    def _empty(self):
        return [np.zeros((1, self.kv_heads, 0, self.head_dim), self.kv_dtype) for _ in range(2 * self.layers)]

    def logits(self, ids) -> np.ndarray:
        """ids [S] → logits [S, V], one call from an empty cache."""
        s = len(ids)
        return self.sess.run(["logits"], self._feeds(ids, np.arange(s), causal_bias(s), self._empty()))[0][0]

    def present(self, ids) -> list[np.ndarray]:
        """The K/V a call over ids [S] from an empty cache writes: 2 per layer, each [1, kv_heads, ≥ S, head_dim]
        (a graph with a pad query row adds its slot after them)."""
        s = len(ids)
        names = [f"present.{i}.{k}" for i in range(self.layers) for k in ("key", "value")]
        return self.sess.run(names, self._feeds(ids, np.arange(s), causal_bias(s), self._empty(), keep=1))

    def greedy(self, ids, n: int, stop: tuple[int, ...] = ()) -> list[int]:
        """Greedy continuation (present fed back as past): calibration text, not the runtime loop."""
        names = ["logits"] + [f"present.{i}.{k}" for i in range(self.layers) for k in ("key", "value")]
        s = len(ids)
        out = self.sess.run(names, self._feeds(ids, np.arange(s), causal_bias(s), self._empty(), keep=1))
        gen = []
        for _ in range(n):
            tok = int(out[0][0, -1].argmax())
            gen.append(tok)
            if tok in stop:
                break
            t = s + len(gen)
            # the t - 1 tokens so far; a graph with a pad query row (export/graph.py) returns its slot after them
            past = [p[:, :, : t - 1] for p in out[1:]]
            out = self.sess.run(names, self._feeds([tok], [t - 1], np.zeros((1, 1, 1, t), np.float32), past))
        return gen

    def latency_ms(self, s: int = 1, past: int = 128, reps: int = 20) -> float:
        """Median wall time of one call with S new tokens over `past` cached ones."""
        cache = [np.zeros((1, self.kv_heads, past, self.head_dim), self.kv_dtype) for _ in range(2 * self.layers)]
        f = self._feeds(np.zeros(s, np.int64), past + np.arange(s), causal_bias(s, past), cache)
        self.sess.run(["logits"], f)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            self.sess.run(["logits"], f)
            ts.append(time.perf_counter() - t)
        return 1000 * float(np.median(ts))


PARITY_TOP = 64  # max |Δlogit| is taken over each position's best tokens under the reference


@dataclass(frozen=True)
class ReferenceTop:
    """A reference forward kept as what parity reads: each position's `PARITY_TOP` best token ids and their logits,
    best first (ties: lower id first, as argmax). [S, k] each, instead of [S, vocab] floats (262,144-token
    vocabularies make the whole logits hundreds of MB per prompt)."""
    ids: np.ndarray
    logits: np.ndarray


def reference_top(logits: np.ndarray, k: int = PARITY_TOP) -> ReferenceTop:
    k = min(k, logits.shape[-1])
    part = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logits, part, -1)
    order = np.lexsort((part, -vals), axis=-1)
    ids = np.take_along_axis(part, order, -1)
    return ReferenceTop(ids, np.take_along_axis(logits, ids, -1))


def parity(reference: list, exported_logits: list[np.ndarray]) -> dict:
    """Top-1 agreement over all positions of all prompts, and max |Δlogit| over each position's `PARITY_TOP` best
    tokens under the reference: the tokens any decision reads (a two-stage head leaves the far tail coarse by
    design). `reference`: full logits [S, V] or their `reference_top`."""
    refs = [r if isinstance(r, ReferenceTop) else reference_top(r) for r in reference]
    diff = max(float(np.abs(np.take_along_axis(b, r.ids, -1) - r.logits).max()) for r, b in zip(refs, exported_logits))
    agree = np.concatenate([r.ids[:, 0] == b.argmax(-1) for r, b in zip(refs, exported_logits)])
    return {"max_abs_diff": round(diff, 6), "top1_agreement": round(float(agree.mean()), 4), "positions": int(agree.size)}


def rank_vocabulary(token_lists: list[list[int]], vocab: int, always: tuple[int, ...] = (),
                    mass: np.ndarray | None = None) -> np.ndarray:
    """Target ids ordered by how often the target produced them plus `mass` (the probability it gave each id,
    summed over positions: a soft count that also ranks the ids it never produced); ties: lower id first;
    `always` ids first."""
    counts = np.zeros(vocab, np.float64)
    for toks in token_lists:
        np.add.at(counts, np.asarray(toks, np.int64), 1)
    if mass is not None:
        counts += mass
    order = np.lexsort((np.arange(vocab), -counts))
    head = list(dict.fromkeys(t for t in always if 0 <= t < vocab))  # bos may equal eos
    return np.concatenate([np.asarray(head, np.int64), order[~np.isin(order, head)]])
