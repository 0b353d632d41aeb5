"""The budget planner: the drafter, draft length K or tree of N nodes that maximizes expected tokens/s among the
plans whose predicted peak memory fits the budget.

    tokens/s = E[accepted + 1] / (t_draft + t_verify(S) + overhead),   S = N + 1 rows per verify call

E[accepted] comes from `AcceptanceStats` (per depth and rank, updated online), t_verify from a latency curve
(a calibration's measurements, or the default shape below), peak memory from `footprint.predict_peak`.
`replan` re-plans under the previous plan as a ceiling (it shrinks the tree, then K, then moves to a cheaper
drafter, then plain decoding; `BudgetError` only when plain decoding does not fit). edge.engine does not use it:
it makes a fresh `plan` for every request at the context that request can reach, since a ceiling kept one poor
turn's choice for the rest of the chat.

A profile is duck-typed (`devices.DeviceProfile` fits): budget_mb, device_class, simulated, shape_buckets,
prefill_chunk, weight_precisions, calibration (dict), name. None means an unconstrained CPU.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Mapping, Sequence

import numpy as np

from .acceptance import AcceptanceStats, TreeShape
from .footprint import (DRAFTERS, MB, PREFILL_CHUNK, Calibration, Footprint, Speculation, drafter_graph,
                        graph_weight_bytes, predict_peak, top1_agreement)

# Verify-call latency relative to one token, measured on the embedded SmolLM2-135M int4 export on this host
# (t(8) ≈ 1.7·t(1), t(16) ≈ 2.2·t(1), t(1) ≈ 9 ms). Beyond the last point a call is taken as compute-bound
# (time proportional to S), which is pessimistic for big trees rather than optimistic.
DEFAULT_VERIFY_SHAPE = ((1, 1.0), (8, 1.7), (16, 2.2))
DEFAULT_T1_MS = 9.0
DEFAULT_LOOKUP_MS = 0.05  # a dict probe per n-gram length: negligible next to a verify call (assumed)
DEFAULT_RECYCLING_MS = 0.10  # a breadth-first walk of the [V, k] adjacency matrix (assumed)
# Priors until online statistics arrive: (acceptance per depth, share of steps with a non-empty draft). Assumed,
# not measured: prompt lookup finds a match in about half the steps of a fresh chat; Token Recycling always drafts.
DEFAULT_PRIORS = {"lookup": (0.30, 0.5), "recycling": (0.35, 1.0), "hybrid": (0.40, 1.0)}
DEFAULT_MODEL_PRIOR = 0.30  # a model drafter whose manifest has no measured top1_agreement
# per-token acceptance of free (lookup + recycling) chains on typical chat and completion text: what a model
# drafter's chains must beat, call cost included, to be worth running (hybrid's measured acceptance on the public
# workloads sits around it; it prices the export's precision choice too)
FREE_CHAIN_ACCEPTANCE = 0.6
DEFAULT_DRAFTERS = ("none", "lookup", "model")  # what edge/ runs today; pass drafters= to add "recycling"
TREE_DRAFTERS = ("recycling", "hybrid")  # can fill a tree (ModelDrafter drafts chains); () if trees are inexact
MAX_CHAIN = 16
MAX_NODES = 64
# "cheaper" for re-planning: model drafters (largest first), hybrid, Token Recycling, lookup, none
_DRAFTER_RANK = {"none": 0, "lookup": 1, "recycling": 2, "hybrid": 3, "model": 4}


# the top-level keys of a calibration JSON (edge-profile writes it; edge.planning.load_calibration checks it)
CALIBRATION_SECTIONS = ("device_class", "memory", "latency", "acceptance", "source", "host", "model")


class BudgetError(Exception):
    """Even plain decoding does not fit; says how many MB it needs and how many there are."""

    def __init__(self, required_mb: float, available_mb: float, context: int, hint: str = "",
                 fits: int | None = None):
        self.required_mb, self.available_mb, self.context = required_mb, available_mb, context
        self.fits = fits  # the largest context plain decoding fits at this budget (0: none; None: not searched)
        digits = next(d for d in (1, 2, 3, 6) if round(required_mb, d) != round(available_mb, d) or d == 6)
        super().__init__(
            f"plain decoding at context {context} needs {required_mb:.{digits}f} MB but the memory budget is "
            f"{available_mb:.{digits}f} MB; " + (hint or f"raise --budget-mb to at least {math.ceil(required_mb)}"))


class PlanError(ValueError):
    """A request the planner cannot serve for reasons other than memory (precision, shapes, context)."""


# ---------------------------------------------------------------------------------------------- latency
def export_verify_shape(stats: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """Call time by width relative to one row, as the export measured it on its graph (`latency_ms_by_s`, S = 1..8;
    made non-decreasing: a wider call is never assumed cheaper), else DEFAULT_VERIFY_SHAPE. The slope differs by
    ~3x between quantization schemes (+2 ms per row with int4 MatMulNBits on the dev VM, +0.6 ms with w8a8)."""
    by_s = stats.get("latency_ms_by_s") or []
    if len(by_s) < 2 or not all(isinstance(t, (int, float)) and t > 0 for t in by_s):
        return DEFAULT_VERIFY_SHAPE
    ratios = np.maximum.accumulate(np.maximum(1.0, np.asarray(by_s, float) / by_s[0]))
    return tuple((i + 1, float(r)) for i, r in enumerate(ratios))


def _is_ms(v) -> bool:
    """A positive, finite number (not a bool, a string or NaN): a time a manifest may record."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf


