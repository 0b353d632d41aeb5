"""Logit processing and sampling: pure numpy, explicit ``rng``.

The same :func:`process_logits` transform (temperature, then top-k, then top-p) is applied to
the target's logits (giving ``p``) and to the drafter's logits (giving ``q``), so that the
verification in :mod:`kernels.verify` and :mod:`kernels.tree` compares like with like.

Determinism: ties are always broken toward the lower token id (as ``np.argmax`` does), both at
the top-k cut and at the top-p cut, so a given logits row always yields the same support.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable

import numpy as np

# Top-p looks for the nucleus among this many most probable tokens, widening step by step.
_TOP_P_CANDIDATES = (512, 4096)


class CorruptOutput(ValueError):
    """The model's logits or probabilities cannot be a distribution (NaN, +inf, every token masked)."""


def _check_sampling_args(temperature: float, top_k: int, top_p: float) -> None:
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}"
        )
    # int(inf) raises OverflowError and int(nan) an unnamed ValueError: check finiteness first
    if not (isinstance(top_k, numbers.Real) and math.isfinite(top_k)) or int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables top-k), got {top_k!r}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1 disables top-p), got {top_p!r}")


def _check_logits(logits: np.ndarray) -> np.ndarray:
    """Row maxima, raising on rows that cannot be turned into a distribution."""
    # One reduction catches all three cases: max propagates NaN, +inf wins, all -inf stays -inf.
    row_max = logits.max(axis=-1)
    if np.isnan(row_max).any():
        rows = np.argwhere(np.isnan(np.atleast_1d(row_max)))[:, 0].tolist()
        raise CorruptOutput(f"logits contain NaN (rows {rows}); the model output is corrupt")
    if np.isposinf(row_max).any():
        rows = np.argwhere(np.isposinf(np.atleast_1d(row_max)))[:, 0].tolist()
        raise CorruptOutput(f"logits contain +inf (rows {rows}); the model output is corrupt")
    if np.isneginf(row_max).any():
        rows = np.argwhere(np.isneginf(np.atleast_1d(row_max)))[:, 0].tolist()
        raise CorruptOutput(
            f"logits rows {rows} are all -inf: every token is masked, nothing can be sampled"
        )
    return row_max


def check_chosen(chosen) -> None:
    """Greedy picks' own logits [R] (the row maxima argmax or TopK chose): raise as sampling does when one is NaN
    or infinite. argmax and ONNX Runtime's TopK land on index 0 of an all-NaN or all -inf row, silently.
    Plain Python over a list: right after a model call each numpy call costs tens of µs (cold caches)."""
    vals = chosen.tolist() if isinstance(chosen, np.ndarray) else chosen
    if not all(map(math.isfinite, vals)):
        _check_logits(np.asarray(vals, np.float64).reshape(-1, 1))


