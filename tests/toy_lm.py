"""Toy language models and sampling helpers shared by the kernel tests.

The statistical tests (test_kernels_verify.py, test_kernels_tree.py) run a whole speculative
generation loop on a toy target and a toy drafter: trigram tables, where the next-token
distribution depends on the last two tokens. Drafts are sampled inside the tests with an
independent plain-Python sampler, and the emitted tokens are compared with the target's exact
joint distribution -- that is what "lossless" means.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

N_SAMPLES = 20_000  # generations per statistical check
START = (0, 1)  # the committed context every generation starts from


class FixedU:
    """Stand-in rng whose ``random()`` returns preset values."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def trigram_table(seed: int, vocab: int, zeros: int = 1, alpha: float = 0.6) -> np.ndarray:
    """[V, V, V]: table[a, b] = next-token distribution after tokens (a, b), some zeros."""
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(np.full(vocab, alpha), size=(vocab, vocab))
    for a in range(vocab):
        for b in range(vocab):
            table[a, b, rng.choice(vocab, size=zeros, replace=False)] = 0.0
    return table / table.sum(axis=-1, keepdims=True)


def draw(weights: list[float], rng) -> int:
    """Independent plain-Python inverse CDF (weights need not be normalized), used to sample
    drafts inside the tests."""
    total = sum(weights)
    assert total > 0
    u = rng.random() * total
    acc, last = 0.0, 0
    for i, w in enumerate(weights):
        if w > 0:
            acc += w
            last = i
            if u < acc:
                return i
    return last


def exact_joint(P: np.ndarray, n_tokens: int) -> np.ndarray:
    """Exact distribution of the first n_tokens the target alone would emit, flattened."""
    vocab = P.shape[0]
    out = np.zeros(vocab**n_tokens)
    for idx in range(vocab**n_tokens):
        seq = [int(d) for d in np.base_repr(idx, vocab).zfill(n_tokens)]
        ctx, prob = list(START), 1.0
        for t in seq:
            prob *= P[ctx[-2], ctx[-1], t]
            ctx.append(t)
        out[idx] = prob
    return out


def emitted_counts(step, n_tokens: int, vocab: int, seed: int) -> np.ndarray:
    """Run ``step(ctx, rng) -> emitted tokens`` until n_tokens are out, N_SAMPLES times."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(vocab**n_tokens, dtype=np.int64)
    for _ in range(N_SAMPLES):
        ctx = list(START)
        while len(ctx) - len(START) < n_tokens:
            ctx += step(ctx, rng)
        idx = 0
        for t in ctx[len(START) : len(START) + n_tokens]:
            idx = idx * vocab + t
        counts[idx] += 1
    return counts


def random_dist(draw_, entry, vocab: int) -> np.ndarray:
    """Inside an ``@st.composite``: a probability row of length vocab built from ``entry``
    weights (an all-zero draw puts all the mass on one drawn token), normalized."""
    row = np.array(draw_(st.lists(entry, min_size=vocab, max_size=vocab)))
    if row.sum() <= 0:
        row[draw_(st.integers(0, vocab - 1))] = 1.0
    return row / row.sum()


def slow_process(logits, temperature=1.0, top_k=0, top_p=1.0) -> list[float]:
    """Reference for one row, in plain Python floats: sort-based top-k and top-p."""
    v = len(logits)
    x = [float(l) / temperature for l in logits]
    # ranked on the logits themselves (dividing by T > 0 keeps their order; in floats it can underflow two distinct
    # logits, 0 and 5e-324 at T = 3, into a tie); ties: lower id first
    by_rank = sorted(range(v), key=lambda i: (-float(logits[i]), i))
    kept = by_rank[:top_k] if 0 < top_k < v else by_rank
    m = max(x[i] for i in kept)
    w = {i: math.exp(x[i] - m) for i in kept}
    z = sum(w.values())
    probs = {i: w[i] / z for i in kept}
    if top_p < 1.0:
        order = sorted(kept, key=lambda i: (-probs[i], i))
        nucleus, mass = [], 0.0
        for i in order:
            nucleus.append(i)
            mass += probs[i]
            if mass >= top_p:
                break
        z = sum(probs[i] for i in nucleus)
        probs = {i: probs[i] / z for i in nucleus}
    return [probs.get(i, 0.0) for i in range(v)]
