"""memory.planner: the choice against a brute-force sweep written here, budgets, the shrinking order as the context
grows, the BudgetError message, static shape buckets, lower bounds, and plans on every shipped device profile; latency
curves and their calibration errors, candidates priced by hand (padded calls, shape buckets), ties and re-planning,
and the per-step chain length against a brute-force search."""
from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from devices import check_available, list_profiles, load_profile
from edge.manifest import Manifest
from helpers import SMOLLM2, chain_acc, smollm2_manifest
from memory import (MB, AcceptanceStats, BudgetError, LatencyCurve, Plan, PlanError, Speculation, candidates,
                    min_budget_plain, min_budget_speculative, plan, predict_peak, replan)
from memory.footprint import DEFAULT_CALIBRATIONS, Calibration
from memory.planner import (DEFAULT_T1_MS, DEFAULT_VERIFY_SHAPE, Latency, best_chain, best_prefix, export_verify_shape,
                            fullest, plain_call_rows)

M = smollm2_manifest()
DRAFT = "drafter-l2-v8192"
TARGET_MS = [[1, 10.0], [2, 10.5], [4, 11.0], [8, 13.0], [16, 16.0], [32, 30.0], [64, 60.0]]
DRAFT_MS = [[1, 0.8], [4, 1.0], [16, 2.0]]
CAL = {"latency": {"target": TARGET_MS, "drafters": {DRAFT: DRAFT_MS}, "lookup_ms": 0.1, "recycling_ms": 0.2,
                   "overhead_ms": 0.3}}
ALL = ("none", "lookup", "recycling", "model")  # + "hybrid" where a test says so


def stats():
    return {"lookup": AcceptanceStats(0.6, draft_rate=0.8), "recycling": AcceptanceStats(0.45, rank_decay=0.5),
            DRAFT: AcceptanceStats([0.9, 0.85, 0.8, 0.75, 0.7])}


def interp(table, s):  # the test's own latency model: linear between points, proportional beyond the last
    xs, ys = zip(*table)
    return float(np.interp(s, xs, ys)) if s <= xs[-1] else ys[-1] * s / xs[-1]


# ------------------------------------------------------------------------------------------- latency
def test_default_latency_curve():
    c = LatencyCurve.scaled(DEFAULT_T1_MS)
    assert c(1) == 9.0 and c(8) == pytest.approx(15.3) and c(16) == pytest.approx(19.8)
    assert c(4) == pytest.approx(9.0 * (1 + 0.7 * 3 / 7))  # interpolated
    assert c(32) == pytest.approx(19.8 * 2)  # compute-bound beyond the last point
    lat = Latency.from_calibration(M)  # no calibration: the manifest's export-time t(1) values
    assert lat.target(1) == 29.458 and lat.drafters[DRAFT](1) == 0.872
    with pytest.raises(ValueError, match="unknown latency calibration key"):
        Latency.from_calibration(M, {"targets": []})
    with pytest.raises(ValueError, match="distinct S"):
        LatencyCurve(((0, 1.0),))
    for rows in (1.9, True):  # a fractional or boolean row count was truncated to 1
        with pytest.raises(ValueError, match="distinct S"):
            LatencyCurve(((rows, 1.0), (8, 2.0)))
    assert LatencyCurve(((1.0, 3.0), (8, 5.0))).points == ((1, 3.0), (8, 5.0))  # JSON's 1.0 is one row


def test_export_measured_curve_shapes_the_default():
    """A manifest with the export's latency_ms_by_s: the planner's curve follows its shape (noise flattened to
    non-decreasing) scaled to latency_ms_s1; without it, the default shape."""
    from dataclasses import replace

    from memory.planner import DEFAULT_VERIFY_SHAPE, export_verify_shape

    by_s = [10.0, 11.0, 10.5, 12.0, 13.0, 13.5, 14.0, 16.0]
    assert export_verify_shape({"latency_ms_by_s": by_s}) == tuple(
        (i + 1, r) for i, r in enumerate([1.0, 1.1, 1.1, 1.2, 1.3, 1.35, 1.4, 1.6]))
    assert export_verify_shape({}) == export_verify_shape({"latency_ms_by_s": [5.0]}) == DEFAULT_VERIFY_SHAPE
    t = M.target
    m = replace(M, graphs=tuple(replace(g, stats={**t.stats, "latency_ms_s1": 20.0, "latency_ms_by_s": by_s})
                                if g.role == "target" else g for g in M.graphs))
    lat = Latency.from_calibration(m)
    assert lat.target(1) == 20.0 and lat.target(8) == pytest.approx(32.0) and lat.target(3) == pytest.approx(22.0)


