"""Mutation audit of memory.planner, memory.footprint, memory.acceptance and devices: each test here pins a
behaviour a plausible one-line slip (a bound, a rounding, a dropped factor) would change while the rest of the
suite kept passing. Expected values are recomputed here from the documented formulas, not copied from a run."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import devices
from devices import ProfileError, load_profile, profile_from_dict
from edge.manifest import Manifest
from memory import (MB, AcceptanceStats, Calibration, LatencyCurve, Plan, Speculation, TreeShape, candidates,
                    kv_capacity, linear_bytes, plan, predict_peak, predict_weight_bytes, replan)
from memory.footprint import (DEFAULT_CALIBRATIONS, WeightBytes, block_min_extra, drafter_graph,
                              embedding_resident_bytes)
from memory.planner import (DEFAULT_VERIFY_SHAPE, Latency, best_chain, best_prefix, export_verify_shape, fullest,
                            plain_call_rows)
from helpers import SMOLLM2, smollm2_manifest

M = smollm2_manifest()
DRAFT = "drafter-l2-v8192"
TARGET_MS = [[1, 10.0], [2, 10.5], [4, 11.0], [8, 13.0], [16, 16.0], [32, 30.0], [64, 60.0]]
DRAFT_MS = [[1, 0.8], [4, 1.0], [16, 2.0]]
CAL = {"latency": {"target": TARGET_MS, "drafters": {DRAFT: DRAFT_MS}, "lookup_ms": 0.1, "recycling_ms": 0.2,
                   "overhead_ms": 0.3}}
NPU = SimpleNamespace(name="test-npu", budget_mb=4000, device_class="npu", simulated=True, shape_buckets=(1, 4, 8, 16),
                      prefill_chunk=16, weight_precisions=("int8", "int4"), calibration={})
CPU = DEFAULT_CALIBRATIONS["cpu"]


def interp(table, s):  # linear between points, flat below the first, proportional beyond the last
    xs, ys = zip(*table)
    return float(np.interp(s, xs, ys)) if s <= xs[-1] else ys[-1] * s / xs[-1]


def chain_acc(rates, k, h=1.0):  # E[accepted] of a K chain: h · sum_d prod_{j<=d} a_j
    return h * sum(math.prod(rates[:d]) for d in range(1, k + 1))


# ------------------------------------------------------------------------------------------- latency
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


# ------------------------------------------------------------------------------------------- planner pricing
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


# ------------------------------------------------------------------------------------------- planner choice
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


# ------------------------------------------------------------------------------------------- footprint
def test_linear_bytes_round_zero_points_and_skip_block_min_for_ragged_k():
    # K = 96: 3 blocks of 32; 4-bit zero points pack two per byte, so 2 bytes per output channel
    assert linear_bytes(96, 10, 4) == linear_bytes(96, 10, 4, block_min=False)
    assert linear_bytes(96, 10, 4).zero_points == 10 * 2 and linear_bytes(96, 10, 4).packed == 10 * 3 * 16
    # block minimums: ceil(blocks / 32) residual blocks, only for whole blocks (export.graph keeps ragged K plain)
    assert [block_min_extra(k, 32) for k in (576, 1024, 1056, 4096)] == [1, 1, 2, 4]
    assert linear_bytes(576, 8, 4, block_min=True).packed == 8 * (18 + 1) * 16
    assert linear_bytes(40, 8, 4, block_min=True) == linear_bytes(40, 8, 4)


def test_what_if_weights_for_biases_w8a8_quantized_embeddings_and_a_4bit_head():
    arch = {**SMOLLM2["arch"], "qkv_bias": True}
    hidden, q, kv, inter, layers, vocab = 576, 9 * 64, 3 * 64, 1536, 30, 49152
    w = predict_weight_bytes(arch, precision="fp32", block_min=False)
    assert w.other == layers * (q + 2 * kv) * 4
    w = predict_weight_bytes(SMOLLM2["arch"], precision="w8a8", block_min=False)
    per_layer = sum(k * n + n * 4 for k, n in ((hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)))
    assert w.body.total == layers * per_layer and w.head.total == hidden * vocab + vocab * 4
    w = predict_weight_bytes(SMOLLM2["arch"], precision="int4", embedding_bits=4)
    assert w.embedding_row == 18 * (16 + 4 + 1) and w.embedding == vocab * 18 * 21
    w = predict_weight_bytes(SMOLLM2["arch"], precision="int4", embedding_bits=4, zero_points=False)
    assert w.embedding_row == 18 * (16 + 4)
    # an int8 body with a 4-bit head: the head's block-sum matrix [hidden, 32 · extra] fp32 is the only one
    w = predict_weight_bytes(SMOLLM2["arch"], precision="int8", lm_head_bits=4, block_min=True)
    assert w.other == hidden * 32 * 1 * 4


def test_embedding_residency_windows():
    def occupancy(embedding, fault, distinct):
        windows = max(1, math.ceil(embedding / fault))
        return min(embedding, round(windows * -math.expm1(-distinct / windows) * fault))

    empty = WeightBytes(0, linear_bytes(32, 32, None), linear_bytes(32, 32, None), 0, 0, 0, 0)
    # rows wider than the fault-around window: a look-up maps at least its whole row
    w = replace(empty, embedding=1000 * 131072, embedding_row=131072)
    assert embedding_resident_bytes(w, CPU, 100) == occupancy(w.embedding, 131072, 100 ** 0.8)
    # a table that is not a whole number of windows: the last, partial window counts
    w = replace(empty, embedding=10 * 65536 + 4096, embedding_row=2304)
    assert embedding_resident_bytes(w, CPU, 3) == occupancy(w.embedding, 65536, 3 ** 0.8)
    cal = replace(CPU, embedding_distinct_coef=2.0)
    w = replace(empty, embedding=1728 * 65536, embedding_row=2304)
    assert embedding_resident_bytes(w, cal, 500) == occupancy(w.embedding, 65536, 2.0 * 500 ** 0.8)


def test_arena_and_bias_terms_by_hand():
    # context 100 < the 256-row prefill chunk: the prompt is one 100-row call
    fp = predict_peak(M, Speculation(), 100)
    assert fp["target.arena"] == 80 * 100 * 576 + 8 * 100 * 101
    assert fp["runtime.bias"] == 100 * 101 * 4
    # context 1: only 1-row calls, which reuse a view of the session's bias row
    assert predict_peak(M, Speculation(), 1)["runtime.bias"] == 0
    # a fixed arena (act_mb) is in MB
    cal = replace(CPU, act_mb=2.0)
    assert predict_peak(M, Speculation(), 100, cal)["target.arena"] == 2 * MB + 80 * 100 * 576 + 8 * 100 * 101
    # GPU: c·R·vocab counts the logits rows a call keeps (a prefill chunk keeps 1)
    gpu = DEFAULT_CALIBRATIONS["gpu"]
    fp = predict_peak(M, Speculation("lookup", 3), 2048, gpu)
    assert fp["target.arena"] == round(max(80 * 4 * 576 + 4 * 4 * 49152, 80 * 256 * 576 + 4 * 1 * 49152))


def test_model_drafter_calls_by_hand():
    """The drafter's call is its width + 1 rows (the accepted token and the draft), padded to min_call."""
    fp = predict_peak(M, Speculation("model", 4, DRAFT), 1)
    assert fp["drafter.arena"] == 80 * 2 * 576 + 8 * 2 * 3  # 2 rows over context 1 + 2
    fp = predict_peak(M, Speculation("model", 4, DRAFT), 1, min_call=2)
    assert fp["drafter.logits"] == 2 * 8192 * 4 and fp["drafter.arena"] == 80 * 3 * 576 + 8 * 3 * 4


