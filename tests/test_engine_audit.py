"""Engine behaviour a wrong loop still passed every other test with (session 24's mutation audit of edge/engine.py):
what the adaptive length reads (call times per context, drafting cost, per-drafter acceptance, the candidate it did
not verify), the ends of the context window, chat overflow and reset, an interrupted prefill, stop strings, and
sampling details (the on-graph head's largest k, the model drafter's q).
"""
from __future__ import annotations

import types

import numpy as np
import pytest

import edge
import edge.engine as engine_mod
from edge import EngineError
from edge.drafters import Draft
from edge.engine import PROBE_EVERY, ContextFull
from memory.acceptance import AcceptanceStats

PROMPT = "def add(a, b):"


# ------------------------------------------------------------------------------ what the adaptive length reads

def test_a_probe_never_drafts_more_than_the_step_allows(fresh):
    got = [fresh._probe("lookup", 1) for _ in range(2 * PROBE_EVERY)]
    assert got.count(1) == 2 and set(got) == {0, 1}


def test_a_model_drafter_whose_tokens_cost_more_than_a_call_drafts_nothing(fresh):
    fresh._verify_ms = lambda s: 10.0 + 0.1 * s
    fresh.acceptance["model"] = AcceptanceStats(0.9)
    fresh._draft_ms = 0.0
    assert fresh._choose_k("model", 6) > 0  # drafts that cost nothing, accepted 90% of the time: worth it
    fresh._draft_ms = 1000.0  # a second per drafted token against a 10 ms call
    assert fresh._choose_k("model", 6) == 0


def test_call_times_are_filed_under_the_context_of_each_call(fresh):
    """A step's call time is kept for the context its call read (the cache length's bit length), not the prompt's:
    an answer that grows the cache past a power of two times its calls under more than one context."""
    ids = fresh.encode("hi")
    r = fresh.generate("hi", max_tokens=60, drafter="none")
    assert r.finish_reason == "length"
    lengths = range(len(ids), len(ids) + len(r.token_ids) - 1)  # the cache before each step's call
    assert set(fresh._calls_at) == {n.bit_length() for n in lengths}
    assert len(fresh._calls_at) >= 2