def stat_ms(stats: Mapping[str, Any], key: str) -> float | None:
    """A positive, finite number of ms the export recorded under `key`, else None (absent, or a hand-edited
    manifest's string or NaN: the caller's default applies instead of a traceback)."""
    v = stats.get(key)
    return float(v) if _is_ms(v) else None


def export_contexts(stats: Mapping[str, Any], least: int = 2) -> list[tuple[int, list[list[float]]]]:
    """The curves the export timed the engine's way at `least` or more contexts (`latency_ms_by_s_at`:
    [[context, [ms for S = 1..8]], ...]) as [(context, [[S, ms], ...]), ...]; [] when it recorded none or its
    figures are unusable (older exports; a hand-edited manifest). The target's need two (else every context is
    priced alike), a drafter's one."""
    at = stats.get("latency_ms_by_s_at")

    def ok(c, by_s) -> bool:
        return isinstance(c, int) and not isinstance(c, bool) and c >= 1 and isinstance(by_s, list) \
            and len(by_s) >= 2 and all(map(_is_ms, by_s))

    if not isinstance(at, list) or len(at) < least or not all(isinstance(p, list) and len(p) == 2 and ok(*p) for p in at) \
            or len({c for c, _ in at}) != len(at):
        return []
    return sorted((c, [[i + 1, float(x)] for i, x in enumerate(by_s)]) for c, by_s in at)


@dataclass(frozen=True)
class LatencyCurve:
    """Milliseconds of one call of S rows: piecewise linear through measured (S, ms) points, flat below the first,
    proportional to S beyond the last."""
    points: tuple[tuple[int, float], ...]

    def __post_init__(self):
        try:
            pts = tuple(sorted((int(s), float(t)) for s, t in self.points))
            if any(isinstance(s, bool) or s != int(s) for s, _ in self.points):  # S = 1.9 is not one row
                pts = ()
        except (TypeError, ValueError, OverflowError):
            pts = ()
        if not pts or pts[0][0] < 1 or not all(0 < t < math.inf for _, t in pts) \
                or len({s for s, _ in pts}) != len(pts):
            raise ValueError(f"latency points need [S, ms] pairs with distinct S >= 1 and finite ms > 0 "
                             f"(got {self.points!r})")
        object.__setattr__(self, "points", pts)

    @classmethod
    def scaled(cls, t1_ms: float, shape: Sequence[tuple[int, float]] = DEFAULT_VERIFY_SHAPE) -> "LatencyCurve":
        return cls(tuple((s, t1_ms * r) for s, r in shape))

    def __call__(self, s: int) -> float:
        pts = self.points
        if s <= pts[0][0]:
            return pts[0][1]
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if s <= s1:
                return t0 + (t1 - t0) * (s - s0) / (s1 - s0)
        sl, tl = pts[-1]
        return tl * s / sl


def _monotone(curve: LatencyCurve) -> LatencyCurve:
    """`curve` with each point raised to the most expensive narrower one: noise in measured medians must not make
    a wider call look cheaper (the planner would buy it)."""
    ms = np.maximum.accumulate([t for _, t in curve.points])
    if all(t == m for (_, t), m in zip(curve.points, ms)):
        return curve
    return LatencyCurve(tuple((s, float(m)) for (s, _), m in zip(curve.points, ms)))