def test_export_measured_contexts_price_long_chats_without_a_calibration():
    """An export that timed the target at two contexts (latency_ms_by_s_at): without a calibration the planner's
    target curve is the shorter one, and it interpolates between the two (extending beyond at their slope); a
    calibration's own target curve replaces both; malformed or single-context figures leave the export's one-call
    curve (latency_ms_s1 times its shape) at every context, as before."""
    from dataclasses import replace

    from memory.planner import export_contexts

    def with_stats(**stats):
        return replace(M, graphs=tuple(replace(g, stats={**g.stats, **stats}) if g.role == "target" else g
                                       for g in M.graphs))

    short, long = [10.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0], [20.0, 24.0, 25.0, 27.0, 29.0, 31.0, 33.0, 36.0]
    base = {"latency_ms_s1": 5.0, "latency_ms_by_s": [5.0, 6.0]}  # the numpy-fed one-call curve, not used here
    m = with_stats(**base, latency_ms_by_s_at=[[1024, long], [128, short]])
    lat = Latency.from_calibration(m)
    assert lat.context == 128 and [c for c, _ in lat.target_at] == [1024]
    half = 128 + (1024 - 128) // 2  # 576: halfway, so each point is the mean of the two curves
    for s in range(1, 9):
        assert lat.target_for(128)(s) == pytest.approx(short[s - 1])
        assert lat.target_for(1024)(s) == pytest.approx(long[s - 1])
        assert lat.target_for(half)(s) == pytest.approx((short[s - 1] + long[s - 1]) / 2)
    assert lat.target_for(1024 + 896)(1) == pytest.approx(2 * long[0] - short[0])  # their slope, beyond
    own = Latency.from_calibration(m, {"target": [[1, 7.0], [8, 9.0]]})  # a calibration measured on this host
    assert own.target_for(4096)(1) == 7.0 and own.context is None and own.target_at == ()
    assert Latency.from_calibration(m, {"context": 300}).target(1) == 5.0  # a context for the one-call curve
    for bad in ([[128, short]], [[128, short], [128, long]], [[128, short], [1024, long[:1]]],
                [["128", short], [1024, long]], [[128, short], [1024, [1.0, -2.0]]], [[True, short], [1024, long]],
                {"128": short, "1024": long}, [], None, [[128, short], [1024, [1.0, float("nan")]]]):
        assert export_contexts({**base, "latency_ms_by_s_at": bad}) == [], bad
        lat = Latency.from_calibration(with_stats(**base, latency_ms_by_s_at=bad))
        assert lat.target_for(4096)(1) == lat.target_for(128)(1) == 5.0 and lat.target(2) == pytest.approx(6.0)


def test_a_drafter_is_priced_from_its_engine_way_timing_at_export():
    """A drafter graph the export timed the engine's way (latency_ms_by_s_at, one context) is priced from that
    curve, on the target's scale, not from its numpy-fed latency_ms_s1; a calibration's own curve of it wins;
    unusable figures leave latency_ms_s1 times the default shape."""
    from dataclasses import replace

    from memory.planner import export_contexts

    def with_drafter(**stats):
        return replace(M, graphs=tuple(replace(g, stats={**g.stats, **stats}) if g.name == DRAFT else g
                                       for g in M.graphs))

    way = [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0]
    m = with_drafter(latency_ms_s1=9.0, latency_ms_by_s_at=[[128, way]])
    stats = next(g for g in m.drafters if g.name == DRAFT).stats
    assert export_contexts(stats, least=1) == [(128, [[s, x] for s, x in enumerate(way, 1)])]
    assert export_contexts(stats) == []  # the target's need two contexts
    lat = Latency.from_calibration(m)
    assert [lat.drafters[DRAFT](s) for s in range(1, 9)] == way and lat.drafters[DRAFT](16) == 12.0
    assert Latency.from_calibration(m, CAL["latency"]).drafters[DRAFT](1) == 0.8
    for bad in ([], [[128, way[:1]]], [[0, way]], [[128, [1.0, float("inf")]]], "fast"):
        lat = Latency.from_calibration(with_drafter(latency_ms_s1=9.0, latency_ms_by_s_at=bad))
        assert lat.drafters[DRAFT](1) == 9.0, bad


def test_latency_grows_with_the_context_between_measured_contexts():
    """Curves measured at several contexts: linear in the context between them, extended past the last at the
    growth per token between the first and the last (never downward), flat below the first; one context (or none
    recorded): the same curve at any context."""
    short, mid, long = [[1, 10.0], [8, 14.0]], [[1, 20.0], [8, 30.0]], [[1, 30.0], [8, 44.0]]
    lat = Latency.from_calibration(M, {"target": short, "context": 256,
                                       "target_at": [[2048, long], [1024, mid]]})
    for ctx, want in [(1, short), (256, short), (640, [[1, 15.0], [8, 22.0]]), (1024, mid),
                      (1536, [[1, 25.0], [8, 37.0]]), (2048, long),
                      (3072, [[1, 30.0 + 1024 * 20 / 1792], [8, 44.0 + 1024 * 30 / 1792]])]:
        c = lat.target_for(ctx)
        for s, ms in want:
            assert c(s) == pytest.approx(ms), (ctx, s)
    assert lat.target_for(1024)(4) == pytest.approx(interp(mid, 4))  # rows in between: each curve's own shape
    assert lat.target_for(1024)(16) == pytest.approx(60.0)  # beyond the last row measured: proportional to S
    falls = Latency.from_calibration(M, {"target": short, "context": 256,
                                         "target_at": [[1024, [[1, 9.0], [8, 20.0]]]]})
    assert falls.target_for(1024)(1) == 9.0 and falls.target_for(4096)(1) == 9.0  # never extrapolated downward
    assert falls.target_for(4096)(8) == pytest.approx(14.0 + 6.0 * (4096 - 256) / 768)
    for cal in ({"target": short, "context": 256}, {"target": short}):
        one = Latency.from_calibration(M, cal)
        assert one.target_for(8000) is one.target


def test_latency_by_context_never_prices_a_wider_call_cheaper():
    """Measured medians are noisy (±20% here): one 8-row median at 2,048 tokens 13% low made the extrapolated curve
    at 4,096 price 8 rows below 4 (the difference of two noisy curves, magnified), and the planner bought them."""
    c256 = [[1, 16.0], [4, 21.4], [8, 30.8], [16, 45.8]]
    c1024 = [[1, 20.9], [4, 27.0], [8, 40.9], [16, 62.4]]
    c2048 = [[1, 31.9], [4, 47.5], [8, 52.0], [16, 85.6]]
    lat = Latency.from_calibration(M, {"target": c256, "context": 256, "target_at": [[1024, c1024], [2048, c2048]]})
    for ctx in (100, 700, 2048, 4096, 8192):
        c = lat.target_for(ctx)
        assert all(c(s) <= c(s + 1) for s in range(1, 40)), ctx
    noisy = Latency.from_calibration(M, {"target": [[1, 10.0], [2, 9.0], [4, 12.0]]})
    assert [noisy.target_for(256)(s) for s in (1, 2, 3, 4)] == [10.0, 10.0, 11.0, 12.0]


