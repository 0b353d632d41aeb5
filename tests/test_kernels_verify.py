"""Tests for kernels.verify (chains): exact cases, losslessness statistics, properties.

The statistical tests run a whole speculative generation loop on a toy target and a toy
drafter (trigram tables: the next-token distribution depends on the last two tokens). Draft
tokens are sampled from q inside the test, verified, and the emitted tokens are compared with
the target's exact joint distribution -- that is what "lossless" means.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.sampling import sample_from
from distribution import compare_to_distribution
from kernels.verify import (
    recovered_distribution,
    scatter_trimmed,
    verify_greedy,
    verify_sampling,
)
from toy_lm import START, FixedU, draw, emitted_counts, exact_joint, random_dist, trigram_table

PROPERTY = settings(max_examples=200, deadline=None, database=None)


# ------------------------------------------------------------------------- toy models


def chain_step(P, Q, k, verify):
    """One speculative step: draft k tokens from Q (sampled), verify against P."""
    q_lists = Q.tolist()

    def step(ctx, rng):
        c = list(ctx)
        for _ in range(k):
            c.append(draw(q_lists[c[-2]][c[-1]], rng))
        draft = c[len(ctx) :]
        a, b = c[len(ctx) - 2 : -1], c[len(ctx) - 1 :]  # row i's context ends with (a[i], b[i])
        n, nxt = verify(np.array(draft, dtype=np.int64), P[a, b], Q[a[:k], b[:k]], rng)
        return draft[:n] + [nxt]

    return step


def lookup_step(P, table, k, verify):
    """Deterministic drafter: the draft after (a, b) is table[a, b]; q is None."""

    def step(ctx, rng):
        c = list(ctx)
        for _ in range(k):
            c.append(int(table[c[-2], c[-1]]))
        draft = c[len(ctx) :]
        a, b = c[len(ctx) - 2 : -1], c[len(ctx) - 1 :]
        n, nxt = verify(np.array(draft, dtype=np.int64), P[a, b], None, rng)
        return draft[:n] + [nxt]

    return step


# Deliberately wrong rules for negative controls.


def accept_always(draft, p, q, rng):
    return len(draft), sample_from(p[len(draft)], rng)


def recover_from_target(draft, p, q, rng):
    """Rejects correctly but resamples from p instead of the residual max(0, p - q)."""
    for i, x in enumerate(draft):
        if not rng.random() * q[i, x] < p[i, x]:
            return i, sample_from(p[i], rng)
    return len(draft), sample_from(p[len(draft)], rng)


def bonus_from_last_draft_row(draft, p, q, rng):
    """Correct accept/reject, but the bonus token after a fully accepted chain comes from p[K-1], not p[K]."""
    p = np.array(p)
    p[len(draft)] = p[len(draft) - 1]
    return verify_sampling(draft, p, q, rng)


def resample_on_mismatch(draft, p, q, rng):
    """Deterministic-drafter bug: on a mismatch draws a fresh token instead of keeping y."""
    for i, x in enumerate(draft):
        if sample_from(p[i], rng) != x:
            return i, sample_from(p[i], rng)
    return len(draft), sample_from(p[len(draft)], rng)


# ------------------------------------------------------------------ exact, table-driven


@pytest.mark.parametrize(
    "draft, target_argmax, expected",
    [
        ([5, 6, 7], [5, 6, 7, 8], (3, 8)),  # all accepted: bonus
        ([5, 6, 7], [4, 6, 7, 8], (0, 4)),  # none: correction at 0
        ([5, 6, 7], [5, 6, 9, 8], (2, 9)),  # middle
        ([5, 6, 7], [5, 1, 7, 8], (1, 1)),  # later matches after a mismatch do not count
        ([], [3], (0, 3)),  # no drafts
    ],
)
def test_verify_greedy_table(draft, target_argmax, expected):
    assert verify_greedy(np.array(draft, dtype=np.int64), np.array(target_argmax)) == expected
    # the engine passes Python lists (and a column view of the head's ids): the same answer, as Python ints
    got = verify_greedy(list(draft), np.array(target_argmax)[:, None][:, 0])
    assert got == expected and all(type(x) is int for x in got)


def test_verify_greedy_refuses_wrong_shapes():
    with pytest.raises(AssertionError):
        verify_greedy(np.array([[5, 6]]), np.array([5, 6, 7]))  # a 2-D draft
    with pytest.raises(AssertionError):
        verify_greedy([5, 6], [5, 6])  # argmax needs one more row than the draft


def _onehot(i, v=4):
    row = np.zeros(v)
    row[i] = 1.0
    return row


@pytest.mark.parametrize(
    "draft, p, q, us, expected",
    [
        # p == q: accepted whatever u is, bonus from p[K]
        (
            [1, 2],
            [_onehot(1), _onehot(2), _onehot(3)],
            [_onehot(1), _onehot(2)],
            [0.99, 0.99, 0.5],
            (2, 3),
        ),
        # p[x] == 0: rejected even at u = 0; recovered from max(0, p - q) = onehot(0)
        ([1], [_onehot(0), _onehot(3)], [_onehot(1)], [0.0, 0.7], (0, 0)),
        # q[x] == 0 (caller bug): rejected even though u * q < p would hold
        ([2], [[0.5, 0, 0.5, 0], _onehot(3)], [_onehot(1)], [0.0, 0.99], (0, 2)),
        # ratio p/q = 0.5: u = 0.49 accepts, u = 0.5 rejects
        ([0], [[0.3, 0.7, 0, 0], _onehot(2)], [[0.6, 0.4, 0, 0]], [0.49, 0.1], (1, 2)),
        ([0], [[0.3, 0.7, 0, 0], _onehot(2)], [[0.6, 0.4, 0, 0]], [0.5, 0.1], (0, 1)),
        # residual of [0.3,0.7] - [0.6,0.4] is onehot(1) even though p[1] < 1
        ([0], [[0.3, 0.7, 0, 0], _onehot(2)], [[0.6, 0.4, 0, 0]], [0.9, 0.0], (0, 1)),
    ],
)
def test_verify_sampling_table(draft, p, q, us, expected):
    p, q = np.array(p, dtype=float), np.array(q, dtype=float)
    got = verify_sampling(np.array(draft), p, q, FixedU(*us))
    assert got == expected


@pytest.mark.parametrize(
    "draft, p, us, expected",
    [
        ([1, 2], [_onehot(1), _onehot(2), _onehot(0)], [0.3, 0.3, 0.3], (2, 0)),
        # y ~ p[0] = [0.5, 0.5]: u = 0.7 -> y = 1 != draft 0, and y is the next token
        ([0, 2], [[0.5, 0.5, 0, 0], _onehot(2), _onehot(0)], [0.7], (0, 1)),
        ([0, 2], [[0.5, 0.5, 0, 0], [0, 0.5, 0, 0.5], _onehot(0)], [0.2, 0.9], (1, 3)),
    ],
)
def test_verify_sampling_deterministic_drafter_table(draft, p, us, expected):
    assert verify_sampling(np.array(draft), np.array(p, dtype=float), None, FixedU(*us)) == expected


def test_recovered_distribution_values_and_fallback():
    np.testing.assert_allclose(
        recovered_distribution(np.array([0.5, 0.3, 0.2, 0.0]), np.array([0.1, 0.5, 0.2, 0.2])),
        [1.0, 0.0, 0.0, 0.0],
    )
    np.testing.assert_allclose(
        recovered_distribution(np.array([0.4, 0.4, 0.2]), np.array([0.2, 0.2, 0.6])),
        [0.5, 0.5, 0.0],
    )
    p = np.array([0.25, 0.75])
    np.testing.assert_allclose(recovered_distribution(p, p.copy()), p)  # numerical guard


def test_scatter_trimmed_places_rows():
    q_trim = np.array([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]])
    q = scatter_trimmed(q_trim, np.array([4, 0, 2]), 6)
    np.testing.assert_array_equal(
        q, [[0.25, 0, 0.25, 0, 0.5, 0], [1.0, 0, 0, 0, 0, 0]]
    )
    assert scatter_trimmed(q_trim[0], np.array([4, 0, 2]), 6).shape == (6,)


@pytest.mark.parametrize(
    "id_map, match",
    [
        ([4, 0, 6], "range"),
        ([4, -1, 2], "range"),
        ([4, 0, 4], "duplicate"),
        ([4, 0], "one entry per"),
        ([4.0, 0.0, 2.0], "integer"),
    ],
)
def test_scatter_trimmed_validates_id_map(id_map, match):
    with pytest.raises(ValueError, match=match):
        scatter_trimmed(np.full((2, 3), 1 / 3), np.array(id_map), 6)


def test_verify_sampling_is_reproducible_with_a_seed():
    P = trigram_table(0, 6)
    Q = trigram_table(1, 6)
    step = chain_step(P, Q, 4, verify_sampling)
    runs = [[step(list(START), np.random.default_rng(s)) for s in range(50)] for _ in range(2)]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------ statistical tests


# (4, 1, 3) and (5, 2, 3): the bonus token after a fully accepted chain falls inside the counted window
@pytest.mark.parametrize("vocab, k, n_tokens", [(6, 1, 1), (8, 3, 1), (5, 2, 2), (4, 4, 2), (4, 1, 3), (5, 2, 3)])
def test_chain_sampling_is_lossless(vocab, k, n_tokens):
    P = trigram_table(10 + vocab, vocab)
    Q = trigram_table(20 + vocab, vocab, zeros=2)
    counts = emitted_counts(chain_step(P, Q, k, verify_sampling), n_tokens, vocab, seed=k)
    check = compare_to_distribution(counts, exact_joint(P, n_tokens))
    assert check.ok, check


def test_trimmed_vocabulary_drafter_is_lossless():
    vocab, id_map = 6, np.array([4, 0, 2])  # the drafter only knows tokens 4, 0, 2
    P = trigram_table(30, vocab, zeros=0)
    Q_trim = np.random.default_rng(31).dirichlet(np.full(3, 0.8), size=(vocab, vocab))
    Q_full = scatter_trimmed(Q_trim, id_map, vocab)  # [V, V, V]

    q_trim_lists = Q_trim.tolist()

    def step(ctx, rng):
        c = list(ctx)
        for _ in range(3):
            j = draw(q_trim_lists[c[-2]][c[-1]], rng)  # sampled in the drafter's own vocabulary
            c.append(int(id_map[j]))
        draft = c[len(ctx) :]
        a, b = c[len(ctx) - 2 : -1], c[len(ctx) - 1 :]
        n, nxt = verify_sampling(np.array(draft), P[a, b], Q_full[a[:3], b[:3]], rng)
        return draft[:n] + [nxt]

    counts = emitted_counts(step, 2, vocab, seed=32)
    check = compare_to_distribution(counts, exact_joint(P, 2))
    assert check.ok, check


@pytest.mark.parametrize("vocab, k", [(5, 3), (7, 2)])
def test_deterministic_drafter_chain_is_lossless(vocab, k):
    P = trigram_table(40 + vocab, vocab, zeros=2)
    table = np.random.default_rng(41).integers(0, vocab, size=(vocab, vocab))  # hits p = 0 too
    counts = emitted_counts(lookup_step(P, table, k, verify_sampling), 2, vocab, seed=42)
    check = compare_to_distribution(counts, exact_joint(P, 2))
    assert check.ok, check


@pytest.mark.parametrize(
    "make_step",
    [
        pytest.param(lambda P, Q, T: chain_step(P, Q, 2, accept_always), id="accept-always"),
        pytest.param(lambda P, Q, T: chain_step(P, Q, 2, recover_from_target), id="recover-from-p"),
        pytest.param(lambda P, Q, T: chain_step(P, Q, 1, bonus_from_last_draft_row), id="bonus-from-p[K-1]"),
        pytest.param(
            lambda P, Q, T: lookup_step(P, T, 3, resample_on_mismatch), id="lookup-resample"
        ),
    ],
)
def test_negative_controls_fail_the_same_check(make_step):
    vocab = 5
    P = trigram_table(15, vocab)
    Q = trigram_table(25, vocab, zeros=2)
    table = np.random.default_rng(41).integers(0, vocab, size=(vocab, vocab))
    counts = emitted_counts(make_step(P, Q, table), 2, vocab, seed=2)
    check = compare_to_distribution(counts, exact_joint(P, 2))
    assert not check.ok, check


# ------------------------------------------------------------------ property-based tests

prob_entry = st.sampled_from([0.0, 0.0, 0.1, 0.25, 0.25, 1.0, 2.0]) | st.floats(0.0, 1.0)


@st.composite
def chain_case(draw_, with_q=True):
    vocab = draw_(st.integers(2, 6))
    k = draw_(st.integers(0, 5))

    p = np.stack([random_dist(draw_, prob_entry, vocab) for _ in range(k + 1)])
    if k:
        q = np.stack([random_dist(draw_, prob_entry, vocab) for _ in range(k)])
    else:
        q = np.zeros((0, vocab))
    # drafts mostly from q's support, sometimes anything (a caller bug must not crash)
    draft = [
        draw_(st.sampled_from(np.flatnonzero(q[i] > 0).tolist()) | st.integers(0, vocab - 1))
        for i in range(k)
    ]
    seed = draw_(st.integers(0, 2**32 - 1))
    return np.array(draft, dtype=np.int64), p, (q if with_q else None), seed


@PROPERTY
@given(case=chain_case(with_q=True) | chain_case(with_q=False))
def test_verify_sampling_outputs_are_possible(case):
    draft, p, q, seed = case
    n, nxt = verify_sampling(draft, p, q, np.random.default_rng(seed))
    assert 0 <= n <= len(draft)
    for i in range(n):  # an accepted draft is possible under both target and drafter
        assert p[i, draft[i]] > 0 and (q is None or q[i, draft[i]] > 0)
    assert p[n, nxt] > 0  # recovered/bonus tokens come from p's support
    if q is not None and n < len(draft):
        assert nxt in np.flatnonzero(recovered_distribution(p[n], q[n]) > 0)


@PROPERTY
@given(
    k=st.integers(0, 8),
    data=st.data(),
)
def test_verify_greedy_matches_slow_loop(k, data):
    draft = data.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k))
    target = data.draw(st.lists(st.integers(0, 2), min_size=k + 1, max_size=k + 1))
    n = 0
    while n < k and draft[n] == target[n]:
        n += 1
    assert verify_greedy(np.array(draft, dtype=np.int64), np.array(target)) == (n, target[n])


# ------------------------------------------------------------------ shapes and edge cases


def test_verify_greedy_refuses_2d_ids_and_an_argmax_of_the_wrong_length():
    with pytest.raises(AssertionError):
        verify_greedy(np.array([[5], [6]]), np.array([5, 6, 7]))  # a column of drafts is not a chain
    with pytest.raises(AssertionError):
        verify_greedy(np.array([5, 6]), np.array([[5], [6], [7]]))
    with pytest.raises(AssertionError):
        verify_greedy([5, 6], [5, 6, 7, 8])  # exactly K + 1 rows, not more


@pytest.mark.parametrize("q_shape", [(3, 4), (2, 5), (2, 3)])
def test_verify_sampling_refuses_a_q_of_the_wrong_shape(q_shape):
    p = np.full((3, 4), 0.25)
    with pytest.raises(AssertionError):
        verify_sampling(np.array([0, 1]), p, np.full(q_shape, 1 / q_shape[1]), FixedU(0.0, 0.0, 0.0))


def test_scatter_trimmed_keeps_the_dtype():
    q_trim = np.array([1 / 3, 2 / 3])  # float64: a float32 q would move p/q ratios by ~1e-8
    q = scatter_trimmed(q_trim, np.array([2, 0]), 3)
    assert q.dtype == np.float64
    np.testing.assert_array_equal(q, [2 / 3, 0.0, 1 / 3])
    assert scatter_trimmed(q_trim.astype(np.float32), np.array([2, 0]), 3).dtype == np.float32


def test_recovered_distribution_keeps_a_tiny_residual():
    """Only an all-zero residual falls back to p: a small but positive one is normalized like any other."""
    p = np.array([0.50005, 0.49995, 0.0])
    q = np.array([0.5, 0.5, 0.0])
    np.testing.assert_allclose(recovered_distribution(p, q), [1.0, 0.0, 0.0])