@dataclass(frozen=True)
class Latency:
    target: LatencyCurve
    drafters: Mapping[str, LatencyCurve] = field(default_factory=dict)  # model drafter graph name → curve
    lookup_ms: float = DEFAULT_LOOKUP_MS
    recycling_ms: float = DEFAULT_RECYCLING_MS
    overhead_ms: float = 0.0  # per step, outside the model calls (the engine's Python)
    context: int | None = None  # cached tokens the curves above were measured at (None: not recorded)
    target_at: tuple[tuple[int, LatencyCurve], ...] = ()  # the target's curve at further contexts

    def target_for(self, context: int) -> LatencyCurve:
        """The target's curve at `context` cached tokens: linear in the context between measured contexts (each
        row attends to every cached token); beyond the last, that curve plus the growth per token between the first
        and the last (their spread keeps two noisy medians from setting the slope; never downward); below the
        first, the first. Never cheaper for more rows. One measured context: the same curve at any context."""
        pts = sorted(((self.context, self.target), *self.target_at), key=lambda p: p[0]) \
            if self.context is not None else []
        if len(pts) < 2 or context <= pts[0][0]:
            return _monotone(pts[0][1] if pts else self.target)
        (c0, k0), (c1, k1) = next(((a, b) for a, b in zip(pts, pts[1:]) if context <= b[0]), (pts[0], pts[-1]))
        w = (context - c0) / (c1 - c0)  # > 1 beyond the last measured context

        def ms_at(s: int) -> float:
            grow = k1(s) - k0(s)
            return k1(s) + (w - 1) * max(grow, 0.0) if w > 1 else (1 - w) * k0(s) + w * k1(s)  # exact at c0, c1

        rows = sorted({s for s, _ in k0.points + k1.points})
        return _monotone(LatencyCurve(tuple(zip(rows, map(ms_at, rows)))))

    @classmethod
    def from_calibration(cls, manifest, d: Mapping[str, Any] | None = None) -> "Latency":
        """The "latency" section of a calibration JSON: {"target": [[S, ms], ...], "drafters": {graph: [[S, ms],
        ...]}, "lookup_ms", "recycling_ms", "overhead_ms", "context": cached tokens those curves were measured at,
        "target_at": [[context, [[S, ms], ...]], ...]}. No target curve (and no context): the export's own curves
        at two contexts (`export_contexts`), else its latency_ms_s1 (or DEFAULT_T1_MS) times its measured shape
        (`export_verify_shape`) at every context. A drafter graph with no curve here: the export's engine-way
        curve of it (timed beside the target's), else its latency_ms_s1 (numpy-fed) times the default shape."""
        d = dict(d or {})
        known = {"target", "drafters", "lookup_ms", "recycling_ms", "overhead_ms", "context", "target_at"}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"unknown latency calibration key(s) {bad}; known: {sorted(known)}")

        def curve(v, what: str) -> LatencyCurve:
            try:
                return LatencyCurve(tuple(map(tuple, v)))
            except (TypeError, ValueError) as e:
                raise ValueError(f"latency {what}: [[S, ms], ...] with distinct S >= 1 and finite ms > 0 "
                                 f"(got {v!r:.80})") from e

        t = d.get("target")
        timed = export_contexts(manifest.target.stats) if not t and d.get("context") is None else []
        target = curve(t, "target") if t else LatencyCurve(tuple(map(tuple, timed[0][1]))) if timed else \
            LatencyCurve.scaled(stat_ms(manifest.target.stats, "latency_ms_s1") or DEFAULT_T1_MS,
                                export_verify_shape(manifest.target.stats))
        drafters = d.get("drafters") or {}
        if not isinstance(drafters, Mapping):
            raise ValueError(f"latency drafters must map a drafter graph to [[S, ms], ...] (got {drafters!r})")
        measured = {k: curve(v, f"drafters[{k!r}]") for k, v in drafters.items()}
        curves = {}
        for g in manifest.drafters:
            if g.name in measured:
                curves[g.name] = measured[g.name]
            elif own := export_contexts(g.stats, least=1):  # timed the engine's way at export, as the target's curves above
                curves[g.name] = LatencyCurve(tuple(map(tuple, own[0][1])))
            else:  # no export-time number either: scale the target by the layer ratio
                t1 = stat_ms(g.stats, "latency_ms_s1") or target(1) * g.layers / max(manifest.target.layers, 1)
                curves[g.name] = LatencyCurve.scaled(t1)
        ms = {}
        for k, default in (("lookup_ms", DEFAULT_LOOKUP_MS), ("recycling_ms", DEFAULT_RECYCLING_MS),
                           ("overhead_ms", 0.0)):
            v = d.get(k, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"latency {k} must be a finite number of ms >= 0 (got {v!r})")
            ms[k] = float(v)
        context, at = d.get("context"), d.get("target_at", [])
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
            raise ValueError(f"latency context must be a whole number of cached tokens >= 1 (got {context!r})")
        if not isinstance(at, list) or not all(isinstance(p, list) and len(p) == 2 for p in at):
            raise ValueError(f"latency target_at: [[context, [[S, ms], ...]], ...] (got {at!r:.80})")
        if at and (context is None or not t):
            raise ValueError("latency target_at needs the target curve and the context it was measured at")
        if timed:  # the export's own curves at two contexts
            context, at = timed[0][0], timed[1:]
        at = tuple((c, curve(v, f"target_at[{c!r}]")) for c, v in at)
        cs = [c for c, _ in at]
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in cs) \
                or len({context, *cs}) != 1 + len(cs):
            raise ValueError(f"latency target_at: distinct whole contexts >= 1 other than context {context} (got {cs})")
        return cls(target, curves, ms["lookup_ms"], ms["recycling_ms"], ms["overhead_ms"], context, at)

    def draft_ms(self, spec: Speculation, shape: TreeShape, bucket=lambda s: s) -> float:
        if spec.drafter == "none":
            return 0.0
        if spec.drafter == "lookup":
            return self.lookup_ms
        if spec.drafter == "recycling":
            return self.recycling_ms
        if spec.drafter == "hybrid":
            return self.lookup_ms + self.recycling_ms
        curve = self.drafters[spec.draft_graph]
        return sum(curve(bucket(w)) for w in shape.widths)  # one drafter call per depth