@pytest.mark.parametrize("latency,needle", [
    ({"target_at": [[1024, [[1, 20.0]]]]}, "needs the target curve and the context"),
    ({"target": [[1, 10.0]], "target_at": [[1024, [[1, 20.0]]]]}, "needs the target curve and the context"),
    ({"target": [[1, 10.0]], "context": 0}, "context must be a whole number"),
    ({"target": [[1, 10.0]], "context": True}, "context must be a whole number"),
    ({"target": [[1, 10.0]], "context": 256, "target_at": {"1024": [[1, 20.0]]}}, "target_at: \\[\\[context"),
    ({"target": [[1, 10.0]], "context": 256, "target_at": [[1024]]}, "target_at: \\[\\[context"),
    ({"target": [[1, 10.0]], "context": 256, "target_at": {}}, "target_at: \\[\\[context"),
    ({"target": [[1, 10.0]], "context": 256, "target_at": [[1024, [[1, -2.0]]]]}, "target_at\\[1024\\]"),
    ({"target": [[1, 10.0]], "context": 256, "target_at": [[256, [[1, 20.0]]]]}, "distinct whole contexts"),
    ({"target": [[1, 10.0]], "context": 256, "target_at": [["1024", [[1, 20.0]]]]}, "distinct whole contexts"),
])
def test_latency_by_context_is_checked(latency, needle):
    with pytest.raises(ValueError, match=needle):
        Latency.from_calibration(M, latency)


def test_plans_are_priced_at_their_own_context():
    """With curves measured at two contexts the planner prices each plan at the context it is made for: tokens/s
    falls as the context grows, and a verify row's growing share moves the choice."""
    st = {"lookup": AcceptanceStats(0.5, draft_rate=1.0)}
    flat_rows = [[1, 10.0], [2, 10.2], [16, 13.0], [64, 30.0]]  # short context: extra rows nearly free
    dear_rows = [[1, 40.0], [2, 52.0], [16, 220.0], [64, 800.0]]  # long context: each row reads the whole cache
    cal = {"latency": {"target": flat_rows, "context": 256, "target_at": [[4000, dear_rows]], "lookup_ms": 0.0}}
    short = plan(None, M, 256, st, budget_mb=10_000, calibration=cal, drafters=("none", "lookup"))
    long = plan(None, M, 4000, st, budget_mb=10_000, calibration=cal, drafters=("none", "lookup"))
    assert short.tokens_per_s > 2 * long.tokens_per_s
    assert long.nodes < short.nodes and long.tokens_per_s == pytest.approx(
        max(1000 * (1 + sum(0.5 ** d for d in range(1, k + 1))) / interp(dear_rows, k + 1) for k in range(1, 17)))
    same = {"latency": {"target": flat_rows, "lookup_ms": 0.0}}  # one context: priced alike at any context
    assert plan(None, M, 4000, st, budget_mb=10_000, calibration=same, drafters=("none", "lookup")).nodes == short.nodes


def test_latency_curves_reject_free_calls_and_repeated_widths():
    """A 0 ms point makes tokens/s infinite (a 0 ms plain step divides by zero); two points for one width make the
    interpolation divide by zero between them."""
    with pytest.raises(ValueError, match="distinct S"):
        LatencyCurve(((1, 0.0), (8, 4.0)))
    with pytest.raises(ValueError, match="distinct S"):
        LatencyCurve(((1, 5.0), (1, 6.0), (8, 9.0)))
    with pytest.raises(ValueError, match="latency target"):
        Latency.from_calibration(M, {"target": [[1, 10.0], [4, 12.0], [4, 11.0]]})

def test_export_shape_ignores_timings_that_are_not_positive():
    assert export_verify_shape({"latency_ms_by_s": [0.0, 5.0, 6.0]}) == DEFAULT_VERIFY_SHAPE
    assert export_verify_shape({"latency_ms_by_s": [5.0, 0.0, 6.0]}) == DEFAULT_VERIFY_SHAPE
    assert export_verify_shape({"latency_ms_by_s": [4.0, 5.0]}) == ((1, 1.0), (2, 1.25))

@pytest.mark.parametrize("latency,needle", [
    ({"lookup_ms": True}, "lookup_ms must be a finite number"),
    ({"overhead_ms": math.inf}, "overhead_ms must be a finite number"),
    ({"context": 256, "target_at": [[1024, [[1, 20.0]]]]}, "needs the target curve"),  # a context but no target
])
def test_latency_calibration_errors(latency, needle):
    with pytest.raises(ValueError, match=needle):
        Latency.from_calibration(M, latency)

def test_an_untimed_drafter_is_priced_as_the_target_scaled_by_its_layers():
    d = copy.deepcopy(SMOLLM2)
    d["graphs"][1]["stats"] = {"top1_agreement": 0.5}  # no latency_ms_s1 measured at export
    lat = Latency.from_calibration(Manifest.from_dict(d), {"target": [[1, 12.0], [8, 20.0]]})
    t1 = 12.0 * 2 / 30  # a 2-layer drafter beside a 30-layer target
    assert lat.drafters[DRAFT](1) == pytest.approx(t1)
    assert lat.drafters[DRAFT](8) == pytest.approx(t1 * 1.7)  # the default shape


