"""Speculative-decoding verification for a chain of draft tokens: pure numpy, explicit ``rng``.

Notation (used throughout edgespec):

- ``p`` -- the target model's probabilities (after :func:`kernels.sampling.process_logits`).
- ``q`` -- the drafter's probabilities, produced by the same transform.
- A verify call scores the root (the last committed token) plus K draft tokens; row i of ``p``
  is the target's distribution for the token after draft position i-1 (row 0: after the
  root), so ``p`` has K+1 rows and ``q`` has K.

Each call emits ``n_accepted`` draft tokens followed by exactly one token from the target:

- **accepted tokens** -- the draft tokens kept: ``draft[:n_accepted]``.
- **recovered (resampled) token** -- on the first rejection, at position i, a token drawn from
  the residual ``normalize(max(0, p[i] - q[i]))`` (:func:`recovered_distribution`); in greedy
  mode, the target argmax at the first mismatch.
- **bonus token** -- when all K drafts are accepted, a token drawn from ``p[K]`` (greedy: the
  target argmax after the last draft).

Either way the emitted sequence is distributed exactly as if sampled from the target alone
(Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318).
"""

from __future__ import annotations

import numpy as np

from kernels.sampling import sample_from


def recovered_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``normalize(max(0, p - q))``: where recovered tokens are drawn from. p, q: [V].

    After a rejection the residual has positive mass (if p == q nothing is ever rejected);
    should rounding leave it all zero anyway, fall back to ``p`` rather than divide by zero.
    """
    assert p.shape == q.shape and p.ndim == 1, (p.shape, q.shape)
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if not total > 0:
        return p / p.sum()
    return residual / total


def verify_greedy(draft: np.ndarray, target_argmax: np.ndarray) -> tuple[int, int]:
    """Greedy verification: keep the longest prefix where the draft equals the target argmax.

    draft: [K] ints; target_argmax: [K+1] ints (argmax of each row of the target logits).
    Returns ``(n_accepted, next_token)`` with ``next_token = target_argmax[n_accepted]`` --
    the correction at the first mismatch, or the bonus token when all K are accepted.

    Plain Python over the few ids (arrays or lists): it runs once per decode step, right after the target's call,
    when every numpy call costs tens of µs.
    """
    d = _ids(draft, "draft")
    a = _ids(target_argmax, "target_argmax")
    k = len(d)
    assert len(a) == k + 1, (k, len(a))
    n = 0
    while n < k and d[n] == a[n]:
        n += 1
    return n, int(a[n])


def _ids(x, name: str):
    """A 1-D sequence of token ids that Python indexes cheaply: an array as a list, any other sequence as it is."""
    if isinstance(x, np.ndarray):
        assert x.ndim == 1, f"{name}: 1-D ids expected, got shape {x.shape}"
        return x.tolist()
    return x


def verify_sampling(
    draft: np.ndarray,
    p: np.ndarray,
    q: np.ndarray | None,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Lossless speculative sampling over a chain of K drafts.

    draft: [K] ints; p: [K+1, V] target probabilities; q: [K, V] drafter probabilities the
    drafts were sampled from, or None for a deterministic drafter (prompt lookup, n-grams).

    With ``q``: accept ``draft[i]`` with probability ``min(1, p[i, x] / q[i, x])``; at the first
    rejection emit a recovered token from ``normalize(max(0, p[i] - q[i]))``; if all are
    accepted emit a bonus token from ``p[K]``. A draft with ``q[i, x] == 0`` (a caller bug:
    it could not have been sampled) counts as rejected.

    With ``q is None`` the draft is a point mass: sample ``y ~ p[i]``; accept iff
    ``y == draft[i]``, otherwise ``y`` itself is the next token. This is the rule above with
    ``q[i] = onehot(draft[i])``, so it is exactly lossless too.

    Returns ``(n_accepted, next_token)``. Uses one ``rng.random()`` per examined draft plus
    one for the next token, in order.
    """
    draft = np.asarray(draft)
    p = np.asarray(p)
    k = draft.shape[0]
    assert draft.ndim == 1 and p.ndim == 2 and p.shape[0] == k + 1, (draft.shape, p.shape)

    if q is None:
        for i in range(k):
            y = sample_from(p[i], rng)
            if y != draft[i]:
                return i, y
        return k, sample_from(p[k], rng)

    q = np.asarray(q)
    assert q.shape == (k, p.shape[1]), (q.shape, p.shape)
    for i in range(k):
        x = int(draft[i])
        qx, px = q[i, x], p[i, x]
        # u < p/q without the division; q == 0 must reject even though u * 0 < p would pass.
        # Draw u either way so every examined draft consumes exactly one rng value.
        u = rng.random()
        if not (qx > 0 and u * qx < px):
            return i, sample_from(recovered_distribution(p[i], q[i]), rng)
    return k, sample_from(p[k], rng)


def scatter_trimmed(q_trim: np.ndarray, id_map: np.ndarray, vocab_size: int) -> np.ndarray:
    """Place a trimmed-vocabulary drafter's probabilities into the full vocabulary.

    q_trim: [..., V_trim]; id_map: [V_trim] ints, ``id_map[j]`` = full-vocabulary id of
    trimmed token j (in range, unique). Returns q: [..., vocab_size], zero outside id_map.
    """
    q_trim = np.asarray(q_trim)
    id_map = np.asarray(id_map)
    if id_map.ndim != 1 or id_map.shape[0] != q_trim.shape[-1]:
        raise ValueError(
            f"id_map must be 1-D with one entry per trimmed token ({q_trim.shape[-1]}), "
            f"got shape {id_map.shape}"
        )
    if not np.issubdtype(id_map.dtype, np.integer):
        raise ValueError(f"id_map must hold integer token ids, got dtype {id_map.dtype}")
    if id_map.size and (id_map.min() < 0 or id_map.max() >= vocab_size):
        raise ValueError(
            f"id_map values must be in [0, {vocab_size}), got range "
            f"[{id_map.min()}, {id_map.max()}]"
        )
    if np.unique(id_map).size != id_map.size:
        raise ValueError("id_map has duplicate token ids; each trimmed token must map to one id")
    q = np.zeros(q_trim.shape[:-1] + (vocab_size,), dtype=q_trim.dtype)
    q[..., id_map] = q_trim
    return q