# ---------------------------------------------------------------------------------------------- acceptance
def default_stats(manifest) -> dict[str, AcceptanceStats]:
    """Priors per drafter key: "lookup", "recycling", "hybrid", and each model drafter graph's name (its
    manifest top1_agreement as the per-depth rate)."""
    out = {k: AcceptanceStats(a, draft_rate=h) for k, (a, h) in DEFAULT_PRIORS.items()}
    for g in manifest.drafters:
        out[g.name] = AcceptanceStats(top1_agreement(g, DEFAULT_MODEL_PRIOR))
    return out


def _stats_for(stats: Mapping[str, AcceptanceStats], spec: Speculation) -> AcceptanceStats:
    return stats[spec.draft_graph if spec.drafter == "model" else spec.drafter]


# ---------------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Plan:
    drafter: str  # none | lookup | recycling | hybrid | model
    k: int  # chain draft length (0 for a tree or plain decoding)
    nodes: int  # draft tokens per verify call: K for a chain, the node budget N for a tree
    tree: str  # "none" | "chain" | "best-first"
    max_context: int  # the largest context this plan still fits the budget at (re-plan before passing it)
    peak_mb: float  # predicted peak at the context it was planned for
    tokens_per_s: float  # predicted
    reason: str
    draft_graph: str | None = None  # drafter "model": the manifest graph
    parents: tuple[int, ...] = ()  # the tree (Draft.parents convention), for a drafter to fill
    ranks: tuple[int, ...] = ()
    speedup: float = 1.0  # predicted, over plain decoding on the same device
    expected_accepted: float = 0.0  # draft tokens accepted per verify call
    context: int = 0
    budget_mb: float = 0.0
    plain_peak_mb: float = 0.0
    verify_rows: int = 1  # rows of each target call (after static-shape padding)
    draft_width: int = 1  # rows of the widest drafter call (model drafters)
    sampling: bool = False

    @property
    def shape(self) -> TreeShape:
        return TreeShape(self.tree, self.parents, self.ranks)

    @property
    def speculation(self) -> Speculation:
        return Speculation(self.drafter, self.nodes, self.draft_graph, draft_width=self.draft_width,
                           sampling=self.sampling)

    @property
    def extra_mb(self) -> float:
        """Memory speculation adds over plain decoding at the same context."""
        return self.peak_mb - self.plain_peak_mb

    def to_dict(self) -> dict:
        d = asdict(self)
        d["parents"], d["ranks"] = list(self.parents), list(self.ranks)
        for k in ("peak_mb", "tokens_per_s", "speedup", "expected_accepted", "plain_peak_mb", "budget_mb"):
            d[k] = round(d[k], 3)
        return d


@dataclass(frozen=True)
class Candidate:
    speculation: Speculation
    shape: TreeShape
    verify_rows: int
    expected_accepted: float
    step_ms: float
    tokens_per_s: float
    context: int
    setup: "_Setup" = field(repr=False, compare=False)

    @cached_property
    def footprint(self) -> Footprint:  # computed on demand: the planner only prices the plans it might pick
        return self.setup.peak(self.speculation, self.context, self.verify_rows)

    @property
    def peak_mb(self) -> float:
        return self.footprint.total_mb


