"""One ONNX Runtime session over an exported graph, with its KV cache bound once through IOBinding.

Per call only the small inputs change (ids, positions, bias, logits_keep); the 2·layers KV buffers are bound once
as both past and present, so ONNX Runtime writes new K/V in place and nothing of the cache crosses numpy.
"""
from __future__ import annotations

import time
import warnings
from typing import NamedTuple, Protocol

import numpy as np

from kernels.postprocess import GREEDY_K, HEAD_INPUTS
from kernels.sampling import top_k_ids
from memory.footprint import MAX_CALL, PREFILL_CHUNK, WIDE_PREFILL_MIN

from .errors import EngineError
from .kv import KVCache, kv_numpy_dtype
from .manifest import DEQUANTIZE_PAST, GraphEntry, Manifest, ModelDirError, open_graph

NEG = np.finfo(np.float32).min
F32_TINY, F32_MAX = float(np.finfo(np.float32).smallest_subnormal), float(np.finfo(np.float32).max)
HEAD_TOPK_MAX = 256  # sampling with top_k up to this reads the head's k probabilities alone (exact: the cut is inside)
HEAD_TOPK_NUCLEUS = 64  # top-p without top-k: the head's k, enough for the nucleus of most rows (else the logits)
FLOAT = 1  # onnx.TensorProto.FLOAT: the element type of a tensor bound by pointer


DEFAULT_THREADS = 2  # ONNX Runtime threads per session when none are asked for (fewer on fewer cores)


def check_threads(threads: int | None) -> int:
    """The thread count a session runs with: `threads`, or DEFAULT_THREADS capped at the cores this process may
    use. More threads than cores is allowed but warned about: ONNX Runtime's threads then wait for each other every
    op. Measured on a 2-core Zen 5 VM (SmolLM2-135M, plain decoding): 135 tok/s at 2 threads, 61 at 3, 50 at 4."""
    from devices import usable_cores

    cores = usable_cores()
    if threads is None:
        return min(DEFAULT_THREADS, cores)
    if threads > cores:
        warnings.warn(f"{threads} threads on the {cores} cores this process may use: ONNX Runtime's threads would "
                      f"wait for each other (several times slower); use --threads {cores} (threads={cores}) or fewer",
                      RuntimeWarning, stacklevel=4)
    return threads