def _keep_first_n(values: np.ndarray, threshold: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Mask of the ``n[r]`` largest entries of each row, ties broken toward the lower index.

    values: [R, V]; threshold: [R], the n-th largest value of each row; n: [R] ints >= 1.
    """
    keep = values >= threshold[:, None]  # [R, V]
    excess = np.count_nonzero(keep, axis=-1) - n
    for r in np.flatnonzero(excess > 0):
        # Only rows with ties straddling the cut pay for this; drop the highest-index ties.
        tied = np.flatnonzero(values[r] == threshold[r])
        keep[r, tied[len(tied) - excess[r]:]] = False
    return keep


def _top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Token ids of the top-k entries of each row of ``x`` ([R, V]) -> [R, k], ascending."""
    vocab = x.shape[-1]
    cols = np.argpartition(x, vocab - k, axis=-1)[:, vocab - k:]  # [R, k]
    kth = np.take_along_axis(x, cols, axis=-1).min(axis=-1)  # [R]
    # argpartition splits ties at the cut arbitrarily; redo those rows deterministically.
    tied = np.count_nonzero(x >= kth[:, None], axis=-1) > k
    for r in np.flatnonzero(tied):
        cols[r] = np.flatnonzero(_keep_first_n(x[r : r + 1], kth[r : r + 1], np.array([k]))[0])
    # Id order, so that top-p over the kept [R, k] entries breaks its ties by token id too.
    cols.sort(axis=-1)
    return cols


def top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Token ids of the k largest entries of each row of ``x`` ([R, V]) -> [R, k], best first, ties toward the
    lower id (so column 0 is ``argmax``), as the exported graphs' on-graph TopK returns them."""
    cols = _top_k_indices(x, k)  # ascending ids
    order = np.argsort(-np.take_along_axis(x, cols, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(cols, order, axis=-1)


def _top_p_mask(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Mask of the smallest set of each row whose mass is >= top_p ([R, V], rows sum to 1)."""
    rows, vocab = probs.shape
    target = top_p * probs.sum(axis=-1, dtype=np.float64)  # [R]
    n = np.empty(rows, dtype=np.int64)
    threshold = np.empty(rows, dtype=probs.dtype)
    pending = np.arange(rows)
    # Look among the m most probable tokens first; only rows whose nucleus is wider move on
    # to a larger m, and only the widest pay for sorting the whole vocabulary.
    for m in sorted({min(c, vocab) for c in _TOP_P_CANDIDATES} | {vocab}):
        sub = probs[pending]
        if m < vocab:
            sub = np.partition(sub, vocab - m, axis=-1)[:, vocab - m:]
        head = -np.sort(-sub, axis=-1)  # [R', m], descending
        cum = np.cumsum(head, axis=-1, dtype=np.float64)
        done = (cum[:, -1] >= target[pending]) | (m == vocab)
        for i in np.flatnonzero(done):
            r = pending[i]
            # First position whose cumulative mass reaches top_p; rounding may leave the
            # total a hair below the target, in which case everything is kept.
            j = min(int(np.searchsorted(cum[i], target[r], side="left")), m - 1)
            n[r] = j + 1
            threshold[r] = head[i, j]
        pending = pending[~done]
        if not pending.size:
            break
    return _keep_first_n(probs, threshold, n)


def _softmax_top_p(x: np.ndarray, top_p: float) -> np.ndarray:
    """Softmax of each row of ``x`` ([R, n], row max 0, overwritten), then the top-p cut."""
    probs = np.exp(x, out=x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        probs *= _top_p_mask(probs, float(top_p))
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def process_logits(
    logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    """Turn logits into sampling probabilities: temperature, then top-k, then top-p.

    logits: [..., V] float. Returns probabilities of the same shape (float32 for float16/32
    input, float64 for float64 input); each row sums to 1 and is zero outside the kept set.

    - top-k keeps exactly ``min(top_k, V)`` tokens (0 disables it); ties at the cut go to the
      lower token id.
    - top-p (nucleus) keeps the smallest set of most-probable tokens whose mass is >= top_p,
      measured after top-k (1.0 disables it); ties at the cut go to the lower token id.

    Greedy decoding (temperature 0) is not a distribution: use :func:`make_sampler` or argmax.
    Raises ValueError on NaN/+inf logits or on a row that is entirely -inf.
    """
    _check_sampling_args(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("process_logits needs temperature > 0; temperature 0 is greedy (argmax)")
    logits = np.asarray(logits)
    assert logits.ndim >= 1 and logits.shape[-1] >= 1, logits.shape
    dtype = np.float64 if logits.dtype == np.float64 else np.float32
    shape = logits.shape
    x = logits.astype(dtype, copy=False).reshape(-1, shape[-1])  # [R, V]
    row_max = _check_logits(x)

    # (x - max) / T: subtracting the row max first keeps exp() in range. A temperature so small that 1/T overflows
    # is clamped to the largest finite scale: the limit, an even split over the maximal logits (0 * inf was NaN);
    # one so large that 1/T rounds to 0 to the smallest, so a -inf logit stays -inf (-inf * 0 was NaN).
    info = np.finfo(dtype)
    scale = dtype(min(max(1.0 / temperature, float(info.tiny)), float(info.max)))
    if 0 < top_k < shape[-1]:
        # Top-k is invariant under (x - max) / T, so select on the raw logits and scale, soften
        # and nucleus-cut only the k kept entries ([R, k]) before scattering them back.
        cols = _top_k_indices(x, int(top_k))  # [R, k]
        with np.errstate(over="ignore"):  # (x - max) * huge scale → -inf: probability 0, as intended
            kept = (np.take_along_axis(x, cols, axis=-1) - row_max[:, None]) * scale
        probs = np.zeros_like(x)
        np.put_along_axis(probs, cols, _softmax_top_p(kept, top_p), axis=-1)
    else:
        x = x - row_max[:, None]
        if temperature != 1.0:
            with np.errstate(over="ignore"):
                x *= scale
        probs = _softmax_top_p(x, top_p)
    return probs.reshape(shape)


def probs_from_top(
    top_ids: np.ndarray, top_probs: np.ndarray, vocab: int, top_k: int = 0, top_p: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`process_logits`' distribution from each row's K best tokens alone, where they hold the kept set.

    top_ids, top_probs: [R, K], best first with ties toward the lower id, ``top_probs`` = softmax(logits / T)
    over the whole vocabulary at those ids (the on-graph head, :mod:`kernels.postprocess`). A row is exact when
    its kept set lies inside its K: top-k with ``top_k <= K`` (any top-p), or no top-k and a nucleus that closes
    within the K. Pure temperature sampling (no top-k, top-p 1) keeps every token: never exact unless K = V.
    Returns (probs [R, vocab] float32, zero outside the kept set, rows summing to 1; exact [R] bool). Rows that
    are not exact are all zero: process their logits instead.
    """
    _check_sampling_args(1.0, top_k, top_p)
    ids = np.asarray(top_ids)
    probs = np.asarray(top_probs, np.float64)
    assert ids.ndim == 2 and ids.shape == probs.shape, (ids.shape, probs.shape)
    rows, k = ids.shape
    out = np.zeros((rows, vocab), np.float32)
    if 0 < top_k < vocab:
        if top_k > k:
            return out, np.zeros(rows, bool)
        probs = probs[:, :top_k]
        target = top_p * probs.sum(-1)  # top-p is measured after top-k (process_logits renormalizes)
        exact = np.ones(rows, bool)
    elif k < vocab and top_p >= 1.0:
        return out, np.zeros(rows, bool)
    else:
        # full-vocabulary probabilities: each row sums to 1 (process_logits measures the sum, which rounding may put
        # a few 1e-7 off: a cut landing that close to a cumulative mass may keep one token more or fewer)
        target = top_p * np.ones(rows)
        # the nucleus must close inside the K (always true when K = V; rounding may leave a full row a hair short)
        with np.errstate(invalid="ignore"):
            exact = (probs.sum(-1) >= target) | (k >= vocab)
    exact &= np.isfinite(probs).all(-1)  # NaN / inf logits (a corrupt model output): process_logits names them
    probs = np.where(exact[:, None], probs, 0.0)  # declined rows: all zero from here on
    before = np.concatenate([np.zeros((rows, 1)), np.cumsum(probs, -1)[:, :-1]], -1)  # mass of the better tokens
    keep = (before < target[:, None]) | (top_p >= 1.0)  # the smallest prefix whose mass reaches the target
    kept = np.where(keep, probs, 0.0)
    total = kept.sum(-1, keepdims=True)
    np.put_along_axis(out, ids[:, : kept.shape[1]], (kept / np.where(total > 0, total, 1.0)).astype(np.float32), -1)
    return out, exact


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from ``probs`` ([V], non-negative, need not be normalized).

    Inverse CDF with exactly one ``rng.random()`` draw, so a seeded rng reproduces the same
    token. A zero-probability token is never returned.
    """
    probs = np.asarray(probs)
    assert probs.ndim == 1, probs.shape
    # Accumulate in float64: a float32 cdf of a large vocabulary rounds tokens below ~6e-8 to zero width (never
    # drawn) and moved ~2.5e-4 of total variation at V = 49152; float64 costs the same here (~0.2 ms).
    cdf = np.cumsum(probs, dtype=np.float64)
    total = cdf[-1]
    if not total > 0 or not np.isfinite(total):
        raise CorruptOutput(f"cannot sample: probabilities sum to {total!r}; the model output is corrupt")
    u = rng.random() * total
    # side="right": the first index whose cdf exceeds u; a zero-probability token has the same
    # cdf as its predecessor (or 0 at index 0), so it can never be the first to exceed u >= 0.
    token = int(np.searchsorted(cdf, u, side="right"))
    if token >= len(cdf):  # u rounded up to total: take the last token with mass
        token = int(np.flatnonzero(probs > 0)[-1])
    return token


def make_sampler(
    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> Callable[..., int | np.ndarray]:
    """Return ``sample(logits, rng=None)`` for fixed sampling settings (mlx-lm style factory).

    ``logits`` is [V] (returns an int) or [N, V] (returns an int64 array [N], one
    ``rng.random()`` per row in order). temperature 0 is greedy: argmax, ``rng`` unused, ties
    to the lower token id.
    """
    _check_sampling_args(temperature, top_k, top_p)

    if temperature == 0:

        def sample_greedy(logits: np.ndarray, rng: np.random.Generator | None = None):
            logits = np.asarray(logits)  # [V] or [N, V]
            assert logits.ndim in (1, 2), logits.shape
            tokens = np.argmax(logits, axis=-1)
            check_chosen(np.take_along_axis(logits, np.asarray(tokens)[..., None], axis=-1).reshape(-1))  # [N] or [1]
            return int(tokens) if logits.ndim == 1 else tokens.astype(np.int64)

        return sample_greedy

    def sample(logits: np.ndarray, rng: np.random.Generator | None = None):
        if rng is None:
            raise ValueError("sampling with temperature > 0 needs an explicit rng")
        logits = np.asarray(logits)  # [V] or [N, V]
        assert logits.ndim in (1, 2), logits.shape
        probs = process_logits(logits, temperature, top_k, top_p)
        if probs.ndim == 1:
            return sample_from(probs, rng)
        return np.array([sample_from(row, rng) for row in probs], dtype=np.int64)

    return sample