@dataclass
class _Setup:
    manifest: Any
    calib: Calibration
    latency: Latency
    stats: Mapping[str, AcceptanceStats]
    buckets: tuple[int, ...]
    prefill_chunk: int
    min_call: int
    capacity: int | None = None  # KV slots the runtime preallocated (None: sized to the context)
    plain_rows: int = 1

    def bucket(self, s: int) -> int:
        s = max(s, self.min_call)
        if not self.buckets:
            return s
        for b in self.buckets:
            if b >= s:
                return b
        raise PlanError(f"no compiled shape bucket holds {s} rows (buckets {self.buckets})")

    def peak(self, spec: Speculation, context: int, rows: int) -> Footprint:
        return predict_peak(self.manifest, spec, context, self.calib, prefill_chunk=self.prefill_chunk,
                            min_call=self.min_call, verify_rows=rows, capacity=self.capacity)


def _setup(profile, manifest, stats, calibration, min_call, capacity=None) -> _Setup:
    cal = dict(calibration if calibration is not None else (getattr(profile, "calibration", None) or {}))
    bad = sorted(set(cal) - set(CALIBRATION_SECTIONS))
    if bad:
        raise ValueError(f"unknown calibration section(s) {bad}; known: memory, latency, acceptance")
    # a profile simulated on the CPU uses CPU kernels, so its memory behaves like the CPU's
    cls = "cpu" if getattr(profile, "simulated", False) else getattr(profile, "device_class", "cpu")
    # precedence: stats passed in > the calibration's measured acceptance > priors; "model" means every drafter graph
    merged = default_stats(manifest)
    for given in ({k: AcceptanceStats.from_dict(v) for k, v in (cal.get("acceptance") or {}).items()},
                  {k: stats for k in merged} if isinstance(stats, AcceptanceStats) else dict(stats or {})):
        if "model" in given:
            for g in manifest.drafters:
                given.setdefault(g.name, given["model"])
        merged.update(given)
    buckets = tuple(sorted(getattr(profile, "shape_buckets", ()) or ()))
    chunk = getattr(profile, "prefill_chunk", None) or PREFILL_CHUNK
    s = _Setup(manifest, Calibration.from_dict(cal.get("memory"), cls),
               Latency.from_calibration(manifest, cal.get("latency")), merged, buckets, chunk, max(1, min_call),
               capacity)
    s.plain_rows = s.bucket(1)
    return s


def _check_profile(profile, manifest) -> None:
    allowed = getattr(profile, "weight_precisions", None)
    t = manifest.target
    if allowed and t.precision not in allowed:
        raise PlanError(f"device {getattr(profile, 'name', '?')!r} runs {'/'.join(allowed)} weights but "
                        f"{manifest.name} is exported as {t.precision}; re-export with --precision "
                        f"{allowed[-1]} (the embedded model: edge-export --default -o DIR --precision {allowed[-1]}, "
                        "then --model DIR) or choose another --device")


def _enumerate(profile, setup: _Setup, context: int, drafters, tree_drafters, max_k, max_nodes,
               sampling) -> tuple[Candidate, list[Candidate]]:
    """(plain decoding, every speculative candidate) with predicted tokens/s and footprint; no budget applied."""
    m, lat = setup.manifest, setup.latency
    target = lat.target_for(context)
    t_plain = target(setup.plain_rows)
    plain_spec = Speculation(sampling=sampling)
    plain = Candidate(plain_spec, TreeShape.chain(0), setup.plain_rows, 0.0, t_plain + lat.overhead_ms,
                      1000.0 / (t_plain + lat.overhead_ms), context, setup)
    allowed = getattr(profile, "weight_precisions", None)
    keys: list[tuple[str, str | None]] = []
    for d in drafters:
        if d not in DRAFTERS:
            raise PlanError(f"drafter {d!r}: choose among {', '.join(DRAFTERS)}")
        if d == "model":
            keys += [("model", g.name) for g in m.drafters if not allowed or g.precision in allowed]
        elif d != "none":
            keys.append((d, None))
    if setup.buckets:
        sizes = [b - 1 for b in setup.buckets if b >= 2]
    else:
        sizes = list(range(1, max(max_k, max_nodes) + 1))
    out = []
    top = max(sizes, default=0)
    for drafter, graph in keys:
        stats = _stats_for(setup.stats, Speculation(drafter, 1, graph))
        h = stats.draft_rate
        # E[accepted] of every prefix from one pass: prefixes of a chain / best-first tree are themselves optimal
        full = {"chain": TreeShape.chain(min(max_k, top))}
        if drafter in tree_drafters:
            full["tree"] = stats.best_first(min(max_nodes, top))
        prefix_acc = {k: np.concatenate([[0.0], np.cumsum(stats.node_probs(v))]) * h for k, v in full.items()}
        shapes = [("chain", n) for n in sizes if n <= len(full["chain"])]
        shapes += [("tree", n) for n in sizes if "tree" in full and 2 <= n <= len(full["tree"])]
        for kind, n in shapes:
            shape = full[kind].prefix(n)
            if kind == "tree" and shape.is_chain:
                continue  # the best tree of this size is the chain itself
            width = setup.bucket(max(shape.widths)) if drafter == "model" else 1  # drafter calls are padded too
            spec = Speculation(drafter, n, graph, draft_width=width, sampling=sampling)
            rows = setup.bucket(n + 1)
            acc = float(prefix_acc[kind][n])
            step = lat.draft_ms(spec, shape, setup.bucket) + h * target(rows) + (1 - h) * t_plain \
                + lat.overhead_ms
            out.append(Candidate(spec, shape, rows, acc, step, 1000.0 * (1 + acc) / step, context, setup))
    return plain, out


