"""Audit tests for kernels (verify, sampling, stats, postprocess, tree siblings): the edges that mutation testing
showed the other kernel tests leave open. Exact values derived by hand, or small plain-Python references."""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

import numpy as np
import pytest

from kernels.postprocess import HEAD_INPUTS, head_feeds, sampling_head_reference
from kernels.sampling import make_sampler, probs_from_top, process_logits
from distribution import DistributionCheck, chi2_quantile, compare_to_distribution
from kernels.tree import verify_greedy_tree, verify_sampling_tree
from kernels.verify import recovered_distribution, scatter_trimmed, verify_greedy, verify_sampling
from toy_lm import FixedU

# ------------------------------------------------------------------------- verify.py


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


# ------------------------------------------------------------------------- sampling.py


def test_top_p_just_below_one_keeps_every_token_when_rounding_leaves_the_nucleus_short():
    """float64 logits: the sorted cumulative mass can end an ulp below top_p * (pairwise) sum; the cut then keeps
    every token instead of indexing past the row."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(rng.integers(3, 40))
    top_p = 1 - 2**-53  # the largest float below 1
    e = np.exp(x - x.max())
    want = e / e.sum()
    assert np.cumsum(-np.sort(-want))[-1] < top_p * want.sum()  # the case: rounding leaves the nucleus short
    got = process_logits(x, 1.0, 0, top_p)
    assert got.dtype == np.float64 and np.count_nonzero(got) == x.size
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_top_k_as_wide_as_the_vocabulary_is_no_top_k_for_probs_from_top():
    """process_logits keeps min(top_k, V) tokens, so top_k >= V disables top-k: a nucleus that closes inside the
    head's K is then read from it (exact), as with top_k = 0."""
    p = np.array([[0.5, 0.25]])  # the head's 2 best of 4 tokens (the other two hold 0.25)
    ids = np.array([[2, 0]])
    for top_k in (0, 4, 9):
        got, exact = probs_from_top(ids, p, 4, top_k, 0.5)
        assert exact.tolist() == [True], top_k
        np.testing.assert_array_equal(got[0], [0, 0, 1, 0])
    logits = np.log(np.array([0.25, 0.125, 0.5, 0.125]))
    np.testing.assert_array_equal(process_logits(logits, 1.0, 4, 0.5), [0, 0, 1, 0])


def test_batched_sampler_uses_one_draw_per_row_in_row_order():
    sample = make_sampler(1.0)
    logits = np.zeros((3, 2))  # every row uniform over two tokens: u < 0.5 -> 0, u >= 0.5 -> 1
    np.testing.assert_array_equal(sample(logits, FixedU(0.1, 0.9, 0.9)), [0, 1, 1])
    np.testing.assert_array_equal(sample(logits, FixedU(0.9, 0.1, 0.1)), [1, 0, 0])


# ------------------------------------------------------------------------- stats.py


def test_distribution_check_values_by_hand():
    """n = 100 over expected [.3, .5, .15, .04, .01]: the last two cells (expected counts 4 and 1) are pooled into
    one of 5, the first three stay; TV, its bound and Pearson's chi-square follow from the module's formulas."""
    expected = np.array([0.3, 0.5, 0.15, 0.04, 0.01])
    check = compare_to_distribution([25, 55, 15, 3, 2], expected)
    assert check.n == 100 and check.impossible == 0
    assert check.tv == pytest.approx(0.5 * (0.05 + 0.05 + 0 + 0.01 + 0.01))
    e_tv = 0.5 * sum(math.sqrt(e * (1 - e) / 100) for e in expected)
    assert check.tv_bound == pytest.approx(e_tv + math.sqrt(math.log(1e6) / 200))
    assert check.dof == 3  # 4 cells: 3 big + 1 pooled
    assert check.chi2 == pytest.approx(5**2 / 30 + 5**2 / 50 + 0 + 0)  # pooled: observed 5, expected 5
    assert check.chi2_threshold == pytest.approx(chi2_quantile(3, 1e-6))
    assert check.ok


