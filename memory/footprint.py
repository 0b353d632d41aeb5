"""The footprint model: the peak memory a plan needs, component by component, from manifest numbers and a few
calibrated constants. Pure arithmetic: no sessions, no files, no onnxruntime.

MB means 2**20 bytes throughout (what psutil's RSS / 2**20 and `top` show).

Components of `predict_peak` (each in bytes, named in `Footprint.parts`):

    baseline          Python + numpy + onnxruntime, before any session (calibrated constant)
    tokenizer         the loaded tokenizer, by its file (`tokenizer_bytes`)
    <g>.weights       resident weights of graph g (see `resident_weight_bytes`)
    <g>.session       ORT session bookkeeping: a + b·layers (calibrated)
    <g>.kv            2·layers·kv_heads·head_dim·elem per slot: context + the verify call's slots (or `capacity`)
    <g>.logits        the bound logits buffer, grown to the widest call: [rows, vocab] float32
    <g>.arena         ORT's activation arena, which keeps its high-water mark: max over the calls the plan makes
                      (prefill chunks and verify/draft calls) of a + b·S·hidden + c·R·vocab + e·S·T, plus the
                      coarse and rescored logits of a two-stage head
    runtime.bias      the largest attention-bias array the runtime builds for one call: [S, T] float32
    verify.work       sampling only: p [S, V] float32 and the model drafter's q [K, V] float64
    lookup.state      prompt-lookup history + n-gram index (bytes per context token)
    recycling.matrix  Token Recycling's adjacency matrix [V, k] (uint16 when V < 65536, else int32) + a [V] bool mask
    recycling.pairs   its two-token successor table: RECYCLING_PAIR_SLOTS keys (uint32 when V² fits, else uint64)
                      and ids (like the matrix's)

where <g> is `target` or `drafter` (a model drafter only), S the rows of a call, R the logits rows it keeps,
T = context + S the attention span.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

MB = 1 << 20
PAGE = 4096
DRAFTERS = ("none", "lookup", "recycling", "hybrid", "model")  # hybrid: lookup chains + recycling trees
PRECISIONS = ("fp32", "fp16", "int8", "int4", "w8a8")
QUANT_BITS = {"int4": 4, "int8": 8, "w8a8": 8}
# the two-stage LM head (export.graph `_Builder.rescored_head`): a coarse 4-bit head without zero points, and this
# many candidates per row scored again at 8 bits. Its blocks stay at 32: for blocks of 64 and 128 MatMulNBits'
# int8-activation kernels computed a lone row another way than the same row in wider calls (Zen 5, ORT 1.32)
COARSE_HEAD_BITS = 4
COARSE_HEAD_BLOCK = 32
HEAD_RESCORE = 16
TOKENIZER_RSS_PER_FILE_BYTE = 8.0
# edge.bpe's compact tables (written beside tokenizer.json for SentencePiece-style vocabularies), read in their place:
# the arrays are held as stored (measured: Gemma 3's 13.0 MB file, 12-13 MB of RSS)
TOKENIZER_TABLES = "tokenizer.bpe.npz"
TOKENIZER_TABLES_RSS_PER_FILE_BYTE = 1.0
# Element size of the float tensors (embedding, norms, rotary tables, scales, float matmuls): the exporter keeps
# fp32 floats for quantized bodies and switches everything to fp16 only for an fp16 export (export/graph.py).
FLOAT_BYTES = {"fp32": 4, "fp16": 2, "int8": 4, "int4": 4, "w8a8": 4}
# edge.drafters.LookupDrafter's own accounting: 8 B per history entry + ~120 B per n-gram index entry, up to
# (max_ngram - min_ngram + 1) = 4 new n-grams per token.
LOOKUP_BYTES_PER_TOKEN = 8 + 4 * 120
# one KV slot past capacity per graph (edge.kv.KVCache): scratch for the pad query row of a full cache
KV_SCRATCH_SLOTS = 1
RECYCLING_K = 8
RECYCLING_PAIR_SLOTS = 1 << 17  # Token Recycling's hashed two-token successor table (edge.drafters)


def recycling_bytes(vocab: int, k: int = RECYCLING_K) -> tuple[int, int]:
    """Token Recycling's fixed-size state (edge.drafters.RecyclingDrafter): (the matrix [V, k] of ids with its
    `seen` mask, one bool per token; the pair table: RECYCLING_PAIR_SLOTS keys and ids)."""
    elem = recycling_id_bytes(vocab)
    return vocab * k * elem + vocab, RECYCLING_PAIR_SLOTS * (recycling_pair_key_bytes(vocab) + elem)


def recycling_id_bytes(vocab: int) -> int:
    """Bytes per token id in Token Recycling's tables: uint16 while every id fits, else int32."""
    return 2 if vocab < 65536 else 4


