"""The on-graph head (kernels/postprocess.py) against its numpy reference, and the sampler that reads it
(kernels.sampling.probs_from_top) against process_logits on the full logits."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.postprocess import HEAD_INPUTS, head_feeds, sampling_head_model, sampling_head_reference
from kernels.sampling import probs_from_top, process_logits

V = 3000


def _logits(seed: int, rows: int = 5, vocab: int = V) -> np.ndarray:
    """Rows from flat to peaked, with a tie at the top of one row and ties inside the top 64 of another."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * np.array([0.3, 1, 3, 6, 12][:rows], np.float32)[:, None]
    x[1, [7, 900]] = x[1].max() + 1  # tied best: the lower id first
    x[2, [5, 6, 2000]] = np.sort(x[2])[-30]  # ties around rank 30
    x[3, 40] = x[3].max() - 1e-3  # a near-tie at the top: at a small temperature float32 must keep them apart
    return x


@pytest.fixture(scope="module")
def head():
    import onnxruntime as ort

    return ort.InferenceSession(sampling_head_model(V).SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("k,temperature", [(1, None), (8, None), (8, 0.7), (64, 1.0), (300, 2.5), (64, 0.05), (16, 1e-4),
                                           (16, 1e-39)])
def test_head_matches_its_reference(head, k, temperature):
    x = _logits(k)
    top_logits, top_ids, top_probs = head.run(None, {"logits": x[None], **head_feeds(k, temperature)})
    want_logits, want_ids, want_probs = sampling_head_reference(x, k, temperature)
    np.testing.assert_array_equal(top_ids[0], want_ids)
    np.testing.assert_array_equal(top_logits[0], want_logits)
    if temperature is None:  # a greedy call's probabilities are a copy of the logits: no softmax ran
        np.testing.assert_array_equal(top_probs[0], want_logits)
    else:
        np.testing.assert_allclose(top_probs[0], want_probs, rtol=2e-5, atol=1e-7)
    assert top_ids[0, 1, 0] == 7  # the tie at the top goes to the lower id, as np.argmax


def _head_k(top_k: int) -> int:
    return top_k if top_k else 64  # what the engine asks of the head (edge.engine Engine._head_request)


SETTINGS = [(t, k, p) for t in (0.3, 0.7, 1.0, 1.6) for k in (0, 1, 5, 40, 64) for p in (1.0, 0.95, 0.9, 0.5)]


def _sparse_and_full(x, temperature, top_k, top_p):
    k = _head_k(top_k)
    _, ids, probs = sampling_head_reference(x, k, temperature)
    return k, probs_from_top(ids, probs, x.shape[1], top_k, top_p), process_logits(x, temperature, top_k, top_p)


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_probs_from_top_equals_process_logits(temperature, top_k, top_p):
    """Each row whose kept set the head's k holds gets process_logits' distribution (same support, same
    probabilities to float rounding); exactly the rows whose kept set is wider are declined (left zero). Rows
    from flat (a wide nucleus) to peaked."""
    x = _logits(int(100 * temperature) + top_k)
    k, (got, exact), want = _sparse_and_full(x, temperature, top_k, top_p)
    assert got.shape == want.shape and got.dtype == np.float32
    wide = np.count_nonzero(want, -1) > k
    np.testing.assert_array_equal(exact, ~wide & (top_k > 0 or top_p < 1.0))
    assert not got[~exact].any()
    np.testing.assert_array_equal(got[exact] > 0, want[exact] > 0)
    np.testing.assert_allclose(got[exact], want[exact], rtol=1e-4, atol=1e-7)


def test_nucleus_inside_the_head_is_read_from_it():
    """The top-p rows above are not all declined: peaked rows' nuclei close inside the head's 64."""
    _, (_, exact), _ = _sparse_and_full(_logits(5), 0.7, 0, 0.9)
    assert exact.tolist() == [False, False, True, True, True]


def test_probs_from_top_declines_what_the_head_cannot_hold():
    x = _logits(3)
    _, ids, probs = sampling_head_reference(x, 8, 1.0)
    assert not probs_from_top(ids, probs, V, top_k=9)[1].any()  # top-k wider than the head's k
    assert not probs_from_top(ids, probs, V, top_k=0, top_p=1.0)[1].any()  # every token can be drawn
    # a temperature so small that the head's softmax overflowed: NaN rows are processed from their logits
    nan = probs.copy()
    nan[1] = np.nan
    got, exact = probs_from_top(ids, nan, V, top_k=5)
    assert exact.tolist() == [True, False, True, True, True] and np.isfinite(got).all() and not got[1].any()
    # the head's k is the whole vocabulary: always exact
    small = x[:, :50]
    _, ids, probs = sampling_head_reference(small, 50, 0.8)
    got, exact = probs_from_top(ids, probs, 50)
    assert exact.all()
    np.testing.assert_allclose(got, process_logits(small, 0.8), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("top_k,top_p,want", [(0, 0.5, [1, 0, 0, 0]), (0, 0.75, [2 / 3, 1 / 3, 0, 0]),
                                               (3, 0.5, [1, 0, 0, 0]), (0, 0.875, [4 / 7, 2 / 7, 1 / 7, 0])])
def test_a_nucleus_that_closes_exactly_on_a_cumulative_mass_keeps_no_token_more(top_k, top_p, want):
    """Probabilities that are binary fractions sum exactly: at top-p 0.5 over [.5, .25, .125, .125] the nucleus is
    the first token alone, as process_logits cuts it (a `<=` in the cut would keep [2/3, 1/3])."""
    p = np.array([[0.5, 0.25, 0.125, 0.125]])
    ids = np.arange(4)[None, :]
    got, exact = probs_from_top(ids, p, 4, top_k, top_p)
    assert exact.all()
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
    np.testing.assert_allclose(process_logits(np.log(p), 1.0, top_k, top_p)[0], want, rtol=1e-6)


def test_probs_from_top_catches_a_wrong_cut():
    """Negative control: a nucleus cut one token late (keep while the mass *including* the token is below top-p,
    plus one) is what the equality test above must reject."""
    x = _logits(11)[3:]  # peaked rows: the nucleus closes inside the head's k
    _, ids, probs = sampling_head_reference(x, 64, 0.7)
    got, exact = probs_from_top(ids, probs, V, 0, 0.9)
    want = process_logits(x, 0.7, 0, 0.9)
    assert exact.all()
    n = np.count_nonzero(want, -1)
    wrong = np.zeros_like(want)
    for r in range(len(x)):
        keep = probs[r, : n[r] + 1]
        np.put_along_axis(wrong[r], ids[r, : n[r] + 1], keep / keep.sum(), -1)
    assert not np.array_equal(wrong > 0, want > 0)
    np.testing.assert_array_equal(got > 0, want > 0)


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