def test_sampling_work_for_model_free_drafters_has_no_q():
    fp = predict_peak(M, Speculation("lookup", 4, sampling=True), 256)
    assert fp["verify.work"] == 5 * 49152 * 4


def test_calibration_bounds():
    with pytest.raises(ValueError, match="finite number >= 0"):
        Calibration(baseline_mb=math.inf)
    with pytest.raises(ValueError, match="finite number >= 0"):
        Calibration.from_dict({"session_mb": "inf"})
    assert Calibration(embedding_distinct_exp=1.0).embedding_distinct_exp == 1.0  # distinct = context: allowed


def test_the_default_drafter_is_the_best_agreeing_graph():
    d = copy.deepcopy(SMOLLM2)
    better = copy.deepcopy(d["graphs"][1])
    better.update(name="drafter-better", stats={"top1_agreement": 0.5})
    d["graphs"].append(better)
    m2 = Manifest.from_dict(d)
    assert drafter_graph(m2).name == "drafter-better"
    assert predict_peak(m2, Speculation("model", 2), 100) == predict_peak(m2, Speculation("model", 2, "drafter-better"),
                                                                          100)


def test_kv_capacity_is_the_wider_of_the_call_and_min_call():
    assert kv_capacity(100, Speculation("lookup", 7), min_call=4) == 108
    assert kv_capacity(100, Speculation("lookup", 2), min_call=4) == 104