def recycling_pair_key_bytes(vocab: int) -> int:
    """Bytes per key of that table: a pair (prev, tok) is keyed prev * vocab + tok, and the key type's maximum
    marks an empty slot, so uint32 while vocab² stays below it, else uint64."""
    return 4 if vocab * vocab < 2**32 - 1 else 8


# edge.runner.GraphSession: calls of up to 256 rows with all logits kept; a prefill chunk keeps one row. 256 rows a
# chunk: on a 2-core Zen 5 EPYC with the int8 KV cache, a 960-token prompt's peak RSS was 11 MB lower than with 512
# and its prefill no slower (642 against 538 tok/s for the first chunk's rows)
MAX_CALL = 256
PREFILL_CHUNK = 256
# prefill chunks of at least this many rows attend over one dequantized float copy of an int8 cache (export/graph.py);
# narrower ones (a short follow-up turn) take the quantized kernel, cheaper there than dequantizing the whole cache
WIDE_PREFILL_MIN = 16
# ONNX protobuf (graph structure, small inline constants) beside the external data: fitted to the two SmolLM2
# graphs of the embedded export (107,717 B for 30 layers, 8,855 B for 2).
PROTO_BYTES = (1_800, 3_530)  # base, per layer
# an int8 KV cache adds per layer its K and V scales (2 · kv_heads · head_dim floats) and the If that picks the
# attention path, with its two branches (fitted to the embedded export's target: +3,702 B a layer)
PROTO_INT8_KV_LAYER = 3_700


# edge.kv.KVCache allocates the slots in use, rounded up to this many, and grows by reallocating (never past
# capacity): memory follows the chat instead of the whole context being reserved and touched at load
KV_GROW_SLOTS = 256