# ------------------------------------------------------------------------------------------- brute force
def brute_force_chains(ctx, budget_mb, st):
    """Every drafter x K in 1..16 as chains, scored with formulas written out here; → (drafter, K, tok/s)."""
    lat = CAL["latency"]
    over = lat["overhead_ms"]
    t1 = interp(TARGET_MS, 1)
    best = ("none", 0, 1000 / (t1 + over))
    for drafter, graph in (("lookup", None), ("recycling", None), ("model", DRAFT)):
        s = st[graph or drafter]
        a = [s.rate[d, 0] for d in range(16)]
        h = s.draft_rate
        for k in range(1, 17):
            acc = h * sum(np.prod(a[:d]) for d in range(1, k + 1))
            draft = {"lookup": lat["lookup_ms"], "recycling": lat["recycling_ms"],
                     "model": k * interp(lat["drafters"][DRAFT], 1)}[drafter]
            step = draft + h * interp(TARGET_MS, k + 1) + (1 - h) * t1 + over
            tps = 1000 * (1 + acc) / step
            peak = predict_peak(M, Speculation(drafter, k, graph), ctx).total_mb
            if peak <= budget_mb and tps > best[2] + 1e-9:
                best = (drafter, k, tps)
    return best


@pytest.mark.parametrize("ctx", [256, 2048, 6000])
@pytest.mark.parametrize("extra_mb", [0.5, 2, 20, 60, 1000])
def test_plan_matches_brute_force_sweep(ctx, extra_mb):
    st = stats()
    budget = min_budget_plain(M, ctx) + extra_mb
    p = plan(None, M, ctx, st, budget, calibration=CAL, drafters=ALL, tree_drafters=())
    drafter, k, tps = brute_force_chains(ctx, budget, st)
    assert (p.drafter, p.k) == (drafter, k)
    assert p.tokens_per_s == pytest.approx(tps)
    assert p.peak_mb <= budget
    assert p.peak_mb == pytest.approx(predict_peak(M, p, ctx).total_mb)  # the plan is its own footprint spec


def test_plan_with_trees_matches_brute_force_over_node_budgets():
    st = stats()
    ctx, budget = 1024, 2000.0
    p = plan(None, M, ctx, st, budget, calibration=CAL, drafters=("none", "recycling"), max_k=8, max_nodes=8)
    s, lat = st["recycling"], CAL["latency"]
    best = (0.0, None)
    for n in range(1, 9):
        for shape in {s.best_first(n), s.best_first(n).__class__.chain(n)}:  # best-first trees are optimal
            tps = 1000 * (1 + s.expected_accepted(shape)) / (lat["recycling_ms"] + interp(TARGET_MS, n + 1) + 0.3)
            best = max(best, (tps, shape), key=lambda x: x[0])
    assert p.tokens_per_s == pytest.approx(best[0])
    assert p.parents == best[1].parents and p.tree == ("chain" if best[1].is_chain else "best-first")
    assert p.expected_accepted == pytest.approx(s.expected_accepted(best[1]))


# ------------------------------------------------------------------------------------------- budget
def test_over_budget_candidates_are_dropped_and_named():
    st = stats()
    ctx = 1024
    free = plan(None, M, ctx, st, 4000, calibration=CAL, drafters=ALL, tree_drafters=())
    assert free.drafter == "model"  # the best drafter when memory is no object
    tight = plan(None, M, ctx, st, free.plain_peak_mb + 5, calibration=CAL, drafters=ALL, tree_drafters=())
    assert tight.drafter in ("lookup", "recycling") and tight.peak_mb <= free.plain_peak_mb + 5
    assert "over budget: " in tight.reason and "model drafter" in tight.reason


def test_budget_error_states_required_and_available():
    need = min_budget_plain(M, 4096)
    with pytest.raises(BudgetError) as e:
        plan(None, M, 4096, budget_mb=300)
    msg = str(e.value)
    assert f"{need:.1f} MB" in msg and "300.0 MB" in msg and "--budget-mb" in msg
    assert e.value.required_mb == pytest.approx(need) and e.value.available_mb == 300
    fits = int(msg.split("fits up to context ")[1].split(";")[0])
    assert min_budget_plain(M, fits) <= 300 < min_budget_plain(M, fits + 1)
    with pytest.raises(BudgetError, match="weights alone"):
        plan(None, M, 4096, budget_mb=100)


def test_budget_error_never_shows_two_equal_numbers():
    msg = str(BudgetError(377.2149, 377.2, 100))  # one byte-ish under: more digits, not "377.2 but 377.2"
    assert "needs 377.21 MB" in msg and "budget is 377.20 MB" in msg and "at least 378" in msg
    assert "needs 400.0 MB but the memory budget is 300.0 MB" in str(BudgetError(400.04, 300, 100))


def test_max_context_is_the_last_context_that_fits():
    p = plan(None, M, 1000, stats(), 420, calibration=CAL, drafters=ALL)
    spec = p.speculation
    assert predict_peak(M, spec, p.max_context).total_mb <= 420 < predict_peak(M, spec, p.max_context + 1).total_mb
    p = plan(None, M, 1000, stats(), 5000, calibration=CAL)
    # the last context a 1-row call still fits in the positions the export's rotary tables cover
    assert p.max_context == M.target.max_len - 1
    # near it, speculation is still planned: the runtime drafts fewer tokens where the room runs out
    near = plan(None, M, M.target.max_len - 3, stats(), 5000, calibration=CAL, drafters=ALL)
    assert near.max_context == M.target.max_len - 1 and near.drafter != "none"