# ------------------------------------------------------------------------------------------- acceptance
def test_draft_rate_counts_steps_that_drafted_not_steps_that_hit():
    s = AcceptanceStats(0.5, draft_rate=0.5, prior_weight=4.0)
    s.update(3, 0)  # drafted, all rejected: the drafter did propose
    assert s.draft_rate == pytest.approx(0.5 + 0.25 * 0.5)
    t = AcceptanceStats(0.5, draft_rate=0.5, prior_weight=4.0)
    t.update_tree([0], [])  # nothing offered at depth 1: no draft this step
    assert t.draft_rate == pytest.approx(0.5 - 0.25 * 0.5)


def test_tree_update_stops_at_the_rejected_depth():
    s = AcceptanceStats(0.4, rank_decay=0.5, prior_weight=4.0)
    s.update_tree(offered=[2, 2, 2], accepted_ranks=[])  # depth 1 missed: depths 2, 3 never tested
    assert s.rate[0, :2] == pytest.approx([0.4 - 0.1, 0.2 - 0.05])
    assert s.rate[1, :2].tolist() == [0.4, 0.2] and s.rate[2, :2].tolist() == [0.4, 0.2]


def test_depths_past_the_table_reuse_its_last_row():
    s = AcceptanceStats([0.9, 0.6], max_depth=2)
    s.update(5, 5)  # depths 3..5 are past the table: ignored, not an IndexError
    assert s.rate[0, 0] == pytest.approx(0.9 + 0.25 * 0.1) and s.rate[1, 0] == pytest.approx(0.6 + 0.25 * 0.4)
    assert s.accept_prob(7) == s.accept_prob(2) == pytest.approx(0.7)
    assert s.expected_accepted(4) == pytest.approx(chain_acc([0.925, 0.7, 0.7, 0.7], 4))
    assert s.expected_accepted(TreeShape("t", (0,), (s.max_rank,))) == 0.0  # ranks past the table: never


def test_best_first_uses_the_deepest_depth_and_never_zero_probability_nodes():
    s = AcceptanceStats(0.9, rank_decay=0.01, max_depth=3)
    t = s.best_first(4)  # 0.9, 0.81, 0.729 along the chain beat 0.009 for a second candidate
    assert t.depths == (1, 2, 3, 1)
    z = AcceptanceStats([0.5, 0.0], rank_decay=0.5)  # depth 2 never accepted: 4 candidates at depth 1 only
    assert z.best_first(10).depths == (1, 1, 1, 1)
    assert AcceptanceStats(0.0).best_first(3).name == "none"


def test_prefix_of_nothing_is_no_tree():
    t = AcceptanceStats(0.6).best_first(3)
    assert t.prefix(0).name == "none" and t.prefix(2).name == t.name
    assert TreeShape.chain(4).prefix(0) == TreeShape.chain(0)


@pytest.mark.parametrize("bad", [
    {"rate": [[0.5, 1.5]]},
    {"rate": [[0.5, 0.2]], "count": [[1.0]]},
])
def test_acceptance_entries_are_checked(bad):
    with pytest.raises(ValueError, match="acceptance"):
        AcceptanceStats.from_dict(bad)


def test_priors_must_be_probabilities():
    with pytest.raises(ValueError, match="priors must be in"):
        AcceptanceStats([0.5, 1.2])


def test_a_nan_prior_is_refused():
    with pytest.raises(ValueError, match="priors must be in"):
        AcceptanceStats([0.5, float("nan")])


def test_a_refused_tree_update_changes_nothing():
    s = AcceptanceStats(0.5)
    before = (s.rate.copy(), s.count.copy(), s.draft_rate, s.draft_count)
    with pytest.raises(ValueError, match="not among"):
        s.update_tree([2, 2], [0, 5])
    assert np.array_equal(s.rate, before[0]) and np.array_equal(s.count, before[1])
    assert (s.draft_rate, s.draft_count) == before[2:]


