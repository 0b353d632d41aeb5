"""The engine's adaptive draft length (edge/engine.py) on the tiny export: what it reads (call times per width and
per context, the export's own timings before any call is timed, the cost of a drafted token, each drafter's
acceptance), the probes that keep a switched-off drafter measured, and free drafts cut by the acceptance of their
kinds of token, the candidate hybrid did not verify scored too."""
from __future__ import annotations

import types
from types import SimpleNamespace

import numpy as np
import pytest

import edge
import edge.engine as engine_mod
from edge.drafters import Draft
from edge.draftlen import PROBE_EVERY
from memory.acceptance import AcceptanceStats

PROMPT = "def add(a, b):"
PROMPTS = ["the quick brown fox", "def add(a, b):", "Summarize: the council met", "café 😀 日本"]


# ------------------------------------------------------------------------------ what the adaptive length reads

def test_a_probe_never_drafts_more_than_the_step_allows(fresh):
    got = [fresh.policy.probe("lookup", 1) for _ in range(2 * PROBE_EVERY)]
    assert got.count(1) == 2 and set(got) == {0, 1}


def test_a_model_drafter_whose_tokens_cost_more_than_a_call_drafts_nothing(fresh):
    fresh.policy.verify_ms = lambda s: 10.0 + 0.1 * s
    fresh.policy.acceptance["model"] = AcceptanceStats(0.9)
    fresh.policy.draft_ms = 0.0
    assert fresh.policy.choose_k("model", 6) > 0  # drafts that cost nothing, accepted 90% of the time: worth it
    fresh.policy.draft_ms = 1000.0  # a second per drafted token against a 10 ms call
    assert fresh.policy.choose_k("model", 6) == 0


def test_adaptive_length_keeps_probing_a_drafter_it_switched_off(tiny_dir):
    """A drafter whose acceptance estimate fell so low that the adaptive length stops drafting must still be tried
    now and then; otherwise the estimate never changes again and the drafter stays off for the engine's life
    (seen in edge-bench: lookup, switched off on open-ended prompts, never drafted on the summaries after them).
    The estimate is held at zero and call times are pinned (a wider call never cheaper: on the tiny model the
    measured widths are ~0.2 ms apart and noise could make drafting look free), so every drafted token must come
    from a probe, and every probe must reach the statistics."""
    from memory.acceptance import AcceptanceStats

    from edge.draftlen import PROBE_EVERY, PROBE_K

    e = edge.load(tiny_dir, drafter="none", context=256)
    ref = e.generate(PROMPTS[0], max_tokens=60, drafter="none")
    # as if every draft so far had been rejected (a chain drafter), and held there
    e.policy.acceptance["model"] = frozen = _Recorder(prior=0.0, learn=False)
    e.policy.verify_ms = lambda s: 10.0 + s
    assert e.policy.choose_k("model", 6) == 0
    r = e.generate(PROMPTS[0], max_tokens=60, drafter="model")
    assert r.token_ids == ref.token_ids
    assert r.stats.drafted > 0
    probes = [n for n, _ in frozen.seen]
    assert probes and all(0 < n <= PROBE_K for n in probes), probes  # probes, not full-length drafting
    assert sum(probes) == r.stats.drafted and len(probes) <= r.stats.steps // PROBE_EVERY + 1, (probes, r.stats)
    live = AcceptanceStats(0.0)  # what the probes would have taught a live estimate
    for n, a in frozen.seen:
        live.update(n, a)
    assert live.table()[0, 0] > 0 or sum(a for _, a in frozen.seen) == 0  # accepted probes move the estimate


def test_call_times_are_filed_under_the_context_of_each_call(fresh):
    """A step's call time is kept for the context its call read (the cache length's bit length), not the prompt's:
    an answer that grows the cache past a power of two times its calls under more than one context."""
    ids = fresh.encode("hi")
    r = fresh.generate("hi", max_tokens=60, drafter="none")
    assert r.finish_reason == "length"
    lengths = range(len(ids), len(ids) + len(r.token_ids) - 1)  # the cache before each step's call
    assert set(fresh.policy.calls_at) == {n.bit_length() for n in lengths}
    assert len(fresh.policy.calls_at) >= 2