def test_replanning_shrinks_tree_then_k_then_drafter_then_plain():
    """As the context grows under a fixed budget, each re-plan is no bigger than the last: same drafter with no
    more nodes (never a tree after a chain), or a cheaper drafter; finally plain decoding, then BudgetError."""
    cal = {"latency": {"target": [[1, 10.0], [16, 11.0], [64, 13.0]], "drafters": {DRAFT: [[1, 0.05], [64, 0.2]]},
                       "lookup_ms": 0.1, "recycling_ms": 0.2}}
    st = {"lookup": AcceptanceStats(0.5, draft_rate=0.7), "recycling": AcceptanceStats(0.55, rank_decay=0.6),
          "hybrid": AcceptanceStats(0.6, rank_decay=0.6), DRAFT: AcceptanceStats(0.9)}
    kw = dict(calibration=cal, drafters=ALL + ("hybrid",), tree_drafters=("recycling", "hybrid", "model"))
    budget = 560.0
    rank = {"none": 0, "lookup": 1, "recycling": 2, "hybrid": 3, "model": 4}
    p = plan(None, M, 256, st, budget, **kw)
    seq = [p]
    with pytest.raises(BudgetError):
        for ctx in range(256, 8192, 16):
            p = replan(p, None, M, ctx, st, budget, **kw)
            assert p.peak_mb <= budget and p.context == ctx
            seq.append(p)
    for a, b in zip(seq, seq[1:]):
        if b.drafter != a.drafter:
            assert rank[b.drafter] < rank[a.drafter], (a.reason, b.reason)
        else:
            assert b.nodes <= a.nodes and not (a.tree == "chain" and b.tree == "best-first"), (a.reason, b.reason)
    stages = [(p.drafter, p.tree) for p in seq]
    kinds = list(dict.fromkeys(stages))
    # lookup and recycling state is held whatever runs, so a short hybrid chain costs little more than plain
    # decoding: the budget runs out soon after it
    assert kinds[0] == ("model", "best-first") and rank[kinds[-1][0]] < rank["model"] and kinds[-1][1] != "best-first"
    assert ("model", "chain") in kinds  # the tree gave way to a chain before the drafter changed
    assert ("hybrid", "best-first") in kinds  # cheaper drafters on the way down
    sizes = [p.nodes for p in seq if p.drafter == "hybrid"]
    assert len(set(sizes)) > 5 and sizes == sorted(sizes, reverse=True)  # the tree shrank step by step
    assert "re-planned from" in seq[-1].reason  # it says what it gave up


def test_preallocated_capacity():
    """An engine that preallocated 4096 slots: KV memory is fixed, and no plan may outgrow the buffer."""
    p = plan(None, M, 1000, stats(), 5000, calibration=CAL, drafters=ALL, capacity=4096)
    assert p.max_context == 4096 - 1  # drafts shrink near the end; a 1-row call still fits
    assert p.peak_mb == pytest.approx(predict_peak(M, p, 1000, capacity=4096).total_mb)
    assert p.peak_mb > plan(None, M, 1000, stats(), 5000, calibration=CAL, drafters=ALL).peak_mb


def test_plain_plan_fields():
    p = plan(None, M, 512, budget_mb=2000, drafters=("none",))
    assert (p.drafter, p.k, p.nodes, p.tree, p.speedup) == ("none", 0, 0, "none", 1.0)
    assert p.peak_mb == p.plain_peak_mb and p.extra_mb == 0 and p.verify_rows == 1
    json.dumps(p.to_dict())


# ------------------------------------------------------------------------------------------- static shapes
NPU = SimpleNamespace(name="test-npu", budget_mb=4000, device_class="npu", simulated=True, shape_buckets=(1, 4, 8, 16),
                      prefill_chunk=16, weight_precisions=("int8", "int4"), calibration={})


@pytest.mark.parametrize("extra_mb", [0.1, 1, 3, 10, 1000])
@pytest.mark.parametrize("trees", [(), ("recycling",)])
def test_static_buckets_are_respected(extra_mb, trees):
    budget = min_budget_plain(M, 2048, NPU) + extra_mb
    p = plan(NPU, M, 2048, stats(), budget, calibration=CAL, drafters=ALL, tree_drafters=trees)
    assert p.verify_rows in NPU.shape_buckets and p.nodes + 1 == p.verify_rows
    cs = candidates(NPU, M, 2048, stats(), calibration=CAL, drafters=ALL, tree_drafters=trees)
    assert {c.verify_rows for c in cs} <= set(NPU.shape_buckets)
    assert {c.speculation.nodes for c in cs[1:]} == {3, 7, 15}


def test_plain_decoding_pads_to_the_smallest_bucket():
    prof = SimpleNamespace(**{**vars(NPU), "shape_buckets": (4, 8, 16)})
    p = plan(prof, M, 256, budget_mb=2000, drafters=("none",), calibration=CAL)
    assert p.verify_rows == 4
    assert p.tokens_per_s == pytest.approx(1000 / (11.0 + 0.3))
    assert predict_peak(M, Speculation(), 256, verify_rows=4, prefill_chunk=16).total_mb == pytest.approx(p.peak_mb)


def test_precision_and_context_limits():
    with pytest.raises(PlanError, match="exported as fp32") as e:
        plan(NPU, smollm2_manifest(precision="fp32"), 256, budget_mb=4000)
    assert "edge-export --default -o DIR --precision" in str(e.value)  # how, for the embedded model
    with pytest.raises(PlanError, match="context 8192 and a 1-row call do not fit 8192 KV positions"):
        plan(None, M, 8192, budget_mb=4000)
    with pytest.raises(PlanError, match="do not fit 1024 KV positions"):
        plan(None, M, 1024, budget_mb=4000, capacity=1024)
    assert plan(None, M, 8191, budget_mb=4000).drafter != "none"  # the runtime drafts less in the last slots
    with pytest.raises(PlanError, match="no memory budget"):
        plan(None, M, 256)
    with pytest.raises(PlanError, match="drafter"):
        plan(None, M, 256, budget_mb=4000, drafters=("medusa",))