def _rank(spec: Speculation, manifest) -> tuple[int, int]:
    if spec.drafter == "model":
        g = drafter_graph(manifest, spec.draft_graph)
        return _DRAFTER_RANK["model"], graph_weight_bytes(manifest, g).total  # its size, whatever its shape
    return _DRAFTER_RANK[spec.drafter], 0


def _within(c: Candidate, ceiling: Plan, manifest) -> bool:
    """Is candidate `c` no bigger than the plan it replaces (same drafter: no more nodes, no tree after a chain)?"""
    rc, rp = _rank(c.speculation, manifest), _rank(ceiling.speculation, manifest)
    if rc != rp or c.speculation.draft_graph != ceiling.draft_graph:
        return rc < rp
    if c.speculation.nodes > ceiling.nodes:
        return False
    return c.shape.is_chain or ceiling.tree == "best-first"


def _max_context(setup: _Setup, spec: Speculation, rows: int, lo: int, limit: int, budget_bytes: float) -> int:
    """Largest context in [lo, limit] whose peak fits (peak is monotone in context); lo - 1 if none does."""
    fits = lambda c: setup.peak(spec, c, rows).total_bytes <= budget_bytes  # noqa: E731
    if lo > limit or not fits(lo):
        return lo - 1
    if fits(limit):
        return limit
    good, bad = lo, limit
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _label(s: Speculation) -> str:
    if s.drafter == "none":
        return "plain decoding"
    return s.drafter if s.drafter != "model" else f"model drafter {s.draft_graph}"


def _describe(c: Candidate) -> str:
    s = c.speculation
    if s.drafter == "none":
        return _label(s)
    return f"{_label(s)} {'chain K' if c.shape.is_chain else 'tree N'}={s.nodes}"


def _reason(best: Candidate, plain: Candidate, budget: float, context: int, dropped: dict, ceiling, profile) -> str:
    r = (f"{_describe(best)}: {best.tokens_per_s:.1f} tok/s predicted "
         f"({best.tokens_per_s / plain.tokens_per_s:.2f}x plain {plain.tokens_per_s:.1f}), "
         f"E[accepted]={best.expected_accepted:.2f}/step; peak {best.peak_mb:.1f} of {budget:.1f} MB at context "
         f"{context}")
    if dropped:  # faster plans that did not fit
        r += "; over budget: " + ", ".join(f"{k} (from {v:.1f} MB)" for k, v in sorted(dropped.items()))
    if ceiling is not None and ceiling.drafter != "none":
        r += f"; re-planned from {ceiling.drafter} N={ceiling.nodes} ({ceiling.tree})"
    if getattr(profile, "simulated", False):
        r += f"; {getattr(profile, 'name', 'device')} simulated on the CPU"
    return r


