"""Tests for kernels.sampling: exact cases, a slow reference, statistics and properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kernels.sampling import make_sampler, probs_from_top, process_logits, sample_from
from distribution import chi2_quantile, compare_to_distribution
from toy_lm import FixedU, slow_process

PROPERTY = settings(max_examples=200, deadline=None, database=None)


# ---------------------------------------------------------------- exact, table-driven cases

LOG_1234 = np.log(np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32))


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, [0.1, 0.2, 0.3, 0.4]),
        ({"temperature": 0.5}, [1 / 30, 4 / 30, 9 / 30, 16 / 30]),
        ({"top_k": 2}, [0, 0, 3 / 7, 4 / 7]),
        ({"top_k": 4}, [0.1, 0.2, 0.3, 0.4]),
        ({"top_k": 99}, [0.1, 0.2, 0.3, 0.4]),
        ({"top_p": 0.35}, [0, 0, 0, 1]),
        ({"top_p": 0.69}, [0, 0, 3 / 7, 4 / 7]),
        ({"top_p": 0.71}, [0, 2 / 9, 3 / 9, 4 / 9]),
        # top-k first: {1,2,3} -> [2,3,4]/9, then the nucleus 4/9 + 3/9 >= 0.75 -> {2,3}.
        # (top-p first would keep {1,2,3}: 0.4 + 0.3 < 0.75.)
        ({"top_k": 3, "top_p": 0.75}, [0, 0, 3 / 7, 4 / 7]),
    ],
)
def test_process_logits_table(kwargs, expected):
    np.testing.assert_allclose(process_logits(LOG_1234, **kwargs), expected, atol=1e-6)


@pytest.mark.parametrize(
    "logits, kwargs, expected",
    [
        # top-k ties at the cut go to the lower token id
        ([1, 3, 3, 3, 0], {"top_k": 2}, [0, 0.5, 0.5, 0, 0]),
        ([3, 3, 3, 3], {"top_k": 1}, [1, 0, 0, 0]),
        # top-p ties: uniform 4 tokens, 0.5 needs exactly two, the lowest ids
        ([0, 0, 0, 0], {"top_p": 0.5}, [0.5, 0.5, 0, 0]),
        ([0, 0, 0, 0], {"top_p": 0.51}, [1 / 3, 1 / 3, 1 / 3, 0]),
        # nucleus boundary on a tie: [0.4, 0.3, 0.3] at 0.5 keeps 0.4 and the first 0.3
        (np.log([0.4, 0.3, 0.3]), {"top_p": 0.5}, [4 / 7, 3 / 7, 0]),
        (np.log([0.3, 0.4, 0.3]), {"top_p": 0.5}, [3 / 7, 4 / 7, 0]),
        # -inf is a legitimate mask
        ([-np.inf, 0.0, -np.inf, 0.0], {}, [0, 0.5, 0, 0.5]),
        ([-np.inf, 0.0, -np.inf, 0.0], {"top_k": 3}, [0, 0.5, 0, 0.5]),
    ],
)
def test_process_logits_ties_and_masks(logits, kwargs, expected):
    got = process_logits(np.asarray(logits, dtype=np.float32), **kwargs)
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_process_logits_batched_rows_are_independent():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 11)).astype(np.float32)
    got = process_logits(logits, temperature=0.8, top_k=5, top_p=0.8)
    assert got.shape == (2, 3, 11) and got.dtype == np.float32
    for i in range(2):
        for j in range(3):
            np.testing.assert_array_equal(got[i, j], process_logits(logits[i, j], 0.8, 5, 0.8))
            ref = slow_process(logits[i, j], 0.8, 5, 0.8)
            np.testing.assert_allclose(got[i, j], ref, atol=1e-6)


def test_process_logits_float64_stays_float64_and_input_untouched():
    logits = np.array([1.0, 2.0, 2.0, 0.5])
    before = logits.copy()
    out = process_logits(logits, temperature=0.7, top_k=3, top_p=0.9)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(logits, before)


def test_a_nucleus_wider_than_the_first_candidate_tier_is_not_cut_there():
    """The top 512 tokens hold most of the mass but less than top-p: the cut must go on to the wider tiers (a loop
    that stopped at half the target would cut a 0.9 nucleus of ~7,600 tokens to 512)."""
    rng = np.random.default_rng(3)
    logits = np.concatenate([rng.normal(2.2, 0.1, 512), rng.normal(-3.0, 1.0, 20_000)])
    got = process_logits(logits, top_p=0.9)
    head = np.sort(process_logits(logits, 1.0))[::-1][:512].sum()
    assert 0.4 < head < 0.9, head  # the first tier holds much of the nucleus, not all of it
    np.testing.assert_allclose(got, slow_process(logits, top_p=0.9), atol=1e-12)
    assert np.count_nonzero(got) > 512


def test_process_logits_wide_nucleus_takes_full_sort_path():
    # 10k nearly flat logits: the nucleus is wider than the first candidate tiers.
    rng = np.random.default_rng(1)
    logits = rng.normal(scale=0.1, size=10_000)
    got = process_logits(logits, top_p=0.9)
    np.testing.assert_allclose(got, slow_process(logits, top_p=0.9), atol=1e-12)
    assert 8000 < np.count_nonzero(got) < 10_000


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_sampler(**{"temperature": 1.0, **kwargs})
    with pytest.raises(ValueError, match=name):
        process_logits(LOG_1234, **{"temperature": 1.0, **kwargs})


def test_process_logits_rejects_greedy_temperature():
    with pytest.raises(ValueError, match="temperature"):
        process_logits(LOG_1234, temperature=0.0)


@pytest.mark.parametrize(
    "row, match",
    [
        ([0.0, np.nan, 1.0], "NaN"),
        ([np.nan, np.nan, np.nan], "NaN"),
        ([0.0, np.inf, 1.0], r"\+inf"),
        ([-np.inf, -np.inf, -np.inf], "all -inf"),
    ],
)
def test_bad_logits_raise(row, match):
    logits = np.array([[0.0, 1.0, 2.0], row], dtype=np.float32)
    with pytest.raises(ValueError, match=match):
        process_logits(logits)
    with pytest.raises(ValueError, match=match):
        make_sampler(0.0)(logits)
    with pytest.raises(ValueError, match=match):
        make_sampler(1.0)(logits, np.random.default_rng(0))


@pytest.mark.parametrize(
    "probs, u, expected",
    [
        ([0.0, 0.5, 0.0, 0.5], 0.0, 1),
        ([0.0, 0.5, 0.0, 0.5], 0.4999999, 1),
        ([0.0, 0.5, 0.0, 0.5], 0.5, 3),
        ([0.0, 0.5, 0.0, 0.5], 1.0 - 2**-53, 3),
        ([0.5, 0.5, 0.0, 0.0], 1.0 - 2**-53, 1),  # trailing zeros are never reached
        ([0.0, 0.0, 1.0, 0.0], 0.0, 2),
        ([2.0, 6.0], 0.25, 1),  # unnormalized weights: cdf [2, 8], u * 8 = 2 -> token 1
        ([2.0, 6.0], 0.2499, 0),
    ],
)
def test_sample_from_inverse_cdf(probs, u, expected):
    assert sample_from(np.array(probs), FixedU(u)) == expected


def test_sample_from_reaches_tiny_tokens_of_a_float32_vocabulary():
    """A float32 cdf rounded 0.75 + 2e-8 back to 0.75: the middle token had no width and was never drawn."""
    probs = np.array([0.75, 2e-8, 0.25], np.float32)
    total = 0.75 + float(probs[1]) + 0.25
    assert sample_from(probs, FixedU((0.75 + 1e-8) / total)) == 1


def test_a_huge_temperature_keeps_minus_inf_logits_impossible():
    """1/T rounded to 0 in float32 and -inf * 0 made the whole row NaN; the limit is uniform over the finite
    logits, as the top-k path already gave."""
    x = np.array([0.0, -np.inf, 3.0, -2.0], np.float32)
    for t in (1e39, 1e300):
        np.testing.assert_allclose(process_logits(x, t), [1 / 3, 0, 1 / 3, 1 / 3], rtol=1e-6)
        np.testing.assert_allclose(process_logits(x, t, top_k=3), [1 / 3, 0, 1 / 3, 1 / 3], rtol=1e-6)


def test_sample_from_rejects_empty_mass():
    with pytest.raises(ValueError, match="sum"):
        sample_from(np.zeros(4), np.random.default_rng(0))


def test_greedy_sampler_is_argmax_and_ignores_rng():
    sample = make_sampler(0.0, top_k=1, top_p=0.5)
    assert sample(np.array([0.1, 3.0, 3.0, -1.0])) == 1  # ties -> lower id
    batch = np.array([[0.0, 1.0, 0.5], [9.0, -np.inf, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(sample(batch), [1, 0])
    assert isinstance(sample(batch[0]), int)


def test_sampler_needs_rng_and_is_reproducible():
    sample = make_sampler(0.9, top_k=5, top_p=0.95)
    logits = np.random.default_rng(3).normal(size=(4, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="rng"):
        sample(logits)
    a = sample(logits, np.random.default_rng(7))
    b = sample(logits, np.random.default_rng(7))
    assert a.shape == (4,) and a.dtype == np.int64
    np.testing.assert_array_equal(a, b)
    assert isinstance(sample(logits[0], np.random.default_rng(7)), int)


def test_chi2_quantile_is_conservative_against_known_values():
    # Known chi-square quantiles: df=1, alpha=1e-3 -> 10.83; df=10, alpha=1e-3 -> 29.59.
    assert 10.83 <= chi2_quantile(1, 1e-3) < 13.0
    assert 29.5 < chi2_quantile(10, 1e-3) < 30.0


# ------------------------------------------------------------------ statistical tests

N_SAMPLES = 20_000


def test_sample_from_matches_distribution():
    rng = np.random.default_rng(11)
    probs = np.array([0.05, 0.0, 0.3, 0.15, 0.0, 0.5])
    counts = np.bincount([sample_from(probs, rng) for _ in range(N_SAMPLES)], minlength=6)
    check = compare_to_distribution(counts, probs)
    assert check.ok, check


def test_sampler_matches_slow_reference_distribution():
    rng = np.random.default_rng(12)
    logits = np.array([2.0, 1.0, 1.0, 0.5, -1.0, 3.0, 0.0, -0.5], dtype=np.float32)
    sample = make_sampler(0.8, top_k=6, top_p=0.9)
    tokens = sample(np.broadcast_to(logits, (N_SAMPLES, 8)), rng)
    expected = np.array(slow_process(logits, 0.8, 6, 0.9))
    check = compare_to_distribution(np.bincount(tokens, minlength=8), expected)
    assert check.ok, check


def test_distribution_check_has_power():
    # Negative control: the same check must reject a sampler that ignores temperature.
    rng = np.random.default_rng(13)
    logits = np.array([2.0, 1.0, 1.0, 0.5, -1.0, 3.0, 0.0, -0.5], dtype=np.float32)
    tokens = make_sampler(1.0, top_k=6, top_p=0.9)(np.broadcast_to(logits, (N_SAMPLES, 8)), rng)
    expected = np.array(slow_process(logits, 0.8, 6, 0.9))
    assert not compare_to_distribution(np.bincount(tokens, minlength=8), expected).ok


# ------------------------------------------------------------------ property-based tests

# Multiples of 1/8: exact in float32 and far apart, so rounding cannot create or break ties,
# while repeated values give plenty of real ties.
small_logits = st.lists(
    st.integers(-6, 6).map(float) | st.integers(-160, 160).map(lambda i: i / 8),
    min_size=1,
    max_size=12,
)


@PROPERTY
@given(
    logits=small_logits,
    temperature=st.sampled_from([0.05, 0.5, 1.0, 1.7, 10.0]),
    top_k=st.integers(0, 14),
    top_p=st.sampled_from([1e-9, 0.1, 0.5, 0.9, 0.999999, 1.0]) | st.floats(0.01, 1.0),
)
def test_process_logits_properties(logits, temperature, top_k, top_p):
    x = np.asarray(logits, dtype=np.float32)
    probs = process_logits(x, temperature, top_k, top_p)
    v = len(logits)
    assert probs.shape == (v,) and np.all(probs >= 0)
    assert abs(probs.sum() - 1.0) < 1e-5
    if 0 < top_k:
        assert np.count_nonzero(probs) <= top_k
    # exact agreement with the slow reference, unless the nucleus cut sits on a rounding edge
    ref = slow_process(x, temperature, top_k, top_p)
    if top_p < 1.0:
        ref_nt = slow_process(x, temperature, top_k, 1.0)
        order = sorted(range(v), key=lambda i: (-ref_nt[i], i))
        cum = np.cumsum([ref_nt[i] for i in order])
        assume(np.min(np.abs(cum - top_p)) > 1e-5)
    np.testing.assert_allclose(probs, ref, atol=1e-5)


@PROPERTY
@given(
    logits=small_logits,
    top_k=st.integers(1, 14),
    top_p=st.floats(0.01, 1.0),
)
def test_top_k_and_top_p_support_properties(logits, top_k, top_p):
    x = np.asarray(logits, dtype=np.float32)
    probs = process_logits(x, 1.0, top_k, top_p)
    kept = probs > 0
    # zero outside the top-k (ties to the lower id): kept ids are among the first k by rank
    rank = sorted(range(len(x)), key=lambda i: (-x[i], i))
    top = set(rank[:top_k])
    assert set(np.flatnonzero(kept)) <= top
    # nucleus: the kept mass (before renormalizing) reaches top_p; without its least
    # probable member it does not
    base = process_logits(x, 1.0, top_k, 1.0)
    mass = base[kept].sum()
    assert mass >= top_p - 1e-5
    assert mass - base[kept].min() < top_p + 1e-5


@PROPERTY
@given(
    weights=st.lists(
        st.sampled_from([0.0, 0.0, 1e-12, 0.1, 0.25, 0.25, 1.0, 3.0]), min_size=1, max_size=10
    ),
    u=st.floats(0.0, 1.0, exclude_max=True) | st.just(1.0 - 2**-53),
)
def test_sample_from_never_returns_zero_probability(weights, u):
    probs = np.asarray(weights)
    assume(probs.sum() > 0)
    token = sample_from(probs, FixedU(u))
    assert 0 <= token < len(probs) and probs[token] > 0
    assert sample_from(probs.astype(np.float32), FixedU(u)) in np.flatnonzero(probs > 0)


@PROPERTY
@given(logits=small_logits, data=st.data())
def test_non_finite_logits_raise(logits, data):
    x = np.asarray(logits, dtype=np.float32)
    i = data.draw(st.integers(0, len(x) - 1))
    x[i] = data.draw(st.sampled_from([np.nan, np.inf]))
    with pytest.raises(ValueError):
        process_logits(x)
    all_masked = np.full_like(x, -np.inf)
    with pytest.raises(ValueError, match="all -inf"):
        process_logits(np.stack([np.zeros_like(x), all_masked]))


@PROPERTY
@given(logits=small_logits, seed=st.integers(0, 2**32 - 1))
def test_sampler_never_returns_a_dropped_token(logits, seed):
    x = np.asarray(logits, dtype=np.float32)
    probs = process_logits(x, 0.7, 3, 0.8)
    token = make_sampler(0.7, top_k=3, top_p=0.8)(x, np.random.default_rng(seed))
    assert probs[token] > 0


def test_top_k_ids_best_first_with_ties_toward_the_lower_id():
    """Against a plain-Python reference: sort by (-value, id). Ties across the cut and inside the kept set."""
    from kernels.sampling import top_k_ids

    rng = np.random.default_rng(11)
    x = rng.integers(0, 6, (40, 50)).astype(np.float32)  # many ties
    for k in (1, 3, 8, 50):
        got = top_k_ids(x, k)
        want = [sorted(range(50), key=lambda j: (-x[r, j], j))[:k] for r in range(40)]
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(top_k_ids(x, 8)[:, 0], x.argmax(-1))


# ------------------------------------------------------------------ edge cases


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


@pytest.mark.parametrize("top_k", [float("inf"), float("nan"), np.float64("inf"), "3"])
def test_a_non_finite_or_non_numeric_top_k_is_named(top_k):
    """Like temperature and top_p: int(inf) raised OverflowError, int(nan) a ValueError that named nothing."""
    with pytest.raises(ValueError, match="top_k"):
        make_sampler(1.0, top_k)
    with pytest.raises(ValueError, match="top_k"):
        process_logits(np.zeros(4), 1.0, top_k)