def test_call_and_draft_times_are_per_call_and_per_drafted_token_in_ms(fresh, monkeypatch):
    """On a fake clock every target call takes 10 ms and every drafted token 4 ms: the per-width call times are
    10 ms from the first call on, and the model drafter's cost per token (an average from zero) stays within 4 ms."""
    from edge.drafters import ModelDrafter

    clock = [0.0]
    monkeypatch.setattr(engine_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    call, draft = fresh.target.call, ModelDrafter.draft

    def timed_call(*a, **kw):
        clock[0] += 0.010
        return call(*a, **kw)

    def timed_draft(self, budget):
        d = draft(self, budget)
        clock[0] += 0.004 * len(d)
        return d
    monkeypatch.setattr(fresh.target, "call", timed_call)
    monkeypatch.setattr(ModelDrafter, "draft", timed_draft)
    r = fresh.generate(PROMPT, max_tokens=30, drafter="model", draft_len=3)
    assert r.stats.drafted >= 6
    times = [t for calls in fresh.policy.calls_at.values() for t in calls.values()]
    assert times and times == pytest.approx([10.0] * len(times))
    assert 0 < fresh.policy.draft_ms <= 4.0 + 1e-9


def test_unmeasured_call_widths_follow_the_exports_latency_curve(tiny_dir):
    """Until a width has been timed here, the adaptive length prices it by the export's own measured curve
    (latency_ms_by_s, relative to one row; never decreasing), scaled to this machine's one-row time; without that
    curve, by the default shape."""
    from dataclasses import replace

    from memory.planner import DEFAULT_VERIFY_SHAPE, LatencyCurve

    e = edge.load(tiny_dir, drafter="none", context=256)
    e.policy.call_ms = {1: 10.0}
    t = e.manifest.target
    flat = replace(t, stats={**t.stats, "latency_ms_by_s": [5.0, 5.5, 5.0, 6.0, 6.5, 7.0, 7.5, 8.0]})
    e.manifest = replace(e.manifest, graphs=(flat,) + tuple(g for g in e.manifest.graphs if g.role != "target"))
    e.policy.curves.clear()
    assert e.manifest.target.stats["latency_ms_by_s"][0] == 5.0
    assert [round(e.policy.verify_ms(s), 6) for s in (1, 2, 3, 8)] == [10.0, 11.0, 11.0, 16.0]
    e.policy.call_ms[8] = 30.0  # a measured width wins
    assert e.policy.verify_ms(8) == 30.0
    e.manifest = replace(e.manifest, graphs=(replace(t, stats={}),) + e.manifest.graphs[1:])
    e.policy.curves.clear()
    assert e.policy.verify_ms(16) == pytest.approx(LatencyCurve.scaled(10.0, DEFAULT_VERIFY_SHAPE)(16))


def test_first_call_prices_follow_the_exports_timings_at_this_context(tiny_dir):
    """Before any call is timed at a context, a width is priced as the planner prices it there: the export's
    engine-way timings at two contexts (latency_ms_by_s_at), interpolated in the context, not its 128-token curve
    (numpy-fed: its wide calls looked 20% cheaper than the engine's own). A calibration's curves come first."""
    from dataclasses import replace

    e = edge.load(tiny_dir, drafter="none", context=256)
    t = e.manifest.target
    short, long = [10.0 + 2 * s for s in range(8)], [20.0 + 1 * s for s in range(8)]  # ms for S = 1..8
    timed = replace(t, stats={**t.stats, "latency_ms_s1": 99.0, "latency_ms_by_s": [99.0 + s for s in range(8)],
                              "latency_ms_by_s_at": [[64, short], [192, long]]})
    e.manifest = replace(e.manifest, graphs=(timed,) + tuple(g for g in e.manifest.graphs if g.role != "target"))

    def price(length, calls=None):
        e.target.cache.length = length
        e.policy.call_ms = dict(calls or {})
        return [e.policy.verify_ms(s) for s in (1, 4, 8)]

    saved = e.target.cache.length, e.profile
    try:
        assert price(40) == pytest.approx([10.0, 16.0, 24.0])  # below the first context: its curve
        assert price(128) == pytest.approx([15.0, 19.5, 25.5])  # halfway: the mean of the two curves (own bucket)
        assert price(200) == pytest.approx([15.0, 19.5, 25.5])  # same bucket (128..255): as first priced, at 128
        assert price(130, {1: 30.0}) == pytest.approx([30.0, 39.0, 51.0])  # scaled to the narrowest call timed
        e.policy.curves.clear()
        e.profile = SimpleNamespace(calibration={"latency": {"target": [[1, 5.0], [8, 12.0]], "context": 100}})
        assert price(128) == pytest.approx([5.0, 8.0, 12.0])  # this device's calibration wins
    finally:
        e.target.cache.length, e.profile = saved
        e.policy.curves.clear()


def test_call_times_are_kept_per_context(tiny_dir):
    """A wide call's time grows with the cache each row reads. Widths timed in a long chat priced the next short
    one: measured here, after two long-context prompts the 4-10-row calls kept their 150-210 ms while one row cost
    28 ms at the new short context, and the adaptive length never chose those widths again to re-time them."""
    e = edge.load(tiny_dir, drafter="none", context=256)
    long_prompt = " ".join(f"item {i}" for i in range(30))
    e.generate(long_prompt, raw=True, max_tokens=3)
    assert e.policy.call_ms and e.policy.verify_ms(9) < 1e6
    e.policy.call_ms[9] = 1e6  # as if a 9-row call had been this slow at that context
    e.reset()
    e.generate("hi", raw=True, max_tokens=3)
    assert e.policy.verify_ms(9) < 1e6  # priced from what was timed at this context
    e.generate(long_prompt, raw=True, max_tokens=3)
    assert e.policy.verify_ms(9) == 1e6  # back at the long context: its own measurement
    assert 9 in e.policy.call_widths() and len(e.policy.calls_at) >= 2


def test_the_model_drafters_first_estimate_is_its_measured_agreement(fresh):
    from memory.footprint import drafter_graph

    agreement = drafter_graph(fresh.manifest).stats["top1_agreement"]
    assert agreement != 0.3  # the generic prior, which would make the check below vacuous
    np.testing.assert_array_equal(fresh.policy.stats("model").table(), AcceptanceStats(agreement).table())


# ------------------------------------------------------------------------------ free drafts, per kind of token

@pytest.fixture(scope="module")
def chains_engine(tiny_dir):
    """The tiny (fp32) export driven as if its graph verified chains only, as every int8-activation graph does:
    recycling and hybrid then take the per-source free-draft path."""
    e = edge.load(tiny_dir, drafter="none", context=256)
    e.target.tree_exact = False
    e.recycling.chains_only = True
    e.recycling._templates.clear()
    return e


@pytest.fixture
def fresh_chains_engine(tiny_dir):
    """The tiny export driven as if its graph verified chains only (as chains_engine), new for each test: these tests
    replace its statistics and call prices."""
    e = edge.load(tiny_dir, drafter="none", context=256)
    e.target.tree_exact = False
    e.recycling.chains_only = True
    e.recycling._templates.clear()
    return e


class _Recorder(AcceptanceStats):
    """Acceptance statistics that record every update; `learn=False` keeps the estimate at its prior."""

    def __init__(self, prior: float = 0.5, learn: bool = True):
        super().__init__(prior)
        self.seen, self.learn = [], learn

    def update(self, drafted, accepted, *a, **kw):
        self.seen.append((drafted, accepted))
        if self.learn:
            super().update(drafted, accepted, *a, **kw)


class _Chains:
    """A drafter offering fixed candidate chains."""

    def __init__(self, *chains):
        self._chains = chains

    def begin(self, context):
        pass

    def accept(self, tokens):
        pass

    def chains(self, budget):
        return [c.head(budget) for c in self._chains]


@pytest.mark.parametrize("drafter", ["lookup", "recycling", "hybrid"])
def test_adaptive_free_drafts_equal_plain(chains_engine, drafter, monkeypatch):
    """No draft_len: drafts are cut per step by their tokens' acceptance (and hybrid picks between the retrieved
    span and the recycling chain); the output is still plain greedy's, drafts happen, and they were priced by
    per-token labels and per-source statistics (the free-draft path ran). Call times are pinned to a flat curve:
    on the tiny model, noisy measured widths could price every span out (probes count idle steps per source)."""
    e = chains_engine
    monkeypatch.setattr(e.policy, "verify_ms", lambda s: 10.0 + 0.5 * s)
    drafted = 0
    for p in PROMPTS + ["the quick brown fox the quick brown fox the quick brown"]:
        ref = e.generate(p, max_tokens=40, drafter="none")
        got = e.generate(p, max_tokens=40, drafter=drafter)
        assert got.token_ids == ref.token_ids, (p, drafter)
        drafted += got.stats.drafted
    assert drafted > 0
    sources = {k.split("@")[0] for k in e.policy.token_acceptance.count}  # what found the tokens that were scored
    recycled, looked_up = {"recycling:b", "recycling:u"}, {f"lookup:{n}" for n in (1, 2, 3, 4, 8, 16, 32)}
    assert sources & (recycled if drafter == "recycling" else looked_up), e.policy.token_acceptance
    if drafter == "hybrid":  # both kinds were priced and scored (test_candidates_not_verified_… checks the scoring)
        assert sources & recycled and sources & looked_up, e.policy.token_acceptance


def test_free_drafts_are_cut_by_their_tokens_acceptance(tiny_dir):
    """A span from a reliable source keeps its length, one from an unreliable source is dropped (or cut to a probe),
    a chain is cut where its tokens turn unreliable, between two candidates the one with the better expected tokens
    per ms is verified, and verification updates exactly the labels of the tokens it tested."""
    from edge.drafters import Draft
    from edge.draftlen import token_labels

    e = edge.load(tiny_dir, drafter="none", context=256)
    e.policy.call_ms = {s: 10.0 + 0.5 * s for s in range(1, 40)}  # a flat verify curve
    acc = e.policy.token_acceptance
    acc.rate.update({"lookup:4@1": 0.95, "lookup:4@2+": 0.95, "lookup:1@1": 0.02, "lookup:1@2+": 0.9,
                     "recycling:u@1/split": 0.5, "recycling:u@2+/split": 0.5, "lookup:1@1/split": 0.02,
                     "lookup:4@1/split": 0.95, "lookup:4@2+/split": 0.95,
                     "recycling:b@1": 0.9, "recycling:b@2+": 0.9, "recycling:u@2+": 0.05})
    span4 = Draft.chain(range(10, 22), source="lookup:4")
    span1 = Draft.chain(range(30, 42), source="lookup:1")
    rec = Draft.chain(range(50, 58), source="recycling", labels=["recycling:u"] * 8)
    mixed = Draft.chain(range(60, 66), source="recycling", labels=["recycling:b"] * 3 + ["recycling:u"] * 3)
    assert len(e.policy.draft_free(_Chains(span4), "lookup", 12)) == 12
    got = [len(e.policy.draft_free(_Chains(span1), "lookup", 12)) for _ in range(16)]
    assert max(got) <= 2 and 0 < sum(got) <= 4  # no drafts but the occasional 2-token probe
    assert len(e.policy.draft_free(_Chains(mixed), "recycling", 6)) == 3  # cut where the one-token successors begin
    pick = e.policy.draft_free(_Chains(span1, rec), "hybrid", 12)
    assert pick.source == "recycling" and 0 < len(pick) <= 8 and pick.labels[0] == "recycling:u@1/split"
    best = e.policy.draft_free(_Chains(span4, rec), "hybrid", 12)
    assert best.source == "lookup:4" and best.labels[:2] == ("lookup:4@1/split", "lookup:4@2+/split")
    assert token_labels(Draft.chain([1, 2]), "hybrid") == ("hybrid@1", "hybrid@2+")
    other = Draft.chain([1, 2, 7])
    assert token_labels(Draft.chain([1, 2, 3, 4]), "hybrid", [other]) == (
        "hybrid@1/agree", "hybrid@2+/agree", "hybrid@2+/parted", "hybrid@2+/parted")
    assert token_labels(Draft.chain([5, 2]), "hybrid", [other]) == ("hybrid@1/split", "hybrid@2+/split")
    before = dict(acc.count)
    acc.update(best.labels[:3], 1)  # what the engine does after verifying: first accepted, second rejected
    assert acc.count["lookup:4@1/split"] == before.get("lookup:4@1/split", 0) + 1
    assert acc.count["lookup:4@2+/split"] == before.get("lookup:4@2+/split", 0) + 1  # once: the third never ran


def test_candidates_not_verified_are_scored_against_the_target(tiny_dir):
    """Hybrid verifies one of its candidate chains; the other is scored against the tokens the target produced
    (accepted + bonus) as far as they reach, so a kind of token that is never chosen still learns its rate."""
    from edge.drafters import Draft

    e = edge.load(tiny_dir, drafter="none", context=256)
    e.policy.call_ms = {s: 10.0 + 0.5 * s for s in range(1, 40)}
    acc = e.policy.token_acceptance
    acc.rate.update({"lookup:4@1/split": 0.95, "lookup:4@2+/split": 0.95,
                     "recycling:u@1/split": 0.1, "recycling:u@2+/split": 0.1})
    span4 = Draft.chain(range(10, 22), source="lookup:4")
    rec = Draft.chain(range(50, 58), source="recycling", labels=["recycling:u"] * 8)
    assert e.policy.draft_free(_Chains(span4, rec), "hybrid", 12).source == "lookup:4"
    before = dict(acc.count)
    e.policy.learn_unverified([50, 51, 99])  # synthetic: the target wrote 50, 51, then not 52 — recycling earned two
    assert acc.count["recycling:u@1/split"] == before.get("recycling:u@1/split", 0) + 1
    assert acc.count["recycling:u@2+/split"] == before.get("recycling:u@2+/split", 0) + 2
    assert acc.rate["recycling:u@1/split"] > 0.1 and all(acc.count.get(k) == v for k, v in before.items()
                                                         if k.startswith("lookup"))
    assert e.policy._unverified == []  # scored once
    e.policy.draft_free(_Chains(span4, rec), "hybrid", 12)
    before = dict(acc.count)
    e.policy.learn_unverified([50])  # only one token known: it matched, nothing after it was tested
    assert acc.count["recycling:u@1/split"] == before["recycling:u@1/split"] + 1
    assert acc.count["recycling:u@2+/split"] == before["recycling:u@2+/split"]


@pytest.mark.parametrize("kind", ["model", "recycling"])
def test_a_drafters_acceptance_statistics_count_each_verified_draft_once(fresh_chains_engine, kind):
    """What the adaptive length and the planner read: one (drafted, accepted) per step that drafted, adding up to
    the request's own counters."""
    e = fresh_chains_engine
    e.generate("the quick brown fox", max_tokens=40, drafter="recycling")  # warms Token Recycling's matrix
    e.policy.acceptance[kind] = rec = _Recorder()
    r = e.generate("the quick brown fox", max_tokens=40, drafter=kind, draft_len=4)
    assert r.finish_reason == "length" and r.stats.drafted > 0
    assert len(rec.seen) <= r.stats.steps
    assert sum(d for d, _ in rec.seen) == r.stats.drafted and sum(a for _, a in rec.seen) == r.stats.accepted


def test_the_candidate_not_verified_is_scored_against_the_bonus_token_too(fresh_chains_engine, monkeypatch):
    """Hybrid verifies the candidate it prices higher; when the target rejects its first token, the target's own
    token (the bonus) is all there is to score the other candidate against, and it must be scored."""
    e = fresh_chains_engine
    ref = e.generate(PROMPT, max_tokens=3, drafter="none").token_ids
    wrong = next(t for t in range(3, 50) if t != ref[1])
    span = Draft.chain([wrong], source="lookup:4")
    rec = Draft.chain([ref[1]], source="recycling", labels=["recycling:u"])
    e.policy.verify_ms = lambda s: 10.0 + 0.5 * s
    acc = e.policy.token_acceptance
    acc.rate.update({"lookup:4@1/split": 0.95, "recycling:u@1/split": 0.1})
    monkeypatch.setattr(e, "_drafter", lambda kind, p, rng: (_Chains(span, rec), 16))
    before = dict(acc.count)
    r = e.generate(PROMPT, max_tokens=3, drafter="hybrid")
    assert r.token_ids == ref and r.stats.drafted == 1 and r.stats.accepted == 0  # the span was verified, rejected
    assert acc.count["lookup:4@1/split"] == before.get("lookup:4@1/split", 0) + 1
    assert acc.count["recycling:u@1/split"] == before.get("recycling:u@1/split", 0) + 1  # would have been accepted
    assert acc.rate["recycling:u@1/split"] > 0.1