def kv_allocated_slots(needed: int, capacity: int) -> int:
    """KV slots (scratch excluded) the runtime holds once `needed` are in use, for a cache of `capacity`."""
    return min(capacity, max(KV_GROW_SLOTS, -(-needed // KV_GROW_SLOTS) * KV_GROW_SLOTS))


def kv_elem_bytes(kv_dtype: str) -> int:
    return {"float16": 2, "int8": 1}.get(kv_dtype, 4)


def kv_bytes_per_token(arch: Mapping, layers: int, kv_dtype: str = "float32") -> int:
    """2 (K and V) · layers · kv_heads · head_dim · element size (Manifest.kv_bytes_per_token asks this)."""
    return 2 * layers * arch["kv_heads"] * arch["head_dim"] * kv_elem_bytes(kv_dtype)


# ---------------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class LinearBytes:
    """Bytes of one or more linear layers as the exporter stores them (MatMulNBits or plain MatMul)."""
    packed: int = 0  # MatMulNBits B: [N, n_blocks, block_size·bits/8] uint8
    scales: int = 0  # [N · n_blocks] float
    zero_points: int = 0  # [N · ceil(n_blocks·bits/8)] uint8 (asymmetric export, the default)
    float_weight: int = 0  # plain MatMul weight [K, N]

    @property
    def total(self) -> int:
        return self.packed + self.scales + self.zero_points + self.float_weight

    def __add__(self, o: "LinearBytes") -> "LinearBytes":
        return LinearBytes(self.packed + o.packed, self.scales + o.scales, self.zero_points + o.zero_points,
                           self.float_weight + o.float_weight)

    def __mul__(self, n: int) -> "LinearBytes":
        return LinearBytes(self.packed * n, self.scales * n, self.zero_points * n, self.float_weight * n)


def block_min_extra(k: int, block_size: int) -> int:
    """Blocks a 4-bit layer with float block minimums appends to its K (export.quant.quantize_block_min): one
    residual per block, packed into whole blocks."""
    return -(-(k // block_size) // block_size)


def linear_bytes(k: int, n: int, bits: int | None, block_size: int = 32, float_bytes: int = 4,
                 zero_points: bool = True, block_min: bool = False) -> LinearBytes:
    """y = x @ W with W [K, N]: int4 MatMulNBits = K·N/2 + scales (K/block)·N·4 (+ zero points (K/block)·N/2).
    `block_min` (4-bit with zero points, whole blocks): the residual blocks count like any other (the shared
    block-sum matrix is not per layer: `predict_weight_bytes` adds it once per K)."""
    if not bits:
        return LinearBytes(float_weight=k * n * float_bytes)
    nb = -(-k // block_size)
    if block_min and bits == 4 and zero_points and k % block_size == 0:
        nb += block_min_extra(k, block_size)
    return LinearBytes(packed=n * nb * block_size * bits // 8, scales=n * nb * float_bytes,
                       zero_points=n * -(-nb * bits // 8) if zero_points else 0)


@dataclass(frozen=True)
class WeightBytes:
    """On-disk bytes of one exported graph (onnx + external data), by part."""
    embedding: int  # [vocab, hidden]: a float Gather table, or block-quantized rows + scales (+ zero points)
    body: LinearBytes  # every decoder layer's qkv, o, gate_up, down
    head: LinearBytes  # lm_head [hidden, graph vocab]
    rotary: int  # cos/sin caches [max_len, head_dim/2] each
    norms: int  # 2·layers + 1 RMSNorm weights
    other: int  # qkv biases, drafter adapter; for a manifest graph also what the prediction misses (may be < 0)
    proto: int  # graph structure and small constants in model.onnx
    embedding_row: int = 0  # bytes of one embedding row (hidden · element size)

    @property
    def total(self) -> int:
        return self.embedding + self.body.total + self.head.total + self.rotary + self.norms + self.other + self.proto


def predict_weight_bytes(arch: Mapping, *, layers: int | None = None, vocab: int | None = None,
                         precision: str = "int4", block_size: int = 32, lm_head_bits: int | None = None,
                         max_len: int | None = None, zero_points: bool = True, adapter: bool = False,
                         embedding_bits: int = 0, block_min: bool = True, head_rescore: int = 0,
                         kv_int8: bool = False) -> WeightBytes:
    """What `export.graph.build_graph` writes for these settings, from architecture numbers alone (what-if planning:
    another precision, block size, drafter depth or trimmed vocabulary). `vocab`: the logits width (trimmed for
    drafters; the embedding always covers the full vocabulary). `lm_head_bits`: None = the exporter's default
    (8 for int bodies, float for fp32/fp16), 0 = float head. `embedding_bits`: 0 = float Gather table, else
    block-quantized rows with one scale (and one zero-point byte) per block. `block_min`: 4-bit layers keep their
    blocks' float minimums (residual blocks, plus one block-sum matrix [K, 32·extra] per distinct K, in `other`).
    `head_rescore` > 0: the two-stage head, whose weights are the coarse 4-bit ones (its exact rows are the
    embedding's). `kv_int8`: the graph has an int8 KV cache (its scales, and a second attention path)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    a = arch
    layers = a["layers"] if layers is None else layers
    vocab = a["vocab"] if vocab is None else vocab
    max_len = max_len or a.get("max_positions") or 4096
    fb = FLOAT_BYTES[precision]
    bits = QUANT_BITS.get(precision)
    if lm_head_bits is None:
        head_bits = 8 if bits else None
    else:
        head_bits = lm_head_bits or None
    hidden, hd, inter = a["hidden"], a["head_dim"], a["intermediate"]
    q_dim, kv_dim = a["heads"] * hd, a["kv_heads"] * hd

    def lin(k, n, b):
        if precision == "w8a8" and b == 8:  # int8 [K, N] + one scale per output channel (MatMulIntegerToFloat)
            return LinearBytes(packed=k * n, scales=n * fb)
        return linear_bytes(k, n, b, block_size, fb, zero_points, block_min)

    layer = lin(hidden, q_dim + 2 * kv_dim, bits) + lin(q_dim, hidden, bits) + lin(hidden, 2 * inter, bits) \
        + lin(inter, hidden, bits)
    other = layers * (q_dim + 2 * kv_dim) * fb if a.get("qkv_bias") else 0
    if block_min and zero_points:
        ks = {k for k, b in ((hidden, bits), (q_dim, bits), (inter, bits), (hidden, head_bits)) if b == 4}
        other += sum(k * block_min_extra(k, block_size) * block_size * fb for k in ks if k % block_size == 0)
    other += hidden * hidden * fb if adapter else 0
    row = hidden * fb
    if embedding_bits:
        nb = hidden // block_size
        row = nb * (block_size * embedding_bits // 8 + fb + (1 if zero_points else 0))
    return WeightBytes(
        embedding=a["vocab"] * row,
        body=layer * layers,
        head=(linear_bytes(hidden, vocab, COARSE_HEAD_BITS, COARSE_HEAD_BLOCK, fb, zero_points=False)
              if head_rescore else lin(hidden, vocab, head_bits)),
        rotary=2 * max_len * (hd // 2) * fb,
        norms=(2 * layers + 1) * hidden * fb,
        other=other,
        proto=PROTO_BYTES[0] + (PROTO_BYTES[1] + (PROTO_INT8_KV_LAYER + 2 * kv_dim * 4 if kv_int8 else 0)) * layers,
        embedding_row=row,
    )


def graph_weight_bytes(manifest, graph) -> WeightBytes:
    """The parts of an exported graph: `predict_weight_bytes` for its entry (layers, logits width, precision, head,
    rotary length), reconciled with the manifest's measured `weight_bytes` when it has one — whatever the predictor
    does not explain (an export option the manifest does not record, e.g. a drafter adapter or a symmetric
    export's missing zero points) goes into `other`, so the total is always the file size."""
    w = predict_weight_bytes(manifest.arch_of(graph), layers=graph.layers, vocab=graph.vocab, precision=graph.precision,
                             block_size=graph.block_size or 32, lm_head_bits=graph.lm_head_bits,
                             max_len=graph.max_len or None, embedding_bits=graph.embedding_bits,
                             block_min=graph.block_min, head_rescore=graph.head_rescore,
                             kv_int8=graph.kv_dtype == "int8")
    if graph.weight_bytes:
        w = replace(w, other=w.other + graph.weight_bytes - w.total)
    return w


# ---------------------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class Calibration:
    """Constants of the footprint model for one device class; these defaults are what the `source` line says.
    `edge-profile` re-fits the baseline on a host (so the model bounds every point it measured) and writes it to the
    "memory" section of its calibration JSON."""
    device_class: str = "cpu"
    baseline_mb: float = 70.0  # process before any session: Python, numpy, onnxruntime, the tokenizers library
    session_mb: float = 1.5  # per ORT session ...
    session_mb_per_layer: float = 0.5  # ... plus this per decoder layer (kernel objects, prepack bookkeeping)
    # "prepacked": CPU EP — MatMulNBits weights repacked into anonymous memory, the mapped originals given back at
    # load (edge.pages); other initializers stay memory-mapped, paged in as touched. "full": all resident (GPU/NPU)
    weights: str = "prepacked"
    prepack_scale_copies: float = 1.0
    # the memory-mapped embedding: the context holds D = coef · n^exp distinct tokens (Heaps' law; fitted to the
    # public workloads with the SmolLM2 tokenizer: 246 at 1k, 657 at 4k, 1571 at 8k tokens), and each first look-up
    # of a row maps a whole fault-around window (Linux fault_around_bytes, 64 KB) of the file into the process
    embedding_distinct_coef: float = 1.0
    embedding_distinct_exp: float = 0.8
    embedding_fault_bytes: float = 65536.0
    act_mb: float = 0.0  # a: fixed arena
    act_bytes_per_row_hidden: float = 80.0  # b: per row and hidden unit (all of a layer's live activations)
    act_bytes_per_row_vocab: float = 0.0  # c: per kept logits row and vocab entry (0 here: the head writes
    # straight into the bound logits buffer, counted as <g>.logits)
    # a two-stage head (COARSE_HEAD_BITS): its coarse logits and their rescored copy are two more [R, vocab] float
    # tensors in the arena, with the arena's own slack. Measured on Gemma 3 270M (262,144 tokens): peak RSS grew
    # 2.4-2.7 MB per verify row beyond the bound logits (memprobe, k = 0 and 16 at contexts 500 and 2,000)
    rescore_bytes_per_row_vocab: float = 10.0
    attn_bytes_per_row_token: float = 8.0  # e: attention scores per query row and key position; measured ≈ 4 B
    # per thread (2 threads). GQA's CPU source allocates heads·4 B, but only the pages it touches become resident
    source: str = ("measured on this host (2-core x86, onnxruntime 1.31.1 CPU EP, 2 threads) on the embedded "
                   "SmolLM2-135M int4 export: RSS after imports, after session creation (KV subtracted), and after "
                   "single calls of S = 1..512 rows at 0..3000 past tokens; the embedding's fault-around windows from prefills "
                  "of 1k tokens of varied vs repeated text (edge-profile memory runs)")

    def __post_init__(self):
        if self.weights not in ("prepacked", "full"):
            raise ValueError(f"calibration weights={self.weights!r}: 'prepacked' or 'full'")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not 0 <= v < math.inf:
                raise ValueError(f"calibration {f.name} must be a finite number >= 0 (got {v})")
        if not self.embedding_distinct_exp <= 1:  # distinct tokens grow at most as fast as the context
            raise ValueError("calibration embedding_distinct_exp must be in [0, 1] "
                             f"(got {self.embedding_distinct_exp})")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, device_class: str = "cpu") -> "Calibration":
        """Defaults of `device_class`, overridden by the keys of `d` (the "memory" section of a calibration JSON)."""
        base = DEFAULT_CALIBRATIONS.get(device_class)
        if base is None:
            raise ValueError(f"device class {device_class!r}: choose one of {', '.join(DEFAULT_CALIBRATIONS)}")
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"unknown memory calibration key(s) {bad}; known: {sorted(known)}")
        for k, v in d.items():
            if isinstance(getattr(base, k), float):
                try:
                    d[k] = float(v)
                except (TypeError, ValueError):
                    raise ValueError(f"memory calibration {k} must be a number (got {v!r})") from None
        return replace(base, **d)

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULT_CALIBRATIONS: dict[str, Calibration] = {
    "cpu": Calibration(),
    # Not measured here (no GPU/NPU on this machine): the same activation tensors, everything resident on the device,
    # no materialized attention scores (flash / memory-efficient attention), one device copy of the kept logits.
    "gpu": Calibration(device_class="gpu", baseline_mb=300.0, session_mb=8.0, session_mb_per_layer=0.5,
                       weights="full", prepack_scale_copies=1.0,
                       act_bytes_per_row_hidden=80.0, act_bytes_per_row_vocab=4.0, attn_bytes_per_row_token=0.0,
                       source="assumed, not measured: CUDA context with lazy module loading (~300 MB), weights "
                              "copied to device memory; re-measure with edge-profile"),
    "npu": Calibration(device_class="npu", baseline_mb=85.0, session_mb=16.0, session_mb_per_layer=0.5,
                       weights="full", prepack_scale_copies=1.0,
                       act_bytes_per_row_hidden=40.0, act_bytes_per_row_vocab=2.0, attn_bytes_per_row_token=8.0,
                       source="assumed, not measured: the host process plus the compiled context binary in shared "
                              "memory, fp16 activations (half the CPU's b); re-measure with edge-profile"),
}


# ---------------------------------------------------------------------------------------------- what is planned
@dataclass(frozen=True)
class Speculation:
    """The memory-relevant part of a plan: which drafter and how many draft tokens each verify call carries."""
    drafter: str = "none"  # none | lookup | recycling | hybrid | model
    nodes: int = 0  # draft tokens per verify call (chain length K or tree node budget N; the root not counted)
    draft_graph: str | None = None  # drafter "model": the manifest graph (default: `drafter_graph`'s choice)
    draft_width: int = 1  # rows of the widest drafter call (1 when drafting a chain token by token)
    recycling_k: int = RECYCLING_K  # successors per token kept by Token Recycling
    verify_topk: int = 0  # > 0: an on-graph top-k kernel returns ids + probs [S, k] instead of logits [S, V]
    sampling: bool = False  # temperature > 0: p and q arrays exist during verification

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter {self.drafter!r}: choose one of {', '.join(DRAFTERS)}")
        if self.nodes < 0 or (self.drafter == "none") != (self.nodes == 0):
            raise ValueError(f"drafter {self.drafter!r} with {self.nodes} nodes: 'none' has 0, the others >= 1")
        if self.draft_width < 1 or self.recycling_k < 1 or self.verify_topk < 0:
            raise ValueError("draft_width and recycling_k must be >= 1, verify_topk >= 0")

    @property
    def verify_rows(self) -> int:
        return self.nodes + 1


def _speculation(plan) -> Speculation:
    if isinstance(plan, Speculation):
        return plan
    spec = getattr(plan, "speculation", None)
    if isinstance(spec, Speculation):
        return spec
    raise TypeError(f"expected a Speculation or a Plan, got {type(plan).__name__}")


def kv_capacity(context: int, plan, min_call: int = 1) -> int:
    """KV slots to preallocate for `context` committed tokens plus the widest verify call's uncommitted ones."""
    return context + max(_speculation(plan).verify_rows, min_call)


# ---------------------------------------------------------------------------------------------- the footprint
@dataclass(frozen=True)
class Footprint:
    context: int
    parts: tuple[tuple[str, int], ...]  # (component, bytes), in a fixed order

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.parts)

    @property
    def total_mb(self) -> float:
        return self.total_bytes / MB

    def __getitem__(self, name: str) -> int:
        for n, b in self.parts:
            if n == name:
                return b
        raise KeyError(f"{name!r}: components are {[n for n, _ in self.parts]}")

    def get(self, name: str, default: int = 0) -> int:
        return dict(self.parts).get(name, default)

    def breakdown_mb(self) -> dict[str, float]:
        return {n: b / MB for n, b in self.parts}

    def to_dict(self) -> dict:
        return {"context": self.context, "total_mb": round(self.total_mb, 2),
                "components_mb": {n: round(b / MB, 3) for n, b in self.parts}}


def resident_weight_bytes(w: WeightBytes, calib: Calibration, context: int, rescored: bool = False) -> int:
    """Weights as they sit in memory once a session is loaded and `context` tokens have been embedded.
    `rescored`: the graph's two-stage head reads its candidates' rows of the embedding table on every call. The
    engine gives the table's pages back after each request (edge.pages; Gemma 3 270M: 5-15 MB of the 194 MB table
    mapped by one 64-token answer), but nothing bounds how much of it one long request maps, so the whole table
    is counted (a budget is never exceeded; Gemma's prediction is 16-25% above its measured peak)."""
    if calib.weights == "full":
        return w.total - w.proto
    quant = w.body + w.head
    prepacked = quant.packed + round(quant.scales * calib.prepack_scale_copies) + quant.zero_points \
        + quant.float_weight
    table = w.embedding if rescored else embedding_resident_bytes(w, calib, context)
    return prepacked + table + w.rotary + w.norms + w.other


def tokenizer_bytes(manifest) -> int:
    """The loaded tokenizer: its compact tables where the export has them (TOKENIZER_TABLES beside tokenizer.json),
    else the tokenizers library, which holds ~TOKENIZER_RSS_PER_FILE_BYTE bytes per byte of its tokenizer.json
    (measured: SmolLM2 1.9 MB → 15 MB, Gemma 3 11.7 MB → 93 MB)."""
    files = {f.path: f.bytes for f in getattr(manifest, "files", ())}
    tok = getattr(manifest, "tokenizer", None) or ""
    tables = (tok.rpartition("/")[0] + "/" if "/" in tok else "") + TOKENIZER_TABLES
    if tables in files:
        return round(TOKENIZER_TABLES_RSS_PER_FILE_BYTE * files[tables])
    return round(TOKENIZER_RSS_PER_FILE_BYTE * files[tok]) if tok in files else 0


def embedding_resident_bytes(w: WeightBytes, calib: Calibration, context: int) -> int:
    """The memory-mapped Gather table: windows of `embedding_fault_bytes` around the rows of the distinct tokens
    looked up. D distinct rows spread over W windows touch W·(1 − e^(−D/W)) of them (occupancy)."""
    fault = max(calib.embedding_fault_bytes, PAGE, w.embedding_row)
    windows = max(1, math.ceil(w.embedding / fault))
    distinct = calib.embedding_distinct_coef * context ** calib.embedding_distinct_exp
    return min(w.embedding, round(windows * -math.expm1(-distinct / windows) * fault))


def arena_bytes(calib: Calibration, hidden: int, vocab: int, rows: int, kept: int, span: int,
                rescored: bool = False) -> int:
    """ORT activation workspace of one call: a + b·S·hidden + c·R·vocab + e·S·T, plus `rescore_bytes_per_row_vocab`
    ·R·vocab for a two-stage head (`rescored`)."""
    c = calib.act_bytes_per_row_vocab + (calib.rescore_bytes_per_row_vocab if rescored else 0.0)
    return round(calib.act_mb * MB + calib.act_bytes_per_row_hidden * rows * hidden
                 + c * kept * vocab + calib.attn_bytes_per_row_token * rows * span)


# an int8-cache graph's session: its two attention paths are If branches, each a subgraph with its own kernels and
# execution state. Measured on SmolLM2-135M (30 layers, 2-core Zen 5): +5-7 MB against the same graph with one path
TWO_PATH_SESSION_MB_PER_LAYER = 0.25


def dequantized_attention_bytes(arch: Mapping, span: int) -> int:
    """What a wide prefill chunk over an int8 cache adds to one layer's workspace (export/graph.py): K and V of
    the `span` positions as float, three times over (the cast codes, the scaled copy, the kernel's present)."""
    return 2 * 3 * arch["kv_heads"] * arch["head_dim"] * 4 * span


def top1_agreement(graph, default: float) -> float:
    """A drafter graph's measured top-1 agreement with the target (its manifest stats), or `default` when the
    manifest has none or a value that is not a probability (a hand-edited NaN or string must not become a NaN
    plan or a TypeError)."""
    v = (graph.stats or {}).get("top1_agreement")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 else default


def drafter_graph(manifest, name: str | None = None):
    """The drafter graph `name`, or without a name the one `--drafter model` runs: the best measured top-1
    agreement with the target (the first such graph on a tie)."""
    drafters = manifest.drafters
    if not drafters:
        raise ValueError(f"{manifest.name}: no drafter graph in the manifest (drafter 'model' needs one)")
    if name is None:
        return max(drafters, key=lambda g: top1_agreement(g, 0.0))
    for g in drafters:
        if g.name == name:
            return g
    raise ValueError(f"drafter graph {name!r} not in the manifest (has {[g.name for g in drafters]})")


def _session_parts(prefix: str, manifest, graph, calib: Calibration, context: int, call_rows: int,
                   kept_rows: int, prefill_chunk: int, slots: int) -> tuple[list[tuple[str, int]], int]:
    """Weights, session, KV, logits and arena of one graph session → (parts, widest bias [S, T] bytes).
    `slots`: the KV buffer's capacity; attention scratch and bias only touch the `context + S` positions in use."""
    a = manifest.arch_of(graph)
    w = graph_weight_bytes(manifest, graph)
    span = context + call_rows
    chunk = max(1, min(prefill_chunk, context))
    rescored = graph.head_rescore > 0
    two_paths = graph.kv_dtype == "int8"
    wide = dequantized_attention_bytes(a, span) if two_paths and chunk >= WIDE_PREFILL_MIN else 0
    arena = max(arena_bytes(calib, a["hidden"], graph.vocab, call_rows, kept_rows, span, rescored),
                arena_bytes(calib, a["hidden"], graph.vocab, chunk, 1, span, rescored) + wide)
    parts = [
        (f"{prefix}.weights", resident_weight_bytes(w, calib, context, rescored=graph.head_rescore > 0)),
        # + edge.runner's per-session arrays: a zero bias row over capacity + MAX_CALL and a causal block
        (f"{prefix}.session", round((calib.session_mb + (calib.session_mb_per_layer
                                                         + (TWO_PATH_SESSION_MB_PER_LAYER if two_paths else 0))
                                     * graph.layers) * MB)
         + (slots + MAX_CALL) * 4 + MAX_CALL * MAX_CALL * 4),
        (f"{prefix}.kv", kv_bytes_per_token(a, graph.layers, graph.kv_dtype) * (slots + KV_SCRATCH_SLOTS)),
        (f"{prefix}.logits", max(kept_rows, 1) * graph.vocab * 4),
        (f"{prefix}.arena", arena),
    ]
    bias = max((r for r in (call_rows, chunk) if r > 1), default=0) * span * 4  # a 1-row call reuses a view
    return parts, bias


def predict_peak(manifest, plan, context: int, calib: Calibration | None = None, *,
                 prefill_chunk: int = PREFILL_CHUNK, min_call: int = 1, verify_rows: int | None = None,
                 capacity: int | None = None) -> Footprint:
    """Peak memory of running `plan` (a Plan or a Speculation) with `context` tokens in the KV cache.

    `capacity`: KV slots preallocated per graph (default: `kv_capacity(context, plan)`, i.e. a buffer sized to the
    context); pass the runtime's allocation when it is larger than what is in use. `prefill_chunk`: rows per
    prefill call (the arena keeps the largest); `min_call`: the runtime pads every call to at least this many rows
    (edge.runner pads single-token calls to 2 where a kernel is row-count sensitive); `verify_rows`: the target's
    verify call is padded to this many rows (a static shape bucket)."""
    if context < 1:
        raise ValueError(f"context must be >= 1 token (got {context})")
    spec = _speculation(plan)
    calib = calib or DEFAULT_CALIBRATIONS["cpu"]
    a = manifest.arch
    target = manifest.target
    rows = max(spec.verify_rows, min_call, verify_rows or 0)
    # a runtime's buffers are what it preallocated (near a full cache it drafts less rather than growing them),
    # and at least the context plus one plain call
    slots = context + rows if capacity is None else max(capacity, context + max(min_call, 1))
    parts: list[tuple[str, int]] = [("baseline", round(calib.baseline_mb * MB)), ("tokenizer", tokenizer_bytes(manifest))]
    tparts, bias = _session_parts("target", manifest, target, calib, context, rows, rows, prefill_chunk, slots)
    if spec.verify_topk:  # ids int64 + probs float32 per kept row instead of the full vocabulary
        tparts[3] = ("target.logits", rows * spec.verify_topk * 12 + target.vocab * 4)
    parts += tparts
    if spec.drafter == "model":
        g = drafter_graph(manifest, spec.draft_graph)
        width = max(spec.draft_width, min_call)
        # the drafter's cache also holds the draft tokens it fed itself before verification
        dslots = context + spec.nodes + 1 if capacity is None else max(capacity, context + 1)
        dparts, dbias = _session_parts("drafter", manifest, g, calib, context, width + 1, width, prefill_chunk,
                                       dslots)
        parts += dparts
        parts.append(("drafter.id_map", g.vocab * 8 if g.id_map else 0))
        bias = max(bias, dbias)
    parts.append(("runtime.bias", bias))
    if spec.sampling:
        q = spec.nodes * a["vocab"] * 8 if spec.drafter == "model" else 0
        parts.append(("verify.work", rows * target.vocab * 4 + q))
    # an engine holds the lookup history and Token Recycling's tables whatever drafter runs (recycling learns
    # from every target call; a re-plan away from lookup keeps its history): counted for every plan
    parts.append(("lookup.state", context * LOOKUP_BYTES_PER_TOKEN))
    matrix, pairs = recycling_bytes(a["vocab"], spec.recycling_k)
    parts.append(("recycling.matrix", matrix))
    parts.append(("recycling.pairs", pairs))
    return Footprint(context, tuple(parts))