def test_call_and_draft_times_are_per_call_and_per_drafted_token_in_ms(fresh, monkeypatch):
    """On a fake clock every target call takes 10 ms and every drafted token 4 ms: the per-width call times are
    10 ms from the first call on, and the model drafter's cost per token (an average from zero) stays within 4 ms."""
    from edge.drafters import ModelDrafter

    clock = [0.0]
    monkeypatch.setattr(engine_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    forward, draft = fresh.target.forward, ModelDrafter.draft

    def timed_forward(*a, **kw):
        clock[0] += 0.010
        return forward(*a, **kw)

    def timed_draft(self, budget):
        d = draft(self, budget)
        clock[0] += 0.004 * len(d)
        return d
    monkeypatch.setattr(fresh.target, "forward", timed_forward)
    monkeypatch.setattr(ModelDrafter, "draft", timed_draft)
    r = fresh.generate(PROMPT, max_tokens=30, drafter="model", draft_len=3)
    assert r.stats.drafted >= 6
    times = [t for calls in fresh._calls_at.values() for t in calls.values()]
    assert times and times == pytest.approx([10.0] * len(times))
    assert 0 < fresh._draft_ms <= 4.0 + 1e-9


def test_the_model_drafters_first_estimate_is_its_measured_agreement(fresh):
    from memory.footprint import drafter_graph

    agreement = drafter_graph(fresh.manifest).stats["top1_agreement"]
    assert agreement != 0.3  # the generic prior, which would make the check below vacuous
    np.testing.assert_array_equal(fresh._stats("model").table(), AcceptanceStats(agreement).table())


@pytest.fixture
def chains_engine(tiny_dir):
    """The tiny export driven as if its graph verified chains only (as in test_engine.py)."""
    e = edge.load(tiny_dir, drafter="none", context=256)
    e.target.tree_exact = False
    e.recycling.chains_only = True
    e.recycling._templates.clear()
    return e


class _Recorder(AcceptanceStats):
    def __init__(self):
        super().__init__(0.5)
        self.seen = []

    def update(self, drafted, accepted, *a, **kw):
        self.seen.append((drafted, accepted))
        super().update(drafted, accepted, *a, **kw)


@pytest.mark.parametrize("kind", ["model", "recycling"])
def test_a_drafters_acceptance_statistics_count_each_verified_draft_once(chains_engine, kind):
    """What the adaptive length and the planner read: one (drafted, accepted) per step that drafted, adding up to
    the request's own counters."""
    e = chains_engine
    e.generate("the quick brown fox", max_tokens=40, drafter="recycling")  # warms Token Recycling's matrix
    e.acceptance[kind] = rec = _Recorder()
    r = e.generate("the quick brown fox", max_tokens=40, drafter=kind, draft_len=4)
    assert r.finish_reason == "length" and r.stats.drafted > 0
    assert len(rec.seen) <= r.stats.steps
    assert sum(d for d, _ in rec.seen) == r.stats.drafted and sum(a for _, a in rec.seen) == r.stats.accepted


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


def test_the_candidate_not_verified_is_scored_against_the_bonus_token_too(chains_engine, monkeypatch):
    """Hybrid verifies the candidate it prices higher; when the target rejects its first token, the target's own
    token (the bonus) is all there is to score the other candidate against, and it must be scored."""
    e = chains_engine
    ref = e.generate(PROMPT, max_tokens=3, drafter="none").token_ids
    wrong = next(t for t in range(3, 50) if t != ref[1])
    span = Draft.chain([wrong], source="lookup:4")
    rec = Draft.chain([ref[1]], source="recycling", labels=["recycling:u"])
    e._verify_ms = lambda s: 10.0 + 0.5 * s
    acc = e.token_acceptance
    acc.rate.update({"lookup:4@1/split": 0.95, "recycling:u@1/split": 0.1})
    monkeypatch.setattr(e, "_drafter", lambda kind, p, rng: (_Chains(span, rec), 16))
    before = dict(acc.count)
    r = e.generate(PROMPT, max_tokens=3, drafter="hybrid")
    assert r.token_ids == ref and r.stats.drafted == 1 and r.stats.accepted == 0  # the span was verified, rejected
    assert acc.count["lookup:4@1/split"] == before.get("lookup:4@1/split", 0) + 1
    assert acc.count["recycling:u@1/split"] == before.get("recycling:u@1/split", 0) + 1  # would have been accepted
    assert acc.rate["recycling:u@1/split"] > 0.1


# ------------------------------------------------------------------------------ the context window and chat history

def test_a_prompt_that_fills_the_context_is_refused_and_one_that_leaves_a_slot_is_answered(tiny_dir):
    """An answer needs at least one free slot after the prompt: a prompt of exactly `context` tokens is refused
    (nothing is left for even one token), one of `context - 1` tokens gets its one token."""
    n = len(edge.load(tiny_dir, drafter="none", context=256).encode(PROMPT))
    with pytest.raises(EngineError, match=rf"prompt is {n} tokens but the context holds {n}"):
        edge.load(tiny_dir, drafter="none", context=n).generate(PROMPT)
    e = edge.load(tiny_dir, drafter="none", context=n + 1)
    r = e.generate(PROMPT, max_tokens=10)
    assert len(r.token_ids) == 1 and r.finish_reason == "length"


def test_a_chat_turn_that_exactly_fills_the_context_is_context_full(tiny_dir):
    n = len(edge.load(tiny_dir, drafter="none", context=256).encode([{"role": "user", "content": PROMPT}]))
    chat = edge.load(tiny_dir, drafter="none", context=n).chat()
    with pytest.raises(ContextFull) as e:
        chat.ask(PROMPT, max_tokens=4)
    assert (e.value.n, e.value.context, e.value.alone) == (n, n, True) and chat.messages == []


def test_a_question_too_long_alone_says_so_with_a_system_message(tiny_dir):
    chat = edge.load(tiny_dir, drafter="none", context=64).chat(system="Be terse.")
    with pytest.raises(ContextFull) as e:
        chat.ask("word " * 100, max_tokens=4)
    assert e.value.alone and chat.messages == [{"role": "system", "content": "Be terse."}]


def test_drop_oldest_reserves_at_most_half_the_context_for_the_answer(tiny_dir):
    """max_tokens beyond the context (allowed: the answer stops at the window) must not drop turns that fit with
    half the context left for the answer."""
    e = edge.load(tiny_dir, drafter="none", context=256)
    chat = e.chat(overflow="drop_oldest")
    chat.ask("name a river", max_tokens=2)
    chat.ask("and a city?", max_tokens=2)
    history = [dict(m) for m in chat.messages]
    assert len(e.encode(history + [{"role": "user", "content": "why?"}])) + 128 <= 256
    chat.ask("why?", max_tokens=10**6)
    assert chat.dropped == 0 and chat.messages[:4] == history


def test_drop_oldest_keeps_a_history_that_fits_exactly(tiny_dir):
    """Prompt plus the answer's reserve exactly filling the context fits: nothing is dropped."""
    history = [{"role": "user", "content": "name a river"}, {"role": "assistant", "content": "the Nile"}]
    n = len(edge.load(tiny_dir, drafter="none", context=256).encode(history + [{"role": "user", "content": "why?"}]))
    chat = edge.load(tiny_dir, drafter="none", context=n + 5).chat(overflow="drop_oldest")
    chat.messages = [dict(m) for m in history]
    chat.ask("why?", max_tokens=5)
    assert chat.dropped == 0 and chat.messages[:2] == history


def test_chat_reset_keeps_the_system_message(fresh):
    chat = fresh.chat(system="Be terse.")
    chat.ask("hi", max_tokens=3)
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "Be terse."}]