# ------------------------------------------------------------------------------------------- lower bounds
def test_lower_bounds():
    ctx, st = 2048, stats()
    plain = min_budget_plain(M, ctx)
    assert plain == pytest.approx(predict_peak(M, Speculation(), ctx).total_mb)
    spec = min_budget_speculative(M, ctx, st, calibration=CAL, drafters=ALL)
    assert plain < spec < plain + 5  # a K=1 chain costs little more than plain decoding
    assert plan(None, M, ctx, st, spec, calibration=CAL, drafters=ALL).speedup > 1
    below = plan(None, M, ctx, st, spec - 1e-3, calibration=CAL, drafters=ALL)
    assert below.drafter == "none" and below.speedup == 1.0
    hopeless = {k: AcceptanceStats(0.0, draft_rate=0.0) for k in ("lookup", "recycling", "hybrid", DRAFT)}
    assert min_budget_speculative(M, ctx, hopeless, calibration=CAL, drafters=ALL) is None


def test_default_priors_never_pick_a_drafter_that_rarely_agrees():
    """The embedded export's drafter agrees 2.6% of the time (manifest): it must not be chosen by default."""
    p = plan(None, M, 1024, budget_mb=4000)
    assert p.drafter != "model"


# ------------------------------------------------------------------------------------------- shipped devices
@pytest.mark.parametrize("name", list_profiles())
def test_every_shipped_profile_plans_within_its_budget(name):
    prof = check_available(load_profile(name), simulate=True)
    ctx = 2048
    p = plan(prof, M, ctx, stats(), calibration=CAL, drafters=ALL)
    assert p.peak_mb <= prof.budget_mb and p.budget_mb == prof.budget_mb
    if prof.shape_buckets:
        assert p.verify_rows in prof.shape_buckets
    # simulated profiles are CPU-backed, so their memory is modelled with the CPU calibration
    assert prof.simulated or prof.device_class == "cpu"  # no GPU/NPU provider on the test machines
    cpu = predict_peak(M, p, ctx, DEFAULT_CALIBRATIONS["cpu"], prefill_chunk=prof.prefill_chunk,
                       verify_rows=p.verify_rows)
    assert cpu.total_mb == pytest.approx(p.peak_mb)
    assert math.isfinite(p.tokens_per_s) and isinstance(p, Plan)


def test_best_chain_length_against_brute_force():
    from memory.acceptance import AcceptanceStats
    from memory.planner import LatencyCurve, best_chain_length

    curve = LatencyCurve(((1, 9.0), (8, 15.3), (16, 19.8)))
    for a in (0.0, 0.2, 0.5, 0.8, 0.95):
        st = AcceptanceStats(a)
        for draft_ms in (0.0, 1.0, 5.0):
            for min_call in (1, 2):
                got = best_chain_length(st, curve, draft_ms, 12, min_call)
                rates = [1.0 / curve(max(1, min_call))] + [
                    (1 + sum(a ** d for d in range(1, k + 1))) / (k * draft_ms + curve(max(k + 1, min_call)))
                    for k in range(1, 13)]
                assert got == int(np.argmax(rates)), (a, draft_ms, min_call)
    assert best_chain_length(AcceptanceStats(0.0), curve, 0.0, 12, 1) == 0  # nothing accepted: do not draft
    assert best_chain_length(AcceptanceStats(0.97), curve, 0.0, 12, 1) >= 8  # near-certain: long chains


# ------------------------------------------------------------------------------------------- calibration
def test_a_profiles_calibration_is_what_the_planner_uses():
    """edge-profile's JSON reaches the planner through the profile: measured acceptance changes the choice, the
    memory section shifts every predicted peak, and an explicit calibration= wins over the profile's."""
    flat = {"target": [[1, 10.0], [64, 10.5]], "lookup_ms": 0.01, "recycling_ms": 0.01}
    sure = {k: AcceptanceStats(0.95).to_dict() for k in ("lookup", "recycling", "hybrid", "model")}
    never = {k: AcceptanceStats(0.0, draft_rate=0.0).to_dict() for k in ("lookup", "recycling", "hybrid", "model")}
    prof = lambda cal: SimpleNamespace(name="host", budget_mb=4000, device_class="cpu", calibration=cal)  # noqa: E731
    hi = plan(prof({"latency": flat, "acceptance": sure}), M, 1024, drafters=ALL)
    lo = plan(prof({"latency": flat, "acceptance": never}), M, 1024, drafters=ALL)
    assert hi.drafter != "none" and hi.nodes >= 8 and lo.drafter == "none"
    heavy = plan(prof({"latency": flat, "acceptance": never, "memory": {"baseline_mb": 185.0}}), M, 1024,
                 drafters=ALL)
    assert heavy.peak_mb - lo.peak_mb == pytest.approx(185.0 - Calibration().baseline_mb)
    assert plan(prof({"acceptance": never}), M, 1024, drafters=ALL,
                calibration={"latency": flat, "acceptance": sure}).nodes == hi.nodes


def test_best_prefix_matches_brute_force():
    """Per-token acceptance probabilities: the prefix length with the most expected tokens per ms, by enumeration."""
    from memory.planner import best_prefix

    rng = np.random.default_rng(3)
    curve = lambda s: 10.0 + 0.9 * (s - 1)  # noqa: E731
    for _ in range(200):
        p = rng.uniform(0, 1, rng.integers(1, 10))
        rates = [1.0 / curve(1)] + [(1 + sum(np.prod(p[: j + 1]) for j in range(k))) / curve(k + 1)
                                    for k in range(1, len(p) + 1)]
        k, rate = best_prefix(p, curve)
        assert k == int(np.argmax(rates)) and rate == pytest.approx(max(rates))
    assert best_prefix([0.01, 0.9], curve)[0] == 0  # a weak first token: not worth a wider call
    assert best_prefix([0.99] * 6, curve)[0] == 6
    assert best_prefix([0.99] * 6, curve, min_call=8)[0] == 6  # a 7-wide call costs what the 8-wide minimum does