def session_options(threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ORT caches a memory pattern per set of input shapes, forever. Decoding never repeats a shape (the mask grows a
    # column per token), so the cache only grew: ~49 KB per token, as much as the KV cache's own 45 KB (SmolLM2-135M:
    # a 600-token answer grew RSS 30.7 MB with it, 5.3 MB without), memory no footprint model predicts
    so.enable_mem_pattern = False
    # a model drafter and the target take turns on the same cores, each with its own thread pool: threads that keep
    # spinning after their session's call ends take the cores from the other session's next call. Measured on Gemma
    # 3 270M's full-depth drafter (2-core Zen 5): its calls took 14-19 ms instead of 6-8 ms, and speculation ran
    # slower than plain decoding (46 against 70 tok/s) until spinning stopped at the end of each call (75-88 tok/s);
    # a lone session's decoding did not measurably change (66-79 tok/s either way)
    so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


class Output(NamedTuple):
    """What one call computed, each a view valid until the session's next call. logits [R, V] (None when not asked
    for on a graph with the on-graph TopK); top_ids [R, k] (graphs with the TopK output); top_probs [R, k]:
    softmax(logits / T) at top_ids for a sampling call through the head, else None; top_logits [R, k]: the logits at
    top_ids where the graph returns them (greedy checks they are finite). best and best_logits: top_ids[:, 0] and
    top_logits[:, 0] as Python lists, where the session reads them without numpy (a greedy step needs only these)."""
    logits: np.ndarray | None
    top_ids: np.ndarray | None = None
    top_probs: np.ndarray | None = None
    top_logits: np.ndarray | None = None
    best: list[int] | None = None
    best_logits: list[float] | None = None

    def head(self) -> "Output":
        """The first row of each array (a 1-token call run as the first row of a wider one)."""
        return Output(*(None if a is None else a[:1] for a in self))


class Session(Protocol):
    """What the engine and the drafters use of a session over a graph (GraphSession, OptimumSession)."""
    cache: KVCache
    vocab: int
    min_call: int  # narrowest call whose rows equal wider calls' (1, or 2 where a lone row is computed differently)
    topk: int  # candidates per row the graph returns (0: none)
    head: bool  # the on-graph sampling head is there
    chains_exact: bool  # a token's logits do not depend on how many tokens follow it in a call
    tree_exact: bool  # a tree call gives each token the logits of its own path
    run_s: float  # seconds inside ONNX Runtime so far

    def call(self, tokens, positions=None, bias=None, keep: int = 0, logits: bool = True,
             sample: tuple[float, int] | None = None) -> Output: ...

    def forward(self, tokens, positions=None, bias=None, keep: int = 0, prefill: bool = False) -> np.ndarray: ...

    def prefill(self, tokens, chunk: int = PREFILL_CHUNK, stop=None) -> np.ndarray | None: ...


SMALL_CALL = 64  # calls up to this width (decode, verify) reuse their input buffers and output bindings


class GraphSession:
    # a token's logits do not depend on the call's width (pad query row, export/graph.py; asserted by
    # tests/test_export_graph.py and the slow real-model test), so chains are exact
    chains_exact = True
    run_s = 0.0  # seconds inside ONNX Runtime over this session's life (the engine's Stats.ort_s reads it)

    def __init__(self, path: str, manifest: Manifest, graph: GraphEntry, capacity: int, threads: int = 2,
                 providers=("CPUExecutionProvider",), max_call: int = MAX_CALL):
        import onnxruntime as ort

        self.ort = ort
        self.sess = open_graph(path, manifest, graph, session_options(threads), providers)
        warn_int8_gemm(path, graph, providers)
        a = manifest.arch_of(graph)
        self.layers, self.vocab = graph.layers, graph.vocab
        dtype = kv_numpy_dtype(graph.kv_dtype)
        if capacity > graph.max_len:
            raise EngineError(f"context {capacity} exceeds what {graph.file} was exported for ({graph.max_len})")
        self.cache = KVCache(graph.layers, a["kv_heads"], a["head_dim"], capacity, dtype)
        self.max_call = max_call
        self._zeros = np.zeros(capacity + max_call, np.float32)  # bias row for a single query: sees everything
        self._tri = np.where(np.tril(np.ones((max_call, max_call), bool)), 0, NEG).astype(np.float32)
        self._logits = np.zeros(graph.vocab, np.float32)  # flat, grown on demand to the widest call seen
        self._keep = np.zeros(1, np.int64)
        # the values last written to the call's scalar inputs (logits_keep; the head's k, temperature, sampling):
        # each is written only when it changes, as every numpy write right after a call costs ~10 µs (cold caches)
        self._scalars: tuple = (0, None)
        # a 1-token call's bias (a prefix of `_zeros`) is bound by pointer through the binding's own C++ object:
        # ~35 µs less per decode step than binding a new numpy view (the public bind_input makes a device per call)
        self._cpu_device = (ort.OrtDevice.make("cpu", 0)._get_c_device()
                            if hasattr(ort.OrtDevice, "_get_c_device") else None)
        self._zeros_ptr = self._zeros.ctypes.data
        outs = {o.name: o for o in self.sess.get_outputs()}
        # the on-graph head (kernels/postprocess.py) takes k and the temperature per call; graphs before it (export
        # version 4) have a fixed-k TopK and no probabilities
        inputs = {i.name for i in self.sess.get_inputs()}
        self.head = set(HEAD_INPUTS) <= inputs
        if self.head:
            self.topk = min(GREEDY_K, self.vocab)
        else:
            self.topk = int(outs["top_ids"].shape[-1]) if "top_ids" in outs else 0  # on-graph TopK, if exported
        self._top = np.zeros(max(1, self.topk), np.int64)  # flat: [1, R, k] views of any R, k stay contiguous
        self._top_probs = np.zeros(max(1, self.topk), np.float32)
        self._top_logits = np.zeros(max(1, self.topk), np.float32) if "top_logits" in outs else None
        self._head_k = np.array([self.topk], np.int64)
        self._temperature = np.ones(1, np.float32)
        self._sampling = np.zeros((), bool)
        # int8-cache graphs pick their attention path per call (export/graph.py): the quantized kernel, or, for a
        # wide prefill chunk, one dequantized copy of the cache (two bool scalars, bound by identity)
        self._dequantize = (np.zeros((), bool), np.ones((), bool))
        self.dequantizes = DEQUANTIZE_PAST in inputs
        self.min_call = 1
        self._kv_values = [ort.OrtValue.ortvalue_from_numpy(self.cache.layer(i, j))
                           for i in range(graph.layers) for j in range(2)]  # kept alive: bindings hold pointers
        # bindings with the KV cache bound once each: with logits, and (on-graph TopK) with top ids only; for calls
        # up to SMALL_CALL rows one pair per width (`_binding`). Bindings persist across runs, so every other input
        # and output is rebound only when the array behind it changes (`_bind`): decode-sized calls reuse one
        # ids/positions buffer per width and one output view per shape, written in place, and a draft length that
        # changes from step to step finds its width's buffers still bound (each rebinding costs ~10-30 µs).
        self._bound: dict[tuple[int, str], np.ndarray] = {}  # (binding, name) -> the array bound there
        # only on the CPU provider is a bound input read from its array at run time; other providers copy it to the
        # device when it is bound, so there every input is bound on every call
        self._reuse = all(p == "CPUExecutionProvider" for p in self.sess.get_providers())
        self._small: dict[int, tuple] = {}  # width -> input_ids and position_ids buffers, and int64 memoryviews of them
        self._views: dict[tuple, np.ndarray] = {}  # (output, rows, k) -> [1, rows, k] view of its buffer
        self._rows: dict[tuple, np.ndarray] = {}  # (output, rows, k) -> that view's [rows, k], what a call returns
        # (width, logits wanted) -> (rows, k, what `_outputs` bound) on that small call width's binding, kept until
        # an output buffer grows: a call shaped as the binding's last one binds nothing but its attention bias
        self._ready: dict[tuple, tuple] = {}
        self._bind_full = self._new_binding()
        self._bind_top = self._new_binding() if self.topk else self._bind_full
        self._by_width: dict[tuple[int, bool], object] = {}  # (width, logits wanted) -> its binding
        self.min_call = self._probe_min_call()
        # int8 activations (MatMulNBits accuracy_level 4, w8a8) amplify any change in attention summation order, so
        # a tree is never exact there even when one probe happens to agree; otherwise the probe decides
        self.tree_exact = not graph.int8_activations and self._probe_tree_exact()

    def _new_binding(self):
        b = self.sess.io_binding()
        for i in range(self.layers):
            for j, kind in enumerate(("key", "value")):
                b.bind_ortvalue_input(f"past_key_values.{i}.{kind}", self._kv_values[2 * i + j])
                b.bind_ortvalue_output(f"present.{i}.{kind}", self._kv_values[2 * i + j])
        return b

    def _rebind_kv(self, j: int, arr: np.ndarray) -> None:
        """KV array j (layer j // 2, K or V) was replaced by a larger one (`KVCache.reserve`): every binding
        takes the new one, and the old one is released."""
        value = self.ort.OrtValue.ortvalue_from_numpy(arr)
        self._kv_values[j] = value
        i, kind = divmod(j, 2)
        kind = ("key", "value")[kind]
        for b in {id(b): b for b in (self._bind_full, self._bind_top, *self._by_width.values())}.values():
            b.bind_ortvalue_input(f"past_key_values.{i}.{kind}", value)
            b.bind_ortvalue_output(f"present.{i}.{kind}", value)

    def _binding(self, s: int, want: bool):
        """The binding a call of width s uses: its own for small calls (created on first use), else the shared one."""
        if s > SMALL_CALL or not self._reuse:
            return self._bind_full if want else self._bind_top
        b = self._by_width.get((s, want))
        if b is None:  # (want is False only on graphs with the on-graph TopK)
            b = self._by_width[(s, want)] = self._new_binding()
        return b

    def _bind(self, b, name: str, arr: np.ndarray, output: bool = False) -> None:
        """Bind `arr` to input or output `name` of binding `b`, unless that very array is bound there already."""
        key = (id(b), name)
        if self._reuse and self._bound.get(key) is arr:
            return
        if output:
            b.bind_ortvalue_output(name, self.ort.OrtValue.ortvalue_from_numpy(arr))
        else:
            b.bind_cpu_input(name, arr)
        self._bound[key] = arr  # also keeps it alive while bound

    def _view(self, name: str, buf: np.ndarray, r: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The [1, r, k] view of flat output buffer `buf` and its [r, k] rows, one pair per shape (so `_bind` can
        skip rebinding and a call makes no new array). A buffer replaced by a larger one drops its views first
        (`_grown`)."""
        key = (name, r, k)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = buf[: r * k].reshape(1, r, k)
            self._rows[key] = v[0]
        return v, self._rows[key]

    def _grown(self, name: str, size: int, dtype) -> np.ndarray:
        """A new, larger flat buffer for output `name`; the views of the old one are dropped, not kept alive, and
        every binding's outputs are bound again on its next call."""
        for key in [key for key in self._views if key[0] == name]:
            del self._views[key], self._rows[key]
        self._ready.clear()
        return np.zeros(size, dtype)

    def _outputs(self, b, want: bool, r: int, k: int) -> tuple:
        """Bind on binding `b` the outputs a call of `r` rows and `k` candidates writes, and the scalar inputs →
        (logits [r, V] or None, top_ids [r, k], top_probs [r, k], top_logits [r, k], memoryviews of the top ids'
        and top logits' flat buffers), each None where the graph has no such output."""
        self._bind(b, "logits_keep", self._keep)
        out = top_ids = probs = top_logits = ids_mem = logits_mem = None
        if want:
            if r * self.vocab > self._logits.size:
                self._logits = self._grown("logits", r * self.vocab, np.float32)
            view, out = self._view("logits", self._logits, r, self.vocab)
            self._bind(b, "logits", view, output=True)
        if self.topk:
            if r * k > self._top.size:
                self._top = self._grown("top_ids", r * k, np.int64)
            view, top_ids = self._view("top_ids", self._top, r, k)
            self._bind(b, "top_ids", view, output=True)
            ids_mem = memoryview(self._top)
            if self._top_logits is not None:
                if r * k > self._top_logits.size:
                    self._top_logits = self._grown("top_logits", r * k, np.float32)
                view, top_logits = self._view("top_logits", self._top_logits, r, k)
                self._bind(b, "top_logits", view, output=True)
                logits_mem = memoryview(self._top_logits)
            if self.head:
                for name, arr in zip(HEAD_INPUTS, (self._head_k, self._temperature, self._sampling)):
                    self._bind(b, name, arr)
                # bound for every call's shape: a binding left from an earlier call would have the wrong one
                if r * k > self._top_probs.size:
                    self._top_probs = self._grown("top_probs", r * k, np.float32)
                view, probs = self._view("top_probs", self._top_probs, r, k)
                self._bind(b, "top_probs", view, output=True)
        return out, top_ids, probs, top_logits, ids_mem, logits_mem

    def _probe_min_call(self) -> int:
        """Lossless speculation needs a token's logits not to depend on how many tokens share its call.
        GroupQueryAttention's single-query path sums in another order (~2e-7), which int8 activations amplify to
        ~1 logit. Graphs from this exporter never take that path (a pad query row, export/graph.py); for older
        graphs, if a 1-token call disagrees with the same token inside a 2-token call, every call is padded to at
        least 2 rows here."""
        return probe_min_call(self)

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

    def forward(self, tokens, positions=None, bias=None, keep: int = 0, prefill: bool = False) -> np.ndarray:
        """Logits [R, V] of a call (`call`): R = S, or the `keep` last rows."""
        return self.call(tokens, positions, bias, keep, prefill=prefill).logits

    def call(self, tokens, positions=None, bias=None, keep: int = 0, logits: bool = True,
             sample: tuple[float, int] | None = None, prefill: bool = False) -> Output:
        """Run S tokens after the committed prefix; their K/V land in slots [length, length+S) uncommitted.
        Returns what the call computed (`Output`, views valid until the next call): logits [R, V] (R = S, or the
        `keep` last rows), or None with logits=False on a graph with on-graph TopK; top_ids [R, topk]; with
        `sample` = (temperature, k) on a graph with the head, top_ids and top_probs [R, k] are the k best tokens
        and their probabilities at that temperature.

        `prefill`: a prompt chunk, which plain and speculative decoding run alike (never a call speculation
        verifies). On an int8-cache graph a chunk of at least WIDE_PREFILL_MIN rows then attends over one
        dequantized copy of the cache: faster, the same codes written, but its rows' results depend on the chunk."""
        # a list of ids stays a list until it is written into its call-width buffer (one numpy call, not two)
        ids = tokens if isinstance(tokens, list) else np.asarray(tokens, np.int64).reshape(-1)
        s = len(ids)
        if s < self.min_call:
            return self._call_padded(np.asarray(ids, np.int64).reshape(1, -1), positions, bias, logits, sample)
        if s > self.max_call and keep == 0:
            raise EngineError(f"{s} tokens in one call with all logits kept (max {self.max_call})")
        self.cache.check_room(s)
        L = self.cache.length
        if L + s > self.cache.slots:
            self.cache.reserve(L + s, self._rebind_kv)
        want = logits or not self.topk
        b = self._binding(s, want)
        if s <= SMALL_CALL:  # decode and verify widths: fixed buffers, filled in place
            bufs = self._small.get(s)
            if bufs is None:
                ids_buf, pos_buf = np.zeros((1, s), np.int64), np.zeros((1, s), np.int64)
                bufs = self._small[s] = (ids_buf, pos_buf, memoryview(ids_buf).cast("B").cast("q"),
                                         memoryview(pos_buf).cast("B").cast("q"))
            ids_buf, pos_buf, ids_mem, pos_mem = bufs
            # a few ids written through memoryviews: no numpy dispatch, which right after a call costs ~10-40 µs
            if isinstance(ids, list):
                for i, t in enumerate(ids):
                    ids_mem[i] = t
            else:
                ids_buf[0] = ids
            if positions is None:
                for i in range(s):
                    pos_mem[i] = L + i
            else:
                pos_buf[0] = np.asarray(positions, np.int64).reshape(-1)
            ids, positions = ids_buf, pos_buf
        else:
            ids = np.asarray(ids, np.int64).reshape(1, -1)
            positions = (np.arange(L, L + s, dtype=np.int64) if positions is None
                         else np.asarray(positions, np.int64)).reshape(1, -1)
        if bias is None and s == 1 and self._reuse and self._cpu_device is not None:
            # one query sees the whole prefix: [1, 1, 1, L + 1] zeros, bound by pointer (its shape changes every call)
            b._iobinding.bind_input("attention_bias", self._cpu_device, FLOAT, (1, 1, 1, L + 1), self._zeros_ptr)
        else:
            if bias is None:
                bias = self.causal_bias(s)
            assert bias.shape == (1, 1, s, L + s), (bias.shape, s, L)
            b.bind_cpu_input("attention_bias", np.ascontiguousarray(bias, np.float32))  # its shape changes every call
        r = s if keep == 0 else min(keep, s)
        sample = sample if self.head else None
        k = self.topk if sample is None else min(max(int(sample[1]), self.topk), self.vocab)
        # float32 on the graph: a temperature that would round to 0 (NaN rows) or overflow takes the nearest
        # representable one, whose softmax is the same limit process_logits computes
        scalars = (keep, None if not self.head else
                   (k, 1.0 if sample is None else min(max(sample[0], F32_TINY), F32_MAX), sample is not None))
        if scalars != self._scalars:
            self._keep[0] = keep
            if self.head:
                self._head_k[0], self._temperature[0], self._sampling[()] = scalars[1]
            self._scalars = scalars
        if self.dequantizes:
            self._bind(b, DEQUANTIZE_PAST, self._dequantize[prefill and self.wide_prefill(s)])
        small = s <= SMALL_CALL and self._reuse
        last = self._ready.get((s, want)) if small else None
        if last is not None and last[0] == r and last[1] == k:
            ready = last[2]
        else:
            self._bind(b, "input_ids", ids)
            self._bind(b, "position_ids", positions)
            ready = self._outputs(b, want, r, k)
            if small:
                self._ready[(s, want)] = (r, k, ready)
        t0 = time.perf_counter()
        try:
            self.sess.run_with_iobinding(b)
        finally:  # an interrupted call counts too
            self.run_s += time.perf_counter() - t0
        out, top_ids, probs, top_logits, ids_mem, logits_mem = ready
        n = r * k
        return Output(out, top_ids, None if sample is None else probs, top_logits,
                      None if ids_mem is None else ids_mem[0:n:k].tolist(),
                      None if logits_mem is None else logits_mem[0:n:k].tolist())

    def _probe_tree_exact(self, tol: float = 1e-3) -> bool:
        """Does a token verified inside a tree get the logits it gets on its own root-to-leaf path? With fp32
        activations yes (to ~1e-5); with int8 activations a 1e-7 change in attention summation order (masked
        siblings interleaved) flips activation rounding and logits move by ~0.5, so greedy trees would not be
        lossless and drafting falls back to chains."""
        if self.cache.capacity < 64:
            return True
        prefix = [(7 * i) % 97 + 3 for i in range(48)]  # long enough that attention sums span SIMD lanes
        self.forward(prefix)
        self.cache.append(len(prefix), prefix)
        L = self.cache.length
        # root 4 with children 5 and 6: node 2 (token 6) sits one slot right of where its path puts it
        bias = np.zeros((1, 1, 3, L + 3), np.float32)
        bias[0, 0, 0, L + 1 :] = NEG
        bias[0, 0, 1, L + 2] = NEG
        bias[0, 0, 2, L + 1] = NEG
        tree = self.forward([4, 5, 6], np.array([L, L + 1, L + 1]), bias)[2].copy()
        path = self.forward([4, 6])[1].copy()
        self.cache.trim(len(prefix))
        return float(np.abs(tree - path).max()) < tol

    def _call_padded(self, ids, positions, bias, logits=True, sample=None) -> Output:
        """A 1-token call as the first row of a 2-row call; the pad row sees only itself, its K/V lands in a
        slot past the committed length (never visible) and its logits are dropped."""
        t = self.cache.length + 2
        self.cache.check_room(2)
        pos = np.arange(self.cache.length, t, dtype=np.int64) if positions is None else \
            np.append(np.asarray(positions, np.int64).reshape(-1), 0)
        b2 = np.full((1, 1, 2, t), NEG, np.float32)
        b2[0, 0, 0, : t - 1] = 0 if bias is None else np.asarray(bias, np.float32).reshape(-1)
        b2[0, 0, 1, t - 1] = 0
        return self.call(np.append(ids.reshape(-1), ids[0, 0]), pos, b2, keep=0, logits=logits, sample=sample).head()

    def prefill(self, tokens, chunk: int = PREFILL_CHUNK, stop=None) -> np.ndarray | None:
        """Commit `tokens` in chunks (bounded activation memory); logits [V] of the last one. `stop()`, asked
        before each chunk, ends it early (None; the chunks done stay committed)."""
        tokens = list(tokens)
        last = None
        for i in range(0, len(tokens), chunk):
            if stop is not None and stop():
                return None
            part = tokens[i : i + chunk]
            last = self.forward(part, keep=1, prefill=True)[-1]
            self.cache.append(len(part), part, chunk=self.wide_prefill(len(part)))
        return last

    def wide_prefill(self, s: int) -> bool:
        """Does a prefill chunk of s rows attend over a dequantized copy of the cache (`call`)?"""
        return self.dequantizes and s >= WIDE_PREFILL_MIN


def warn_int8_gemm(path: str, graph: GraphEntry, providers=("CPUExecutionProvider",)) -> bool:
    """Warn (and return True) when a w8a8 graph with int8 weights runs on a CPU whose int8 GEMM saturates
    (`devices.int8_gemm_exact`): its answers stay deterministic and speculation stays exact, but its logits can be
    several units off the model's. Exports made on such a host store uint8 weights instead."""
    if graph.precision != "w8a8" or graph.w8a8_kernel != "u8s8" or "CPUExecutionProvider" not in providers[:1]:
        return False
    from devices import int8_gemm_exact

    if int8_gemm_exact():
        return False
    warnings.warn(f"{path}: this w8a8 export stores int8 weights, whose products this CPU's ONNX Runtime adds in "
                  "saturating 16-bit pairs (x86 without VNNI): its logits can be several units off the model's. "
                  "Re-export it on this machine (edge-export SOURCE -o DIR --force; the embedded default: edge-export "
                  "--default --force), which stores uint8 weights that are exact here", RuntimeWarning, stacklevel=3)
    return True


def probe_min_call(session) -> int:
    """1 if a token's logits in a 1-token call equal (bit for bit) its logits as the first row of a 2-token call,
    else 2 (the runtime then pads single-token calls)."""
    if session.cache.capacity < 8:
        return 1
    ids = [1, 2, 3]
    session.forward(ids[:2])
    session.cache.append(2, ids[:2])
    one = session.forward(ids[2:])[0].copy()  # [V]
    two = session.forward(ids[2:] + [0])[0].copy()  # [V]
    session.cache.trim(2)
    return 1 if np.array_equal(one, two) else 2


def decode_steps_exact(session, contexts=(2, 40, 300), widths=(2, 3, 5, 8)) -> bool:
    """Does a decode step (a 1-token call, padded to `session.min_call` rows as the runtime pads it) compute, bit for
    bit, what the same token gets as the first row of wider calls, after prefixes of several lengths? The exporter
    asks it of a graph without the pad query row: where it holds on this host, the row is not needed."""
    for n in contexts:
        if n + max(widths) > session.cache.capacity:
            continue
        prefix = [(11 * i) % 89 + 3 for i in range(n)]
        session.cache.trim(session.cache.length)
        session.prefill(prefix)
        one = session.forward([7])[0].copy()
        for w in widths:
            if not np.array_equal(one, session.forward([7] + [(5 * j) % 23 + 3 for j in range(w - 1)])[0]):
                session.cache.trim(session.cache.length)
                return False
    session.cache.trim(session.cache.length)
    return True


def width_independent(session, widths=(2, 3, 5, 8)) -> bool:
    """Do the logits of a token depend on how many draft tokens follow it in a causal verify call? Greedy chain
    speculation is lossless only if they do not (the first row of every width equals the narrowest call)."""
    if session.cache.capacity < 16 + max(widths):
        return True
    prefix = [(5 * i) % 31 + 3 for i in range(12)]
    session.prefill(prefix)
    rows = []
    for w in (session.min_call,) + tuple(widths):
        out = session.forward([4] + [(7 * j) % 29 + 3 for j in range(w - 1)])
        rows.append(out[0].copy())
    session.cache.trim(len(prefix))
    return all(np.array_equal(rows[0], r) for r in rows[1:])


class OptimumSession:
    """A graph exported by Hugging Face optimum (`edge-export --via optimum`): 2-D attention mask, past K/V as
    separate inputs of the committed length, present K/V outputs of length past + S. The general path for
    architectures export/graph.py does not build: plain decoding and chain verification (the graph is causal;
    it cannot verify a tree). Token Recycling's candidates come from a numpy top-k over the returned logits
    (~0.2 ms per row) instead of an on-graph TopK.

    The committed K/V lives in the same KVCache buffer as for our own graphs (so trim/keep/append are shared);
    each call copies the committed prefix out as contiguous past arrays and the S new slots back in — one copy
    of the cache per call, which the fast path avoids and this general path accepts."""

    run_s = 0.0  # seconds inside ONNX Runtime (`GraphSession.run_s`); the K/V copies around it count as Python

    topk = 8
    tree_exact = False
    head = False  # no on-graph head: sampling processes the logits

    def __init__(self, path: str, layers: int, kv_heads: int, head_dim: int, vocab: int, capacity: int,
                 threads: int = 2, providers=("CPUExecutionProvider",), max_len: int | None = None,
                 kv_dtype=np.float32, probe: bool = True, manifest: Manifest | None = None,
                 graph: GraphEntry | None = None):
        import onnxruntime as ort

        self.sess = (open_graph(path, manifest, graph, session_options(threads), providers) if graph is not None else
                     ort.InferenceSession(path, session_options(threads), providers=list(providers)))
        if max_len is not None and capacity > max_len:
            raise EngineError(f"context {capacity} exceeds what {path} was exported for ({max_len})")
        self.layers, self.vocab = layers, vocab
        self.inputs = {i.name for i in self.sess.get_inputs()}
        missing = {"input_ids", "past_key_values.0.key"} - self.inputs
        if missing:
            raise ModelDirError(f"{path}: not a text-generation-with-past graph (no {', '.join(sorted(missing))})")
        self.cache = KVCache(layers, kv_heads, head_dim, capacity, kv_dtype)
        self._names = ["logits"] + [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
        self.min_call = 1
        self.chains_exact = True
        if probe:
            self.min_call = probe_min_call(self)
            self.chains_exact = width_independent(self)

    @classmethod
    def from_manifest(cls, path: str, manifest: Manifest, graph: GraphEntry, capacity: int, threads: int = 2,
                      providers=("CPUExecutionProvider",)):
        a = manifest.arch
        dtype = kv_numpy_dtype(graph.kv_dtype)
        return cls(path, graph.layers, a["kv_heads"], a["head_dim"], graph.vocab, capacity, threads, providers,
                   max_len=graph.max_len or None, kv_dtype=dtype, manifest=manifest, graph=graph)

    def forward(self, tokens, positions=None, bias=None, keep: int = 0, prefill: bool = False) -> np.ndarray:
        return self.call(tokens, positions, bias, keep).logits

    def call(self, tokens, positions=None, bias=None, keep: int = 0, logits: bool = True, sample=None) -> Output:
        """As `GraphSession.call`; the logits always, top_ids from a numpy top-k over them (best first)."""
        ids = np.asarray(tokens, np.int64).reshape(1, -1)
        s = ids.shape[1]
        if bias is not None:
            raise EngineError("this graph (exported via optimum) has a 2-D causal mask and cannot verify a tree")
        if s < self.min_call:  # one dummy token after it: causal, so the first row does not see it
            if positions is not None:
                positions = np.append(np.asarray(positions, np.int64).reshape(-1), 0)
            return self.call(np.append(ids.reshape(-1), ids[0, 0]), positions, None, 0, logits).head()
        self.cache.check_room(s)
        L = self.cache.length
        self.cache.reserve(L + s)
        if positions is None:
            positions = np.arange(L, L + s, dtype=np.int64)
        feeds = {"input_ids": ids}
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = np.ones((1, L + s), np.int64)
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.asarray(positions, np.int64).reshape(1, -1)
        for i in range(self.layers):
            for j, kind in enumerate(("key", "value")):
                feeds[f"past_key_values.{i}.{kind}"] = np.ascontiguousarray(self.cache.layer(i, j)[:, :, :L])
        t0 = time.perf_counter()
        try:
            out = self.sess.run(self._names, feeds)
        finally:
            self.run_s += time.perf_counter() - t0
        for i in range(self.layers):
            for j in range(2):
                self.cache.layer(i, j)[:, :, L : L + s] = out[1 + 2 * i + j][:, :, L : L + s]
        r = s if keep == 0 else min(keep, s)
        rows = out[0][0, s - r :]
        return Output(rows, top_k_ids(rows, min(self.topk, self.vocab)))

    def prefill(self, tokens, chunk: int = PREFILL_CHUNK, stop=None) -> np.ndarray | None:
        return GraphSession.prefill(self, tokens, chunk, stop)

    def wide_prefill(self, s: int) -> bool:
        return False


def open_session(path: str, manifest: Manifest, graph: GraphEntry, capacity: int, threads: int = 2,
                 providers=("CPUExecutionProvider",)) -> Session:
    """The session class a graph entry needs: our own graph layout, or an optimum export."""
    if graph.io == "optimum":
        return OptimumSession.from_manifest(path, manifest, graph, capacity, threads, providers)
    return GraphSession(path, manifest, graph, capacity, threads, providers)
