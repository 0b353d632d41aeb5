"""memory.acceptance: EMA arithmetic by hand, expected accepted lengths, and best-first trees against a brute-force
search over every valid tree."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import chain_acc
from kernels.tree import TreeLayout
from memory import AcceptanceStats, TreeShape

PROPERTY = settings(max_examples=60, deadline=None, database=None)


def test_chain_expected_accepted_by_hand():
    s = AcceptanceStats(0.5)
    assert s.expected_accepted(0) == 0.0
    assert s.expected_accepted(3) == pytest.approx(0.5 + 0.25 + 0.125)
    s = AcceptanceStats([0.9, 0.5, 0.1], draft_rate=0.5)
    assert s.expected_accepted(4) == pytest.approx(0.5 * (0.9 + 0.45 + 0.045 + 0.0045))  # last prior continues


def test_tree_expected_accepted_by_hand():
    s = AcceptanceStats(0.5, rank_decay=0.5)  # a[d, 0] = 0.5, a[d, 1] = 0.25
    # root → (rank 0 → its rank-0 child), (rank 1)
    shape = TreeShape("t", (0, 1, 0), (0, 0, 1))
    assert shape.depths == (1, 2, 1) and shape.widths == (2, 1)
    assert s.expected_accepted(shape) == pytest.approx(0.5 + 0.25 + 0.25)


def test_ema_updates_by_hand():
    s = AcceptanceStats(0.5, beta=0.1, prior_weight=4.0)
    s.update(drafted=3, accepted=1)  # depth 1 accepted, depth 2 rejected, depth 3 never tested
    assert s.rate[0, 0] == pytest.approx(0.5 + 0.25 * 0.5)  # first weight 1/(0 + 4)
    assert s.rate[1, 0] == pytest.approx(0.5 - 0.25 * 0.5)
    assert s.rate[2, 0] == 0.5
    s.update(3, 3)
    assert s.rate[0, 0] == pytest.approx(0.625 + 0.2 * 0.375)  # weight 1/(1 + 4)
    assert s.rate[2, 0] == pytest.approx(0.5 + 0.25 * 0.5)
    for _ in range(100):
        s.update(1, 1)
    assert s.rate[0, 0] > 0.99  # weight floors at beta: the average follows the stream
    before = s.rate.copy()
    s.update(0, 0)  # nothing drafted: only the draft rate moves
    assert np.array_equal(s.rate, before) and s.draft_rate < 1.0
    with pytest.raises(ValueError, match="accepted"):
        s.update(2, 3)


def test_tree_updates_by_hand():
    s = AcceptanceStats(0.4, rank_decay=0.5, prior_weight=4.0)
    s.update_tree(offered=[3, 2], accepted_ranks=[1])  # depth 1: rank 1 hit; depth 2: both candidates missed
    assert s.rate[0, :3] == pytest.approx([0.4 - 0.1, 0.2 + 0.2, 0.1 - 0.025])
    assert s.rate[1, :2] == pytest.approx([0.4 - 0.1, 0.2 - 0.05])
    assert s.rate[2, 0] == 0.4
    with pytest.raises(ValueError, match="not among"):
        s.update_tree([2], [2])


def test_accept_prob_is_consistent():
    s = AcceptanceStats(0.9, rank_decay=1.0)  # raw rates 0.9 for every rank: inconsistent on purpose
    probs = [s.accept_prob(1, r) for r in range(4)]
    assert probs == pytest.approx([0.9, 0.1, 0.0, 0.0])  # non-increasing and summing to <= 1
    s.rate[0] = [0.2, 0.5, 0.1, 0.0]
    assert [s.accept_prob(1, r) for r in range(3)] == pytest.approx([0.2, 0.2, 0.1])
    assert s.accept_prob(1, 10) == 0.0
    with pytest.raises(ValueError):
        s.accept_prob(0)


def test_round_trip_and_repr():
    s = AcceptanceStats(0.6, draft_rate=0.7)
    s.update(4, 2)
    t = AcceptanceStats.from_dict(s.to_dict())
    assert np.allclose(t.rate, s.rate) and t.draft_rate == s.draft_rate
    assert t.expected_accepted(5) == pytest.approx(s.expected_accepted(5), abs=1e-5)
    assert "draft_rate=0.70" in repr(AcceptanceStats(0.6, draft_rate=0.7))


def test_shapes_are_valid_tree_layouts():
    s = AcceptanceStats([0.8, 0.6, 0.5], rank_decay=0.4)
    for n in (1, 5, 20, 64):
        t = s.best_first(n)
        assert len(t) == n and t.name == "best-first"
        layout = TreeLayout.from_parents(np.array((-1,) + t.parents))  # what the engine's verify call uses
        assert layout.num_nodes == n + 1
        assert tuple(layout.position_ids(0)[0, 1:]) == t.depths
    assert TreeShape.chain(4).is_chain and TreeShape.chain(0).name == "none"
    with pytest.raises(AssertionError):
        TreeShape("bad", (1,), (0,))  # a parent after its child


def _all_trees(n: int, max_rank: int, max_depth: int):
    """Every valid tree of n nodes as a frozenset of paths (tuples of ranks), closed under parent and under
    lower-rank siblings (a drafter proposes its candidates best first)."""
    seen, frontier = set(), {frozenset()}
    for _ in range(n):
        nxt = set()
        for tree in frontier:
            cands = {(0,)} | {p + (0,) for p in tree if len(p) < max_depth} | \
                    {p[:-1] + (p[-1] + 1,) for p in tree if p[-1] + 1 < max_rank}
            for c in cands - tree:
                nxt.add(tree | {c})
        frontier = nxt
    seen |= frontier
    return seen


def _value(tree, a):  # sum over nodes of the product of a[depth, rank] along the path
    return sum(np.prod([a[d, r] for d, r in enumerate(p)]) for p in tree)


@PROPERTY
@given(st.lists(st.floats(0.05, 0.95), min_size=3, max_size=3), st.floats(0.1, 0.9), st.integers(1, 5))
def test_best_first_is_optimal_against_brute_force(priors, decay, n):
    s = AcceptanceStats(priors, rank_decay=decay, max_rank=3, max_depth=5)
    a = np.array([[s.accept_prob(d, r) for r in range(3)] for d in range(1, 6)])
    best = max(_value(t, a) for t in _all_trees(n, 3, 5))
    got = s.best_first(n)
    assert s.expected_accepted(got) == pytest.approx(best, rel=1e-9)
    for m in range(n):  # prefixes are the best smaller trees
        assert s.expected_accepted(got.prefix(m)) == pytest.approx(s.expected_accepted(s.best_first(m)))


def test_brute_force_enumerator_counts():
    # sanity of the test's own enumerator: with one rank only chains exist; 2 nodes, 2 ranks: chain or two siblings
    assert len(_all_trees(4, 1, 10)) == 1
    assert len(_all_trees(2, 2, 10)) == 2
    assert all(len(t) == 3 for t in _all_trees(3, 2, 3))
    assert list(itertools.islice(_all_trees(1, 3, 3), 2)) == [frozenset({(0,)})]


def test_token_acceptance_updates_the_tested_tokens_only():
    """A verified chain: its first `accepted` tokens were accepted, the next one rejected, the rest never tested."""
    from memory.acceptance import TokenAcceptance

    t = TokenAcceptance({"lookup": 0.3, "recycling": 0.4}, beta=0.1, prior_weight=4.0)
    assert t.probs(["lookup:2@1", "recycling:b@2+", "other@1"]) == [0.3, 0.4, 0.3]  # family priors
    t.update(["a@1", "b@2+", "b@2+", "c@2+"], 2)
    # a: hit, weight max(0.1, 1/4) → 0.3 + 0.25·0.7; b: first a hit (0.475), then a miss with weight 1/5
    assert t.probs(["a@1"])[0] == pytest.approx(0.475)
    assert t.probs(["b@2+"])[0] == pytest.approx(0.475 - 0.475 / 5)
    assert "c@2+" not in t.rate  # behind the rejection: never tested
    t.update(["d@1"], 0)
    assert t.probs(["d@1"])[0] == pytest.approx(0.3 - 0.3 / 4)
    with pytest.raises(ValueError):
        t.update(["a@1"], 2)
    for _ in range(200):  # long runs converge to the observed rate
        t.update(["e@1", "e@1"], 1)
    assert t.probs(["e@1"])[0] == pytest.approx(0.5, abs=0.1)


def test_token_acceptance_label_priors_and_lifetime_summary():
    """A label's own prior wins over its family's; the summary keeps the lifetime rate the moving average forgets."""
    from memory.acceptance import TokenAcceptance

    t = TokenAcceptance({"lookup": 0.3, "lookup:32@2+/agree": 0.9, "lookup:32@2+": 0.8}, beta=0.5, prior_weight=1.0)
    got = t.probs(["lookup:32@2+/agree", "lookup:32@2+/split", "lookup:32@1/agree"])
    assert got == [0.9, 0.8, 0.3]  # own prior, then the label without its agreement suffix, then the family's
    for accepted in (1, 1, 1, 0):
        t.update(["x@1"], accepted)
    s = t.summary()["x@1"]
    assert s["n"] == 4 and s["lifetime"] == 0.75 and s["rate"] == 0.5  # the last miss weighs half the EMA


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