def test_an_interrupted_prefill_keeps_the_prefix_it_reused(fresh, monkeypatch):
    """Ctrl-C during a prefill rolls the cache back to what it shares with the new prompt (still valid), not to
    nothing: the next request re-uses it."""
    fresh.generate("the quick brown fox", max_tokens=4)
    before = list(fresh.cached)
    ids = fresh.encode("the quick brown cat")
    lcp = next(i for i, (a, b) in enumerate(zip(before, ids)) if a != b)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(fresh.target, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fresh.generate("the quick brown cat", max_tokens=4)
    monkeypatch.undo()
    assert fresh.cached == ids[:lcp] and fresh.target.cache.length == lcp
    assert fresh.generate("the quick brown cat", max_tokens=4).stats.reused_tokens == lcp


# ------------------------------------------------------------------------------ stop strings and finish reasons

@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_an_eos_that_is_also_the_last_allowed_token_finishes_as_stop(fresh, monkeypatch, drafter):
    """The answer ended because the model ended it: finish_reason "stop", even when max_tokens ends there too."""
    refs = {p: fresh.generate(p, max_tokens=30).token_ids for p in (PROMPT, "the quick brown fox", "café 😀 日本")}
    p, j = next((p, i) for p, ref in refs.items() for i in range(3, len(ref)) if ref[i] not in ref[:i])
    monkeypatch.setattr(fresh, "eos", {refs[p][j]})
    r = fresh.generate(p, max_tokens=j + 1, drafter=drafter)
    assert r.token_ids == refs[p][: j + 1] and r.finish_reason == "stop"


def test_a_stop_string_given_as_a_string_is_one_stop_string(fresh):
    full = fresh.generate(PROMPT, max_tokens=40).text
    # a stop string some of whose characters occur before it: each of them alone would cut the answer earlier
    stop = next(s for s in (full[i : i + 3] for i in range(3, len(full) - 3))
                if min(map(full.index, s)) < full.index(s))
    r = fresh.generate(PROMPT, max_tokens=40, stop=stop)
    assert r.text == full[: full.index(stop)] and r.finish_reason == "stop"


def test_of_two_stop_strings_completed_by_one_token_the_earlier_one_cuts(fresh):
    """Two stop strings ending at the same character: the answer ends before the one that starts first."""
    full = fresh.generate(PROMPT, max_tokens=40).text
    # both first occur where they end at i + 3 (else one of them alone would stop the answer earlier)
    i = next(i for i in range(2, len(full) - 3)
             if full.find(full[i : i + 3]) == i and full.find(full[i + 1 : i + 3]) == i + 1)
    long, short = full[i : i + 3], full[i + 1 : i + 3]
    for stop in ([long, short], [short, long]):
        r = fresh.generate(PROMPT, max_tokens=40, stop=stop)
        assert r.text == full[:i] and r.finish_reason == "stop", stop


def test_stop_none_means_no_stop_strings(fresh):
    assert fresh.generate(PROMPT, max_tokens=6, stop=None).token_ids == fresh.generate(PROMPT, max_tokens=6).token_ids


# ------------------------------------------------------------------------------ sampling

@pytest.mark.parametrize("top_k", [255, 256])
def test_a_top_k_cut_at_the_heads_full_k_is_read_from_the_head(fresh, top_k):
    """top_k up to HEAD_TOPK_MAX (256) is inside the on-graph head's k: read exactly from its probabilities, the
    logits never fetched."""
    from edge.runner import HEAD_TOPK_MAX

    assert HEAD_TOPK_MAX == 256 < fresh.target.vocab
    r = fresh.generate(PROMPT, max_tokens=6, temperature=0.8, top_k=top_k, seed=1, drafter="recycling")
    assert r.stats.steps > 0 and fresh.head_hits > 0 and fresh.head_misses == 0


@pytest.mark.parametrize("kw", [dict(top_p=1e-6), dict(top_k=1)])
def test_an_unseeded_model_drafter_drafts_from_its_distribution_cut_as_the_request_asks(fresh, monkeypatch, kw):
    """Sampled drafts come from the drafter's distribution under the request's top-k and top-p, like the target's
    p: with a cut that keeps one token, every q row is a point mass (a q over the whole vocabulary stays lossless
    but drafts tokens the target can never accept)."""
    from edge.drafters import ModelDrafter

    qs, real = [], ModelDrafter.draft

    def draft(self, budget):
        d = real(self, budget)
        qs.extend([] if d.q is None else d.q)
        return d
    monkeypatch.setattr(ModelDrafter, "draft", draft)
    fresh.generate(PROMPT, max_tokens=12, temperature=1.0, drafter="model", draft_len=3, **kw)
    assert qs and all(q.max() == 1.0 for q in qs)


def test_unseeded_sampling_differs_between_requests_and_a_seed_repeats(fresh):
    """seed=None draws fresh randomness per request (a mutation seeding it with 0 passed every fast test); the same
    seed repeats its answer. On the tiny random model the next-token distribution is nearly flat over its vocabulary,
    so two unseeded 16-token answers coincide with negligible probability."""
    runs = [fresh.generate(PROMPT, max_tokens=16, temperature=1.0).token_ids for _ in range(3)]
    assert len({tuple(r) for r in runs}) > 1
    a, b = (fresh.generate(PROMPT, max_tokens=16, temperature=1.0, seed=7).token_ids for _ in range(2))
    assert a == b
