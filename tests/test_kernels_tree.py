"""Tests for kernels.tree: layouts, greedy and sampling tree verification, KV gathers.

Kinds: hand-drawn trees with literal expectations; slow Python-loop references (attention
bias, greedy walk) on random trees; losslessness statistics of a full speculative loop whose
tree drafts are sampled from q inside the test; hypothesis properties.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.sampling import sample_from
from distribution import compare_to_distribution
from kernels.tree import (
    TreeLayout,
    chain_parents,
    kv_gather_indices,
    topological_order,
    verify_greedy_tree,
    verify_sampling_tree,
)
from kernels.verify import verify_sampling
from toy_lm import FixedU, draw, emitted_counts, exact_joint, random_dist, trigram_table

PROPERTY = settings(max_examples=200, deadline=None, database=None)
NEG = np.finfo(np.float32).min


# ------------------------------------------------------------------ slow references


def slow_is_ancestor(parents, i, j) -> bool:
    """Is j == i or an ancestor of i (walk up the parent links)."""
    while i != -1:
        if i == j:
            return True
        i = parents[i]
    return False


def slow_attention_bias(parents, past_len):
    s = len(parents)
    out = [[0.0] * (past_len + s) for _ in range(s)]
    for i in range(s):
        for j in range(s):
            if not slow_is_ancestor(parents, i, j):
                out[i][past_len + j] = float(NEG)
    return np.array(out, dtype=np.float32)[None, None]


def slow_greedy_walk(tokens, parents, target_argmax):
    node, path = 0, [0]
    while True:
        step = None
        for j in range(len(parents)):  # first child in index order with the argmax token
            if parents[j] == node and tokens[j] == target_argmax[node]:
                step = j
                break
        if step is None:
            return path, target_argmax[node]
        path.append(step)
        node = step


def children_of(parents):
    kids = [[] for _ in parents]
    for i, par in enumerate(parents):
        if par >= 0:
            kids[par].append(i)
    return kids


# --------------------------------------------------------------- hand-drawn layouts

#      0            chain: 0 - 1 - 2 - 3
#     / \
#    1   2          BRANCHY: parents [-1, 0, 0, 1, 1, 2]
#   / \   \
#  3   4   5
#
#      0            INTERLEAVED: siblings are not contiguous
#     / \
#    1   3          parents [-1, 0, 1, 0, 2, 1]
#   / \
#  2   5
#  |
#  4
LAYOUTS = {
    "root-only": ([-1], [0], [[1]]),
    "chain": (
        [-1, 0, 1, 2],
        [0, 1, 2, 3],
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]],
    ),
    "branchy": (
        [-1, 0, 0, 1, 1, 2],
        [0, 1, 1, 2, 2, 2],
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
    ),
    "interleaved": (
        [-1, 0, 1, 0, 2, 1],
        [0, 1, 2, 1, 3, 2],
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 0, 0, 1, 0, 0],
            [1, 1, 1, 0, 1, 0],
            [1, 1, 0, 0, 0, 1],
        ],
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_hand_drawn(name):
    parents, depths, mask = LAYOUTS[name]
    layout = TreeLayout.from_parents(parents)
    assert layout.parents.dtype == np.int32 and layout.depths.dtype == np.int32
    np.testing.assert_array_equal(layout.depths, depths)
    np.testing.assert_array_equal(layout.ancestor_mask(), np.array(mask, dtype=bool))
    np.testing.assert_array_equal(layout.position_ids(7), [[7 + d for d in depths]])
    assert layout.position_ids(7).dtype == np.int64
    bias = layout.attention_bias(3)
    assert bias.shape == (1, 1, len(parents), 3 + len(parents)) and bias.dtype == np.float32
    np.testing.assert_array_equal(bias[0, 0, :, :3], 0.0)
    np.testing.assert_array_equal(bias[0, 0, :, 3:], np.where(np.array(mask, bool), 0.0, NEG))


def test_layout_paths_and_float16_bias():
    layout = TreeLayout.from_parents(LAYOUTS["interleaved"][0])
    assert layout.path_to(0) == [0]
    assert layout.path_to(4) == [0, 1, 2, 4]
    assert layout.path_to(3) == [0, 3]
    assert layout.path_to(5) == [0, 1, 5]
    with pytest.raises(ValueError):
        layout.path_to(6)
    bias = layout.attention_bias(0, dtype=np.float16)
    assert bias.dtype == np.float16 and bias[0, 0, 0, 1] == np.finfo(np.float16).min
    assert bias[0, 0, 4, 2] == 0


def test_chain_helpers():
    np.testing.assert_array_equal(chain_parents(0), [-1])
    np.testing.assert_array_equal(chain_parents(3), [-1, 0, 1, 2])
    layout = TreeLayout.from_chain(3)
    np.testing.assert_array_equal(layout.parents, [-1, 0, 1, 2])
    np.testing.assert_array_equal(layout.ancestor_mask(), np.tril(np.ones((4, 4), bool)))
    assert len(layout) == 4


@pytest.mark.parametrize(
    "parents",
    [[], [0], [-1, 1], [-1, 0, 3], [-1, -1], [-1, 0, -2], [[-1, 0]], [-1.0, 0.0]],
)
def test_layout_rejects_bad_parents(parents):
    with pytest.raises(ValueError):
        TreeLayout.from_parents(parents)


def test_layout_is_immutable_and_checks_depths():
    layout = TreeLayout.from_parents([-1, 0, 0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.parents = np.array([-1])
    with pytest.raises(ValueError):
        layout.parents[1] = 1
    mask = layout.ancestor_mask()
    mask[:] = False  # a copy: the cached matrix behind attention_bias is untouched
    assert layout.ancestor_mask()[1, 0] and layout.attention_bias(0)[0, 0, 1, 0] == 0
    with pytest.raises(ValueError, match="depths"):
        TreeLayout(np.array([-1, 0, 0]), np.array([0, 1, 2]))
    assert TreeLayout(np.array([-1, 0, 1]), np.array([0, 1, 2])).depths.tolist() == [0, 1, 2]


def test_topological_order_table():
    # root is old node 1; its children are old 0 and 3; old 0 -> old 2; old 3 -> old 4
    order, new_parents = topological_order([1, -1, 0, 1, 3])
    np.testing.assert_array_equal(order, [1, 0, 2, 3, 4])
    np.testing.assert_array_equal(new_parents, [-1, 0, 1, 0, 3])
    # BFS-numbered drafter output that is already valid stays as is
    order, new_parents = topological_order([-1, 0, 0, 1, 2])
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(new_parents, [-1, 0, 0, 1, 2])


@pytest.mark.parametrize(
    "parents, match",
    [
        ([-1, -1, 0], "one root"),
        ([0, 0, 1], "one root"),
        ([-1, 2, 1], "cycle"),
        ([-1, 5], "node index"),
        ([-1, 1], "self"),
    ],
)
def test_topological_order_rejects(parents, match):
    with pytest.raises(ValueError, match=match):
        topological_order(parents)


def test_kv_gather_indices():
    got = kv_gather_indices([0, 2, 5], past_len=10)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [10, 12, 15])
    np.testing.assert_array_equal(kv_gather_indices([0], 0), [0])
    with pytest.raises(AssertionError):
        kv_gather_indices([1, 2], 0)


# ------------------------------------------------------------ greedy tree: exact cases

BRANCHY = LAYOUTS["branchy"][0]


@pytest.mark.parametrize(
    "tokens, target_argmax, expected",
    [
        ([9, 5, 6, 7, 8, 7], [5, 8, 0, 0, 3, 0], ([0, 1, 4], 3)),  # to a leaf: bonus
        ([9, 5, 6, 7, 8, 7], [4, 8, 0, 0, 3, 0], ([0], 4)),  # nothing accepted
        ([9, 5, 6, 7, 8, 7], [6, 8, 1, 0, 3, 0], ([0, 2], 1)),  # stops in the middle
        # duplicate sibling tokens (nodes 1 and 2 both carry 5): the first in index order is
        # taken, even though the other branch would have gone further
        ([9, 5, 5, 7, 8, 7], [5, 2, 7, 0, 3, 0], ([0, 1], 2)),
    ],
)
def test_verify_greedy_tree_table(tokens, target_argmax, expected):
    got = verify_greedy_tree(np.array(tokens), np.array(BRANCHY), np.array(target_argmax))
    assert got == expected
    assert slow_greedy_walk(tokens, BRANCHY, target_argmax) == expected


# ------------------------------------------------------- sampling tree: exact cases

P_ROOT = [0.1, 0.2, 0.7, 0.0]
Q_ROOT = [0.0, 0.5, 0.5, 0.0]


@pytest.mark.parametrize(
    "replacement, expected",
    [
        # child 1 (token 1): ratio 0.2/0.5 = 0.4, u = 0.9 rejects; p_cur = [1/3, 0, 2/3, 0].
        # with replacement q_cur stays [0, .5, .5, 0]: child 2 has ratio > 1, accepted, and
        # the bonus comes from p[2] = onehot(3).
        (True, ([0, 2], 3)),
        # without replacement q_cur = onehot(2): ratio 2/3, u = 0.7 rejects; the recovered
        # token comes from max(0, [1/3, 0, 2/3, 0] - onehot(2)) = onehot(0).
        (False, ([0], 0)),
    ],
)
def test_verify_sampling_tree_replacement_rules(replacement, expected):
    p = np.array([P_ROOT, [0.25] * 4, [0, 0, 0, 1.0]])
    q = np.array([Q_ROOT, [0.25] * 4, [0.25] * 4])
    rng = FixedU(0.9, 0.7, 0.0)
    got = verify_sampling_tree(np.array([9, 1, 2]), np.array([-1, 0, 0]), p, q, rng, replacement)
    assert got == expected


def test_verify_sampling_tree_deterministic_duplicates_and_leaves():
    parents = np.array([-1, 0, 0, 1])
    tokens = np.array([9, 1, 1, 2])  # nodes 1 and 2 are duplicate siblings
    p = np.array([[0, 1.0, 0, 0], [0, 0, 0.5, 0.5], [1.0, 0, 0, 0], [0, 0, 0, 1.0]])
    # y = 1 -> the first duplicate (node 1); y ~ [0, 0, .5, .5] with u = 0.2 -> 2 -> node 3
    assert verify_sampling_tree(tokens, parents, p, None, FixedU(0.0, 0.2, 0.5)) == ([0, 1, 3], 3)
    # u = 0.9 at node 1 -> y = 3 is not a child: it is the next token
    assert verify_sampling_tree(tokens, parents, p, None, FixedU(0.0, 0.9)) == ([0, 1], 3)
    # a root-only tree just samples the bonus token from p[0]
    root = (np.array([9]), np.array([-1]), p[:1])
    assert verify_sampling_tree(*root, None, FixedU(0.3)) == ([0], 1)
    assert verify_sampling_tree(*root, p[:1], FixedU(0.3)) == ([0], 1)


# ---------------------------------------------------------- slow-reference comparisons


def random_parents(rng, s):
    return [-1] + [int(rng.integers(0, i)) for i in range(1, s)]


def test_attention_bias_and_greedy_walk_match_slow_references_on_random_trees():
    rng = np.random.default_rng(5)
    for _ in range(100):
        s = int(rng.integers(1, 40))
        parents = random_parents(rng, s)
        past = int(rng.integers(0, 20))
        layout = TreeLayout.from_parents(parents)
        slow = slow_attention_bias(parents, past)
        np.testing.assert_array_equal(layout.attention_bias(past), slow)
        tokens = rng.integers(0, 3, size=s)  # tiny vocab: many matches and duplicate siblings
        target = rng.integers(0, 3, size=s)
        assert verify_greedy_tree(tokens, np.array(parents), target) == slow_greedy_walk(
            tokens.tolist(), parents, target.tolist()
        )


# ------------------------------------------------------------------ toy models


def sampled_tree_step(P, Q, parents, draft_replacement, verify_replacement):
    """Draft a tree by sampling each node's children from q (with or without replacement),
    then verify it. Returns the emitted tokens."""
    kids = children_of(parents)
    parents_arr = np.array(parents)
    q_lists = Q.tolist()
    s = len(parents)

    def step(ctx, rng):
        prev = [ctx[-2]] + [0] * (s - 1)  # node n's context ends with (prev[n], tokens[n])
        tokens = [ctx[-1]] + [0] * (s - 1)
        for n in range(s):
            avail = list(q_lists[prev[n]][tokens[n]])
            for c in kids[n]:
                x = draw(avail, rng)
                tokens[c], prev[c] = x, tokens[n]
                if not draft_replacement:
                    avail[x] = 0.0  # the next sibling comes from q without x (renormalized)
        p, q = P[prev, tokens], Q[prev, tokens]  # [S, V]
        accepted, nxt = verify_sampling_tree(
            np.array(tokens), parents_arr, p, q, rng, verify_replacement
        )
        return [tokens[a] for a in accepted[1:]] + [nxt]

    return step


def lookup_tree_step(P, tables, parents, verify=verify_sampling_tree):
    """Deterministic tree: child j of a node carries tables[j % 2][context] -- so a node with
    three children has a duplicate first/third sibling, each with its own subtree."""
    kids = children_of(parents)
    parents_arr = np.array(parents)
    s = len(parents)

    def step(ctx, rng):
        prev = [ctx[-2]] + [0] * (s - 1)
        tokens = [ctx[-1]] + [0] * (s - 1)
        for n in range(s):
            for j, c in enumerate(kids[n]):
                tokens[c] = int(tables[j % 2][prev[n], tokens[n]])
                prev[c] = tokens[n]
        accepted, nxt = verify(np.array(tokens), parents_arr, P[prev, tokens], None, rng)
        return [tokens[a] for a in accepted[1:]] + [nxt]

    return step


def naive_lookup_tree(tokens, parents, p, q, rng):
    """Wrong rule: accept each deterministic child independently with prob p[n, x], never
    updating p between siblings, then sample from p[n]."""
    kids = children_of(parents.tolist())
    path, n = [0], 0
    while kids[n]:
        nxt = next((c for c in kids[n] if rng.random() < p[n, tokens[c]]), None)
        if nxt is None:
            break
        path.append(nxt)
        n = nxt
    return path, sample_from(p[n], rng)


# Two siblings at the root and at depth 1; three siblings (non-contiguous) at the root.
TWO_WIDE = [-1, 0, 0, 1, 1, 2, 3]
THREE_WIDE = [-1, 0, 1, 0, 0, 3, 1, 2]

# ------------------------------------------------------------------ statistical tests


@pytest.mark.parametrize(
    "replacement", [True, False], ids=["with-replacement", "without-replacement"]
)
@pytest.mark.parametrize("parents", [TWO_WIDE, THREE_WIDE], ids=["2-wide", "3-wide"])
def test_sampling_tree_is_lossless(parents, replacement):
    vocab = 5
    P = trigram_table(50, vocab)
    Q = trigram_table(51, vocab, zeros=1)  # support 4 >= 3 siblings without replacement
    step = sampled_tree_step(P, Q, parents, replacement, replacement)
    counts = emitted_counts(step, 3, vocab, seed=len(parents) + replacement)
    check = compare_to_distribution(counts, exact_joint(P, 3))
    assert check.ok, check
    two = counts.reshape(vocab * vocab, vocab).sum(axis=1)
    check = compare_to_distribution(two, exact_joint(P, 2))
    assert check.ok, check


def test_deterministic_tree_with_duplicate_siblings_is_lossless():
    vocab = 5
    P = trigram_table(60, vocab, zeros=2)
    rng = np.random.default_rng(61)
    tables = [rng.integers(0, vocab, size=(vocab, vocab)) for _ in range(2)]
    parents = [-1, 0, 0, 0, 1, 3, 3, 4]  # root children 1, 2, 3: tokens A, B, A
    counts = emitted_counts(lookup_tree_step(P, tables, parents), 3, vocab, seed=62)
    check = compare_to_distribution(counts, exact_joint(P, 3))
    assert check.ok, check


@pytest.mark.parametrize(
    "case",
    [
        # siblings drawn without replacement but verified with SpecInfer's i.i.d. rule
        "without-replacement-drafts-verified-as-iid",
        # i.i.d. siblings verified with the without-replacement rule
        "iid-drafts-verified-as-without-replacement",
        # deterministic children accepted independently, duplicates counted twice
        "naive-lookup",
    ],
)
def test_tree_negative_controls_fail_the_same_check(case):
    vocab = 5
    P = trigram_table(50, vocab)
    Q = trigram_table(51, vocab, zeros=1)
    if case == "naive-lookup":
        rng = np.random.default_rng(61)
        tables = [rng.integers(0, vocab, size=(vocab, vocab)) for _ in range(2)]
        step = lookup_tree_step(P, tables, [-1, 0, 0, 0, 1, 3, 3, 4], verify=naive_lookup_tree)
    else:
        drafted_iid = case.startswith("iid")
        step = sampled_tree_step(P, Q, THREE_WIDE, drafted_iid, verify_replacement=not drafted_iid)
    counts = emitted_counts(step, 2, vocab, seed=3)
    check = compare_to_distribution(counts, exact_joint(P, 2))
    assert not check.ok, check


# ------------------------------------------------------------------ property-based tests


@st.composite
def trees(draw_, max_nodes=32):
    s = draw_(st.integers(1, max_nodes))
    return [-1] + [draw_(st.integers(0, i - 1)) for i in range(1, s)]


@PROPERTY
@given(parents=trees(), past_len=st.integers(0, 50))
def test_layout_invariants(parents, past_len):
    layout = TreeLayout.from_parents(parents)
    s = len(parents)
    mask = layout.ancestor_mask()
    for i in range(s):
        for j in range(s):
            assert mask[i, j] == slow_is_ancestor(parents, i, j)
        if i:
            assert layout.depths[i] == layout.depths[parents[i]] + 1
        path = layout.path_to(i)
        assert path[0] == 0 and path[-1] == i and len(path) == layout.depths[i] + 1
        assert all(parents[b] == a for a, b in zip(path, path[1:]))
    assert layout.depths[0] == 0
    np.testing.assert_array_equal(layout.position_ids(past_len)[0], past_len + layout.depths)
    slow = slow_attention_bias(parents, past_len)
    np.testing.assert_array_equal(layout.attention_bias(past_len), slow)


@PROPERTY
@given(parents=trees(), seed=st.integers(0, 2**32 - 1))
def test_topological_order_relabels_any_numbering(parents, seed):
    s = len(parents)
    perm = np.random.default_rng(seed).permutation(s)  # perm[new_old] = original label
    inv = np.argsort(perm)
    shuffled = [-1 if parents[perm[i]] < 0 else int(inv[parents[perm[i]]]) for i in range(s)]
    order, new_parents = topological_order(shuffled)
    TreeLayout.from_parents(new_parents)  # valid convention
    assert sorted(order.tolist()) == list(range(s))
    for i in range(1, s):  # the same edges, relabelled
        assert shuffled[order[i]] == order[new_parents[i]]
    for kids in children_of(new_parents.tolist()):  # siblings keep their input order
        assert [order[k] for k in kids] == sorted(order[k] for k in kids)
    order, same = topological_order(parents)
    assert order.tolist() == list(range(s)) and same.tolist() == parents


@PROPERTY
@given(parents=trees(), data=st.data())
def test_greedy_tree_matches_slow_reference(parents, data):
    s = len(parents)
    tokens = data.draw(st.lists(st.integers(0, 2), min_size=s, max_size=s))
    target = data.draw(st.lists(st.integers(0, 2), min_size=s, max_size=s))
    got = verify_greedy_tree(np.array(tokens), np.array(parents), np.array(target))
    assert got == slow_greedy_walk(tokens, parents, target)


prob_entry = st.sampled_from([0.0, 0.0, 0.1, 0.25, 0.25, 1.0]) | st.floats(0.0, 1.0)


@st.composite
def sampling_tree_case(draw_):
    parents = draw_(trees(max_nodes=16))
    s = len(parents)
    vocab = draw_(st.integers(2, 5))

    p = np.stack([random_dist(draw_, prob_entry, vocab) for _ in range(s)])
    q = np.stack([random_dist(draw_, prob_entry, vocab) for _ in range(s)])
    tokens = [0] + [draw_(st.integers(0, vocab - 1)) for _ in range(1, s)]
    with_q = draw_(st.booleans())
    return (
        np.array(tokens),
        np.array(parents),
        p,
        q if with_q else None,
        draw_(st.booleans()),
        draw_(st.integers(0, 2**32 - 1)),
    )


@PROPERTY
@given(case=sampling_tree_case())
def test_sampling_tree_outputs_are_possible(case):
    tokens, parents, p, q, replacement, seed = case
    rng = np.random.default_rng(seed)
    accepted, nxt = verify_sampling_tree(tokens, parents, p, q, rng, replacement)
    assert accepted[0] == 0
    for a, b in zip(accepted, accepted[1:]):
        assert parents[b] == a  # a root-to-node path
        assert p[a, tokens[b]] > 0  # an accepted draft is possible under the target
    assert p[accepted[-1], nxt] > 0
    np.testing.assert_array_equal(kv_gather_indices(accepted, 5), 5 + np.array(accepted))


@PROPERTY
@given(
    k=st.integers(0, 6),
    vocab=st.integers(2, 5),
    with_q=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_chain_tree_equals_chain_verification(k, vocab, with_q, seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(vocab, 0.5), size=k + 1)
    q = rng.dirichlet(np.full(vocab, 0.5), size=k + 1)
    draft = np.array([draw(q[i].tolist(), rng) for i in range(k)], dtype=np.int64)
    qq = q if with_q else None
    q_chain = None if qq is None else q[:k]
    chain = verify_sampling(draft, p, q_chain, np.random.default_rng(seed + 1))
    tokens = np.concatenate([[0], draft])
    for replacement in (True, False):
        accepted, nxt = verify_sampling_tree(
            tokens, chain_parents(k), p, qq, np.random.default_rng(seed + 1), replacement
        )
        assert (len(accepted) - 1, nxt) == chain
        assert accepted == list(range(len(accepted)))


# ------------------------------------------------------------------ siblings


def _rows(*rows):
    return np.array(rows, dtype=float)


def test_rejected_siblings_leave_the_callers_q_untouched():
    """Without replacement a rejected sibling's token is zeroed in q_cur, a copy: q[n] itself is the caller's."""
    p = _rows([0.0, 0.2, 0.2, 0.6], [0.25] * 4, [0.25] * 4)
    q = _rows([0.0, 0.5, 0.5, 0.0], [0.25] * 4, [0.25] * 4)
    q_before = q.copy()
    # child 1 (token 1): p/q = 0.4, u = 0.9 rejects; p_cur = normalize(max(0, p - q)) = onehot(3);
    # q_cur = onehot(2): child 2 has p_cur[2] = 0, rejected; recovered token from onehot(3)
    got = verify_sampling_tree(np.array([9, 1, 2]), np.array([-1, 0, 0]), p, q, FixedU(0.9, 0.0, 0.5))
    assert got == ([0], 3)
    np.testing.assert_array_equal(q, q_before)


def test_a_sibling_the_target_cannot_emit_is_rejected_even_at_u_zero():
    """u * q[x] < p[x] with p[x] = 0 never holds: u = 0 must not accept it (the chain's rule, per sibling)."""
    p = _rows([0.5, 0.0, 0.0, 0.5], [0.25] * 4, [0.25] * 4)
    q = _rows([0.0, 0.5, 0.5, 0.0], [0.25] * 4, [0.25] * 4)
    for replacement in (False, True):
        # both children rejected at u = 0; p_cur = normalize(max(0, p - q)) = p; the last draw 0.6 picks token 3
        got = verify_sampling_tree(np.array([9, 1, 2]), np.array([-1, 0, 0]), p, q, FixedU(0.0, 0.0, 0.6),
                                   replacement)
        assert got == ([0], 3)


def test_duplicate_siblings_resolve_to_the_first_in_index_order():
    """Nodes 1 and 2 both carry token 1: greedy and lookup walks take node 1 (the docstrings' "first child")."""
    tokens, parents = np.array([9, 1, 1, 3, 4]), np.array([-1, 0, 0, 1, 2])
    assert verify_greedy_tree(tokens, parents, np.array([1, 3, 4, 7, 8])) == ([0, 1, 3], 7)
    p = _rows([0, 1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0, 0, 0, 0],
              [0, 0, 0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0, 1])
    assert verify_sampling_tree(tokens, parents, p, None, FixedU(0.5, 0.5, 0.5)) == ([0, 1, 3], 7)