def _wilson_hilferty(dof, alpha):
    z = NormalDist().inv_cdf(1 - alpha)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("dof, alpha, exact", [(1, 1e-3, 10.828), (3, 1e-3, 16.266), (3, 1e-6, 30.665),
                                               (10, 1e-3, 29.588)])
def test_chi2_quantile_is_wilson_hilferty_one_sided(dof, alpha, exact):
    """Against the Wilson-Hilferty formula written out, and on the conservative side of the true quantile (exact,
    from tables) by less than 8 %."""
    q = chi2_quantile(dof, alpha)
    assert q == pytest.approx(_wilson_hilferty(dof, alpha), rel=1e-12)
    assert exact <= q < 1.08 * exact


def test_distribution_check_fails_on_any_single_criterion():
    impossible = compare_to_distribution([50, 50, 1], [0.5, 0.5, 0.0])
    assert impossible.impossible == 1 and impossible.tv < impossible.tv_bound
    assert impossible.chi2 < impossible.chi2_threshold and not impossible.ok
    # a small cell twice too full: TV stays within its bound, chi-square does not
    chi2 = compare_to_distribution([9800, 200], [0.99, 0.01])
    assert chi2.tv < chi2.tv_bound and chi2.chi2 == pytest.approx(100**2 / 9900 + 100**2 / 100)
    assert chi2.chi2 > chi2.chi2_threshold and not chi2.ok
    tv = DistributionCheck(n=10, tv=0.5, tv_bound=0.4, chi2=0.0, chi2_threshold=1.0, dof=1, impossible=0)
    assert not tv.ok and dataclasses.replace(tv, tv=0.3).ok


def test_distribution_check_refuses_expected_that_is_not_a_distribution():
    with pytest.raises(AssertionError):
        compare_to_distribution([5, 5], [0.5, 0.6])
    with pytest.raises(AssertionError):
        compare_to_distribution([5, 5], [1.5, -0.5])


# ------------------------------------------------------------------------- postprocess.py


def test_head_feeds():
    greedy = head_feeds(8)
    assert set(greedy) == set(HEAD_INPUTS)
    assert greedy["top_k"].dtype == np.int64 and greedy["top_k"].tolist() == [8]
    assert greedy["temperature"].dtype == np.float32 and greedy["temperature"].tolist() == [1.0]
    assert greedy["sample"].shape == () and not greedy["sample"]
    sampling = head_feeds(40, 0.5)
    assert sampling["top_k"].tolist() == [40] and sampling["temperature"].tolist() == [0.5] and sampling["sample"]


def test_reference_head_by_hand():
    """Best first, ties toward the lower id; a greedy call's probabilities are a copy of its logits, a sampling
    call's are softmax(logits / T) over the whole row."""
    x = np.array([[1.0, 3.0, 3.0, 0.0]])
    top, ids, probs = sampling_head_reference(x, 3, None)
    np.testing.assert_array_equal(ids, [[1, 2, 0]])
    np.testing.assert_array_equal(top, [[3.0, 3.0, 1.0]])
    np.testing.assert_array_equal(probs, top)
    _, _, probs = sampling_head_reference(x, 2, 0.5)
    z = np.exp(np.array([2.0, 6.0, 6.0, 0.0]))
    np.testing.assert_allclose(probs, [[z[1] / z.sum(), z[2] / z.sum()]], rtol=1e-6)


# ------------------------------------------------------------------------- tree.py: siblings


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


@pytest.mark.parametrize("top_k", [float("inf"), float("nan"), np.float64("inf"), "3"])
def test_a_non_finite_or_non_numeric_top_k_is_named(top_k):
    """Like temperature and top_p: int(inf) raised OverflowError, int(nan) a ValueError that named nothing."""
    with pytest.raises(ValueError, match="top_k"):
        make_sampler(1.0, top_k)
    with pytest.raises(ValueError, match="top_k"):
        process_logits(np.zeros(4), 1.0, top_k)