# ------------------------------------------------------------------------------------------- pricing by hand
def test_candidate_prices_with_padded_calls_by_hand():
    """min_call=2 (1-row calls padded to 2): plain decoding and each drafter call are priced as 2-row calls; a
    hybrid step pays both model-free drafters; every chain length up to max_k is a candidate."""
    st = {"hybrid": AcceptanceStats(0.5, draft_rate=0.6), DRAFT: AcceptanceStats([0.9, 0.8, 0.7])}
    cs = candidates(None, M, 1024, st, calibration=CAL, drafters=("none", "hybrid", "model"), tree_drafters=(),
                    max_k=5, max_nodes=5, min_call=2)
    plain, rest = cs[0], cs[1:]
    t_plain = interp(TARGET_MS, 2)
    assert plain.verify_rows == 2 and plain.step_ms == pytest.approx(t_plain + 0.3)
    got = {(c.speculation.drafter, c.speculation.nodes): c for c in rest}
    assert set(got) == {(d, k) for d in ("hybrid", "model") for k in range(1, 6)}
    for k in range(1, 6):
        h = got["hybrid", k]
        step = 0.1 + 0.2 + 0.6 * interp(TARGET_MS, k + 1) + 0.4 * t_plain + 0.3
        assert h.step_ms == pytest.approx(step)
        assert h.tokens_per_s == pytest.approx(1000 * (1 + chain_acc([0.5] * 5, k, 0.6)) / step)
        m = got["model", k]
        step = k * interp(DRAFT_MS, 2) + interp(TARGET_MS, max(k + 1, 2)) + 0.3
        assert m.step_ms == pytest.approx(step)
        assert m.expected_accepted == pytest.approx(chain_acc([0.9, 0.8, 0.7, 0.7, 0.7], k))


def test_model_drafter_tree_calls_are_padded_to_the_buckets():
    st = {DRAFT: AcceptanceStats(0.5, rank_decay=0.9)}  # two strong candidates per depth: bushy trees
    cs = candidates(NPU, M, 512, st, calibration=CAL, drafters=("none", "model"), tree_drafters=("model",))
    bucket = lambda s: min(b for b in NPU.shape_buckets if b >= s)  # noqa: E731
    assert any(max(c.shape.widths) != bucket(max(c.shape.widths)) for c in cs[1:])  # some width is padded
    for c in cs[1:]:
        assert c.speculation.draft_width == bucket(max(c.shape.widths))
        assert c.step_ms == pytest.approx(sum(interp(DRAFT_MS, bucket(w)) for w in c.shape.widths)
                                          + interp(TARGET_MS, c.verify_rows) + 0.3)


# ------------------------------------------------------------------------------------------- the choice
def test_a_budget_of_exactly_the_peak_fits():
    """The budget is a bound the plan may reach: plain decoding at exactly its peak plans, and max_context is
    the last context whose peak equals the budget."""
    ctx = 1000
    peak = predict_peak(M, Speculation(), ctx).total_bytes
    p = plan(None, M, ctx, budget_mb=peak / MB, drafters=("none",))
    assert p.drafter == "none" and p.max_context == ctx and p.peak_mb == peak / MB
    at = predict_peak(M, Speculation(), 3000).total_bytes
    assert predict_peak(M, Speculation(), 3001).total_bytes > at
    assert plan(None, M, ctx, budget_mb=at / MB, drafters=("none",)).max_context == 3000


def test_no_speculation_without_a_gain():
    """A drafter that never drafts and costs nothing ties plain decoding: not worth its memory."""
    st = {"lookup": AcceptanceStats(0.5, draft_rate=0.0)}
    cal = {"latency": {**CAL["latency"], "lookup_ms": 0.0}}
    p = plan(None, M, 1024, st, 4000, calibration=cal, drafters=("none", "lookup"))
    assert p.drafter == "none" and p.speedup == 1.0


def test_ties_go_to_the_smaller_plan():
    """Only depth 1 is ever accepted and extra verify rows are free: every K earns the same, so K = 1."""
    st = {"lookup": AcceptanceStats([0.5, 0.0])}
    cal = {"latency": {"target": [[1, 10.0], [64, 10.0]], "lookup_ms": 0.1}}
    p = plan(None, M, 1024, st, 4000, calibration=cal, drafters=("none", "lookup"))
    assert (p.drafter, p.k) == ("lookup", 1)
    assert p.tokens_per_s == pytest.approx(1000 * 1.5 / 10.1)


def test_passed_stats_beat_the_calibrations_and_a_graphs_own_beat_model():
    flat = {"target": [[1, 10.0], [64, 10.5]], "drafters": {DRAFT: [[1, 0.05]]}, "lookup_ms": 0.01}
    never = AcceptanceStats(0.0, draft_rate=0.0)
    sure = AcceptanceStats(0.95)
    cal = {"latency": flat, "acceptance": {"lookup": sure.to_dict()}}
    assert plan(None, M, 1024, None, 4000, calibration=cal, drafters=("none", "lookup")).drafter == "lookup"
    assert plan(None, M, 1024, {"lookup": never}, 4000, calibration=cal, drafters=("none", "lookup")).drafter == "none"
    # "model" stands for every drafter graph without stats of its own
    p = plan(None, M, 1024, {"model": never, DRAFT: sure}, 4000, calibration={"latency": flat},
             drafters=("none", "model"))
    assert p.drafter == "model" and p.expected_accepted == pytest.approx(chain_acc([0.95] * 64, p.k))