def test_round_trip_keeps_the_draft_count():
    s = AcceptanceStats(0.5, draft_rate=0.5)
    for drafted in (1, 0, 1, 1):
        s.update(drafted, 0)
    t = AcceptanceStats.from_dict(s.to_dict())
    assert t.draft_count == 4.0
    s.update(0, 0)
    t.update(0, 0)  # the next step weighs 1/(4 + 4), not 1/4 as for a fresh prior
    assert t.draft_rate == pytest.approx(s.draft_rate)


# ------------------------------------------------------------------------------------------- devices
def _cgroup(tmp_path, monkeypatch, own, files):
    from test_devices import fake_cgroup

    fake_cgroup(tmp_path, monkeypatch, own, files)
    return devices.cgroup_memory()


GIB = 1 << 30


@pytest.mark.parametrize("own,files,want", [
    # v1 writes "no limit" as a page-rounded 2^63: not a limit
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": str(2**63 - 4096), "memory/memory.usage_in_bytes": "1"}, None),
    # more inactive page cache than usage (counters read at different moments): the working set is 0, not < 0
    ("0::/\n", {"memory.max": str(GIB), "memory.current": str(100 << 20),
                "memory.stat": f"inactive_file {200 << 20}\n"}, (GIB, GIB)),
    # over the limit (the kernel is reclaiming): no room, not negative room
    ("0::/\n", {"memory.max": str(GIB), "memory.current": str(GIB + (64 << 20))}, (GIB, 0)),
    # cgroup v2 present without a limit is the answer: a stale v1 hierarchy is not consulted
    ("0::/\n4:memory:/\n", {"memory.max": "max", "memory.current": "1", "memory/memory.limit_in_bytes": str(GIB),
                            "memory/memory.usage_in_bytes": "1"}, None),
])
def test_cgroup_memory_edge_cases(tmp_path, monkeypatch, own, files, want):
    assert _cgroup(tmp_path, monkeypatch, own, files) == want


BASE = load_profile("snapdragon-x-npu").to_dict()


@pytest.mark.parametrize("change, field", [
    (dict(app_memory_cap_mb=BASE["memory_total_mb"] + 1), "app_memory_cap_mb"),
    (dict(shape_buckets=[1, 4, 4, 8]), "shape_buckets"),
    (dict(shape_buckets=[1, 2.5, 8]), "shape_buckets"),
    (dict(memory_total_mb=16000.5), "memory_total_mb"),
    (dict(prefill_chunk=6), "prefill_chunk"),  # below the largest bucket but not one of them
])
def test_more_validation(change, field):
    with pytest.raises(ProfileError, match=field):
        profile_from_dict({**BASE, **change}, "test.json")


def test_budget_may_be_all_of_the_memory_and_profiles_round_trip_as_tuples(tmp_path, monkeypatch):
    p = profile_from_dict({**BASE, "budget_mb": BASE["memory_total_mb"], "app_memory_cap_mb": None})
    assert p.budget_mb == p.memory_total_mb
    p = profile_from_dict({**BASE, "providers_installed": ["CPUExecutionProvider"]})
    assert p.providers_installed == ("CPUExecutionProvider",) and hash(p)
    s = devices.check_available(load_profile("snapdragon-x-npu"), simulate=True, providers=["CPUExecutionProvider"])
    assert s.simulated_provider == "QNNExecutionProvider"
    (tmp_path / "mine.json").write_text(json.dumps({**BASE, "name": "mine"}))
    monkeypatch.chdir(tmp_path)
    assert load_profile("mine.json").name == "mine"  # a bare file name ending in .json is a path


@pytest.mark.parametrize("bad", [float("nan"), "0.9", True, 1.5, -0.1, None])
def test_a_malformed_agreement_in_the_manifest_falls_back_to_the_default_prior(bad):
    """A hand-edited top1_agreement that is not a probability: the planner's prior, the engine's, and the choice of
    drafter graph use the default instead of a NaN plan (the prior check refuses NaN) or a TypeError."""
    from types import SimpleNamespace

    from memory.footprint import drafter_graph, top1_agreement
    from memory.planner import DEFAULT_MODEL_PRIOR, default_stats

    bad_g = SimpleNamespace(name="bad", stats={"top1_agreement": bad})
    good = SimpleNamespace(name="good", stats={"top1_agreement": 0.2})
    assert top1_agreement(bad_g, 0.3) == 0.3 and top1_agreement(good, 0.3) == 0.2
    m = SimpleNamespace(name="m", drafters=(bad_g, good))
    assert drafter_graph(m) is good
    assert default_stats(m)["bad"].rate[0, 0] == pytest.approx(DEFAULT_MODEL_PRIOR)