def plan(profile, manifest, context_len: int, stats=None, budget_mb: float | None = None, *,
         calibration: Mapping | None = None, drafters: Sequence[str] | None = None,
         tree_drafters: Sequence[str] = TREE_DRAFTERS, max_k: int = MAX_CHAIN, max_nodes: int = MAX_NODES,
         sampling: bool = False, min_call: int = 1, capacity: int | None = None,
         ceiling: Plan | None = None) -> Plan:
    """The plan with the highest predicted tokens/s whose predicted peak at `context_len` fits the budget.

    stats: AcceptanceStats for every drafter, or {drafter key: AcceptanceStats} (keys "lookup", "recycling",
    "hybrid", a model drafter graph's name or "model"); missing keys use `default_stats`. budget_mb: default the profile's.
    calibration: {"memory": {...}, "latency": {...}, "acceptance": {...}}, default the profile's.
    min_call: the runtime pads calls to at least this many rows (GraphSession.min_call).
    capacity: KV slots the runtime already preallocated per graph (None: buffers sized to the context).
    ceiling: only plans no bigger than this one (see `replan`)."""
    budget = budget_mb if budget_mb is not None else getattr(profile, "budget_mb", None)
    if budget is None or not budget > 0:
        raise PlanError(f"no memory budget: pass budget_mb (got {budget!r}) or a device profile with one")
    if context_len < 1:
        raise PlanError(f"context must be >= 1 token (got {context_len})")
    t = manifest.target
    _check_profile(profile, manifest)
    setup = _setup(profile, manifest, stats, calibration, min_call, capacity)
    # KV slots a verify call may reach: what the export's rotary tables cover, or what the runtime allocated
    slots = min(t.max_len or 1 << 30, capacity or 1 << 30)
    if context_len + setup.plain_rows > slots:
        raise PlanError(f"context {context_len} and a {setup.plain_rows}-row call do not fit {slots} KV positions "
                        f"({manifest.name} exported for {t.max_len}): load with a larger context "
                        "(edge.load(context=N), edge-chat --context N) or re-export with --max-len")
    drafters = tuple(drafters) if drafters is not None else DEFAULT_DRAFTERS
    # no candidate is dropped for its verify rows: near a full cache the runtime drafts fewer tokens (edge.engine
    # caps a draft at the room left), and the footprint prices the full call, an upper bound
    plain, cands = _enumerate(profile, setup, context_len, drafters, tree_drafters, max_k, max_nodes, sampling)
    budget_bytes = budget * MB
    if plain.footprint.total_bytes > budget_bytes:
        fits = _max_context(setup, plain.speculation, plain.verify_rows, 1, context_len - 1, budget_bytes)
        hint = (f"at this budget plain decoding fits up to context {fits}" if fits >= 1 else
                "not even a 1-token context fits: the weights" + (f" and the KV cache preallocated for {capacity} "
                                                                  "tokens" if capacity else "") + " alone exceed it") \
            + f"; raise --budget-mb to at least {math.ceil(plain.peak_mb)} or lower --context"
        raise BudgetError(plain.peak_mb, budget, context_len, hint, fits=max(fits, 0))
    if ceiling is not None:
        cands = [c for c in cands if _within(c, ceiling, manifest)]
    # fastest first (ties: fewer nodes, then the cheaper drafter); the first that fits wins
    cands = [c for c in cands if c.tokens_per_s > plain.tokens_per_s]
    cands.sort(key=lambda c: (-round(c.tokens_per_s, 9), c.speculation.nodes, _rank(c.speculation, manifest)))
    best, dropped = plain, {}
    for c in cands:
        if c.footprint.total_bytes <= budget_bytes:
            best = c
            break
        key = _label(c.speculation)
        dropped[key] = min(dropped.get(key, math.inf), c.peak_mb)
    reason = _reason(best, plain, budget, context_len, dropped, ceiling, profile)
    spec = best.speculation
    return Plan(
        drafter=spec.drafter, k=spec.nodes if best.shape.is_chain else 0, nodes=spec.nodes,
        tree="none" if spec.drafter == "none" else ("chain" if best.shape.is_chain else "best-first"),
        max_context=_max_context(setup, spec, best.verify_rows, context_len, slots - setup.plain_rows,
                                 budget_bytes),
        peak_mb=best.peak_mb, tokens_per_s=best.tokens_per_s, reason=reason, draft_graph=spec.draft_graph,
        parents=best.shape.parents, ranks=best.shape.ranks, speedup=best.tokens_per_s / plain.tokens_per_s,
        expected_accepted=best.expected_accepted, context=context_len, budget_mb=float(budget),
        plain_peak_mb=plain.peak_mb, verify_rows=best.verify_rows, draft_width=spec.draft_width, sampling=sampling)


def plain_call_rows(profile, min_call: int) -> int:
    """Rows of a plain decoding call: `min_call`, padded up to the profile's smallest shape bucket holding it."""
    rows = max(1, min_call)
    return next((b for b in sorted(getattr(profile, "shape_buckets", ()) or ()) if b >= rows), rows)


def fullest(context: int, rows: int) -> int:
    """Tokens in the KV cache before the last call an engine of `context` slots makes (it keeps room for one
    plain call of `rows` rows, `plain_call_rows`): the context its memory plan must hold at the end of a chat."""
    return max(1, context - rows)


def replan(previous: Plan, profile, manifest, context_len: int, stats=None, budget_mb: float | None = None,
           **kw) -> Plan:
    """Re-plan during a chat as the context grows: the best plan no bigger than `previous` — a smaller tree, then
    a shorter chain, then a cheaper drafter, then plain decoding; BudgetError when even that does not fit."""
    budget = budget_mb if budget_mb is not None else (previous.budget_mb or None)
    return plan(profile, manifest, context_len, stats, budget, ceiling=previous, **kw)


