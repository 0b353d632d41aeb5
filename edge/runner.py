"""One ONNX Runtime session over an exported graph, with its KV cache bound once through IOBinding.

Per call only the small inputs change (ids, positions, bias, logits_keep); the 2·layers KV buffers are bound once
as both past and present, so ONNX Runtime writes new K/V in place and nothing of the cache crosses numpy.
"""
from __future__ import annotations

import numpy as np

from .kv import KVCache
from .manifest import GraphEntry, Manifest

NEG = np.finfo(np.float32).min


def session_options(threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return so


class GraphSession:
    def __init__(self, path: str, manifest: Manifest, graph: GraphEntry, capacity: int, threads: int = 2,
                 providers=("CPUExecutionProvider",), max_call: int = 256):
        import onnxruntime as ort

        self.ort = ort
        self.sess = ort.InferenceSession(path, session_options(threads), providers=list(providers))
        a = manifest.arch
        self.layers, self.vocab = graph.layers, graph.vocab
        dtype = np.float16 if graph.kv_dtype == "float16" else np.float32
        if capacity > graph.max_len:
            raise ValueError(f"context {capacity} exceeds what {graph.file} was exported for ({graph.max_len})")
        self.cache = KVCache(graph.layers, a["kv_heads"], a["head_dim"], capacity, dtype)
        self.max_call = max_call
        self._zeros = np.zeros(capacity + max_call, np.float32)  # bias row for a single query: sees everything
        self._tri = np.where(np.tril(np.ones((max_call, max_call), bool)), 0, NEG).astype(np.float32)
        self._logits = np.zeros((1, 1, graph.vocab), np.float32)  # grown on demand to the widest call seen
        self._keep = np.zeros(1, np.int64)
        self.calls = 0
        self.min_call = 1
        b = self.sess.io_binding()
        self._kv_values = []
        for i in range(graph.layers):
            for j, kind in enumerate(("key", "value")):
                v = ort.OrtValue.ortvalue_from_numpy(self.cache.layer(i, j))
                self._kv_values.append(v)  # keep alive: the binding only holds a pointer
                b.bind_ortvalue_input(f"past_key_values.{i}.{kind}", v)
                b.bind_ortvalue_output(f"present.{i}.{kind}", v)
        self.binding = b
        self.min_call = self._probe_min_call()

    def _probe_min_call(self) -> int:
        """Lossless speculation needs a token's logits not to depend on how many tokens share its call. Some
        kernels (MatMulNBits with int8 activations) take a different path for a single row; if a 1-token call
        disagrees with the same token inside a 2-token call, every call is padded to at least 2 rows."""
        if self.cache.capacity < 8:
            return 1
        ids = [1, 2, 3]
        self.forward(ids[:2])
        self.cache.append(2)
        one = self.forward(ids[2:]).copy()
        two = self.forward(ids[2:] + [0])[0].copy()
        self.cache.trim(2)
        return 1 if np.array_equal(one, two) else 2
    def causal_bias(self, s: int) -> np.ndarray:
        """[1, 1, S, length + S]: the committed prefix plus a causal block for the S new tokens."""
        t = self.cache.length + s
        if s == 1:
            return self._zeros[:t].reshape(1, 1, 1, t)
        bias = np.zeros((1, 1, s, t), np.float32)
        if s <= self._tri.shape[0]:
            bias[0, 0, :, t - s :] = self._tri[:s, :s]
        else:
            bias[0, 0, :, t - s :] = np.where(np.tril(np.ones((s, s), bool)), 0, NEG)
        return bias

    def forward(self, tokens, positions=None, bias=None, keep: int = 0) -> np.ndarray:
        """Run S tokens after the committed prefix; their K/V land in slots [length, length+S) uncommitted.
        Returns logits [R, V] (R = S, or `keep` last rows) — a view valid until the next call."""
        ids = np.asarray(tokens, np.int64).reshape(1, -1)
        s = ids.shape[1]
        if s < self.min_call:
            return self._forward_padded(ids, positions, bias, keep)
        if s > self.max_call and keep == 0:
            raise ValueError(f"{s} tokens in one call with all logits kept (max {self.max_call})")
        self.cache.check_room(s)
        if positions is None:
            positions = np.arange(self.cache.length, self.cache.length + s, dtype=np.int64)
        if bias is None:
            bias = self.causal_bias(s)
        assert bias.shape == (1, 1, s, self.cache.length + s), (bias.shape, s, self.cache.length)
        r = s if keep == 0 else min(keep, s)
        self._keep[0] = keep
        b = self.binding
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("position_ids", np.asarray(positions, np.int64).reshape(1, -1))
        b.bind_cpu_input("attention_bias", np.ascontiguousarray(bias, np.float32))
        b.bind_cpu_input("logits_keep", self._keep)
        if r > self._logits.shape[1]:
            self._logits = np.zeros((1, r, self.vocab), np.float32)
        out = self._logits[:, :r]
        b.bind_ortvalue_output("logits", self.ort.OrtValue.ortvalue_from_numpy(out))
        self.sess.run_with_iobinding(b)
        self.calls += 1
        return out[0]

    def _forward_padded(self, ids, positions, bias, keep) -> np.ndarray:
        """A 1-token call as the first row of a 2-row call; the pad row sees only itself, its K/V lands in a
        slot past the committed length (never visible) and its logits are dropped."""
        t = self.cache.length + 2
        self.cache.check_room(2)
        pos = np.arange(self.cache.length, t, dtype=np.int64) if positions is None else \
            np.append(np.asarray(positions, np.int64).reshape(-1), 0)
        b2 = np.full((1, 1, 2, t), NEG, np.float32)
        b2[0, 0, 0, : t - 1] = 0 if bias is None else np.asarray(bias, np.float32).reshape(-1)
        b2[0, 0, 1, t - 1] = 0
        return self.forward(np.append(ids.reshape(-1), ids[0, 0]), pos, b2, keep=0)[:1]

    def prefill(self, tokens, chunk: int = 512) -> np.ndarray:
        """Commit `tokens` in chunks (bounded activation memory); logits [V] of the last one."""
        tokens = list(tokens)
        last = None
        for i in range(0, len(tokens), chunk):
            part = tokens[i : i + chunk]
            last = self.forward(part, keep=1)[-1]
            self.cache.append(len(part))
        return last