def test_replan_never_turns_a_chain_into_a_tree():
    st = {"recycling": AcceptanceStats(0.6, rank_decay=0.9)}
    kw = dict(calibration=CAL, drafters=("none", "recycling"))
    chain = plan(None, M, 1024, st, 4000, tree_drafters=(), **kw)
    assert (chain.drafter, chain.tree) == ("recycling", "chain")
    assert plan(None, M, 1024, st, 4000, **kw).tree == "best-first"  # a tree is better when allowed
    again = replan(chain, None, M, 1024, st, 4000, **kw)
    assert again.tree == "chain" and again.nodes <= chain.nodes
    assert again.tokens_per_s == pytest.approx(chain.tokens_per_s)  # the same chain is still the best allowed


def test_replan_does_not_move_to_another_drafter_graph_of_the_same_size():
    d = copy.deepcopy(SMOLLM2)
    twin = copy.deepcopy(d["graphs"][1])
    twin["name"] = "drafter-twin"
    d["graphs"].append(twin)
    m2 = Manifest.from_dict(d)
    st = {DRAFT: AcceptanceStats(0.3), "drafter-twin": AcceptanceStats(0.95)}
    kw = dict(calibration={"latency": {"target": TARGET_MS}}, drafters=("none", "model"))
    assert plan(None, m2, 1024, st, 4000, **kw).draft_graph == "drafter-twin"
    prev = Plan(drafter="model", k=1, nodes=1, tree="chain", max_context=4000, peak_mb=0.0, tokens_per_s=1.0,
                reason="", draft_graph=DRAFT, budget_mb=4000.0)
    p = replan(prev, None, m2, 1024, st, **kw)
    assert p.nodes <= 1 and p.draft_graph in (None, DRAFT)


def test_plain_call_rows_and_the_fullest_context():
    buckets = SimpleNamespace(shape_buckets=(1, 4, 8))
    assert [plain_call_rows(buckets, m) for m in (1, 2, 4, 5)] == [1, 4, 4, 8]
    assert plain_call_rows(None, 3) == 3 and plain_call_rows(SimpleNamespace(shape_buckets=(2,)), 4) == 4
    assert fullest(256, 1) == 255 and fullest(256, 4) == 252 and fullest(3, 4) == 1


def test_plain_rows_follow_min_call_without_buckets():
    p = plan(None, M, 512, budget_mb=4000, drafters=("none",), calibration=CAL, min_call=3)
    assert p.verify_rows == 3 and p.tokens_per_s == pytest.approx(1000 / (interp(TARGET_MS, 3) + 0.3))


# ------------------------------------------------------------------------------------------- per-step choice
def _brute_chain(rates, h, curve, draft_ms, max_k, min_call):
    best = (0, 1.0 / curve(max(1, min_call)))
    for k in range(1, max_k + 1):
        r = (1 + chain_acc(rates, k, h)) / (k * draft_ms + curve(max(k + 1, min_call)))
        if r > best[1]:
            best = (k, r)
    return best


@pytest.mark.parametrize("min_call", [1, 4, 8])
@pytest.mark.parametrize("h", [1.0, 0.4])
def test_best_chain_with_draft_rate_min_call_and_a_short_table(min_call, h):
    """max_k beyond the statistics' depth reuses the last depth's rate; calls are padded to min_call; E[accepted]
    is scaled by the share of steps that draft."""
    curve = LatencyCurve(((1, 9.0), (8, 15.3), (16, 19.8)))
    for prior in ([0.9, 0.9, 0.3], [0.95, 0.9, 0.85], [0.6, 0.2, 0.9]):
        st = AcceptanceStats(prior, max_depth=3, draft_rate=h)
        rates = prior + [prior[-1]] * 9
        k, rate = best_chain(st, curve, 0.5, 12, min_call)
        want = _brute_chain(rates, h, curve, 0.5, 12, min_call)
        assert k == want[0] and rate == pytest.approx(want[1]), prior


def test_best_prefix_pays_for_the_padded_call():
    curve = lambda s: 10.0 + 2.0 * (s - 1)  # noqa: E731
    p = [0.9, 0.5, 0.2]
    for min_call in (1, 3, 6):
        rates = [1 / curve(max(1, min_call))] + [(1 + chain_acc(p, k)) / curve(max(k + 1, min_call))
                                                  for k in range(1, 4)]
        k, rate = best_prefix(p, curve, min_call)
        assert k == int(np.argmax(rates)) and rate == pytest.approx(max(rates))


def _with_drafter(agreement: float, latency_ms: float) -> Manifest:
    d = copy.deepcopy(SMOLLM2)
    d["graphs"][1]["stats"].update(top1_agreement=agreement, latency_ms_s1=latency_ms)
    return Manifest.from_dict(d)


@pytest.mark.parametrize("agreement,latency_ms,earns", [
    (0.997, 0.6 * 29.458, False),  # agrees, but costs most of a target call: free chains win (Gemma 3's case)
    (0.997, 0.02 * 29.458, True),  # agrees and is nearly free
    (0.5, 0.0, False),  # agrees less than free chains do
])
def test_auto_plans_a_model_drafter_only_where_it_earns_its_cost(agreement, latency_ms, earns):
    """A plan under `auto` weighs the model drafter against free chains as the engine's `auto` does without a plan
    (edge.planning.model_earns_its_cost); a plan for `--drafter model` still plans it."""
    from edge.planning import _drafter_caps, make_plan, model_earns_its_cost

    m = _with_drafter(agreement, latency_ms)
    curve = Latency.from_calibration(m, None).target_for(128)
    assert model_earns_its_cost(m, curve) is earns
    assert ("model" in _drafter_caps(m, "auto")["drafters"]) is earns
    assert "model" in _drafter_caps(m, "model")["drafters"]
    prof = SimpleNamespace(name="host", budget_mb=4000, device_class="cpu", calibration=None)
    if not earns:
        assert make_plan(m, prof, 1024, None).drafter != "model"