def candidates(profile, manifest, context_len: int, stats=None, *, calibration: Mapping | None = None,
               drafters: Sequence[str] | None = None, tree_drafters: Sequence[str] = TREE_DRAFTERS,
               max_k: int = MAX_CHAIN, max_nodes: int = MAX_NODES, sampling: bool = False,
               min_call: int = 1, capacity: int | None = None) -> list[Candidate]:
    """Every plan the planner considers (plain decoding first), with predicted tokens/s and footprint (computed
    on first access), no budget applied: for sweeps (edge-profile) and the lower bounds."""
    _check_profile(profile, manifest)
    setup = _setup(profile, manifest, stats, calibration, min_call, capacity)
    drafters = tuple(drafters) if drafters is not None else DEFAULT_DRAFTERS
    plain, cands = _enumerate(profile, setup, context_len, drafters, tree_drafters, max_k, max_nodes, sampling)
    return [plain] + cands


def min_budget_plain(manifest, context: int, profile=None, *, calibration: Mapping | None = None,
                     min_call: int = 1, capacity: int | None = None) -> float:
    """The smallest budget (MB) that runs plain decoding at `context`."""
    return candidates(profile, manifest, context, calibration=calibration, drafters=("none",),
                      min_call=min_call, capacity=capacity)[0].peak_mb


def min_budget_speculative(manifest, context: int, stats=None, profile=None, **kw) -> float | None:
    """The smallest budget (MB) at which some speculative plan is predicted faster than plain decoding (SpecMemo's
    lower bound on memory that still retains a speedup); None if no candidate beats plain decoding."""
    cs = candidates(profile, manifest, context, stats, **kw)
    plain, rest = cs[0], cs[1:]
    faster = [c.peak_mb for c in rest if c.tokens_per_s > plain.tokens_per_s * (1 + 1e-9)]
    return min(faster) if faster else None


def _best_k(expected, verify_ms, draft_ms_per_token: float, min_call: int) -> tuple[int, float]:
    """expected[K-1] = E[accepted | K drafted]: the K (0 = do not draft) with the most tokens per ms. A loop over
    at most a few dozen K in plain Python: it runs every decode step, between ONNX Runtime calls that leave every
    cache cold, where numpy's per-call dispatch costs more than the arithmetic."""
    plain = 1.0 / verify_ms(max(1, min_call))
    best, best_rate = 0, plain
    for k, e in enumerate(expected.tolist() if isinstance(expected, np.ndarray) else expected, 1):
        rate = (1.0 + e) / (k * draft_ms_per_token + verify_ms(max(k + 1, min_call)))
        if rate > best_rate:
            best, best_rate = k, rate
    return best, best_rate


def best_chain(stats: AcceptanceStats, verify_ms, draft_ms_per_token: float = 0.0, max_k: int = MAX_CHAIN,
               min_call: int = 1) -> tuple[int, float]:
    """The per-step choice: the chain length K (0 = do not draft) maximizing expected tokens per millisecond,
    (1 + E[accepted | K]) / (K · t_draft + t_verify(max(K + 1, min_call))), with E from the online acceptance
    statistics and t_verify a latency curve (callable S → ms); → (K, its tokens per ms). Runs every decode step:
    vectorized over K."""
    if max_k <= 0:
        return _best_k(np.zeros(0), verify_ms, draft_ms_per_token, min_call)
    a = stats.table()[:, 0]  # acceptance at each depth for the rank-0 (chain) candidate
    depth = np.minimum(np.arange(max_k), len(a) - 1)
    return _best_k(stats.draft_rate * np.cumsum(np.cumprod(a[depth])), verify_ms, draft_ms_per_token, min_call)


def best_prefix(token_probs, verify_ms, min_call: int = 1) -> tuple[int, float]:
    """`best_chain` for a drafted chain whose tokens each carry their own conditional acceptance probability
    (`memory.acceptance.TokenAcceptance`): E[accepted | K] = sum_{k<=K} prod_{j<=k} p_j."""
    expected, run, total = [], 1.0, 0.0
    for p in token_probs:  # cumulative sums of cumulative products, as np.cumsum(np.cumprod(...)) in float64
        run *= float(p)
        total += run
        expected.append(total)
    return _best_k(expected, verify_ms, 0.0, min_call)


def best_chain_length(stats: AcceptanceStats, verify_ms, draft_ms_per_token: float = 0.0, max_k: int = MAX_CHAIN,
                      min_call: int = 1) -> int:
    """`best_chain`'s K alone."""
    return best_chain(stats, verify_ms, draft_ms_per_token, max_k, min_call)[0]
