"""Property-based fuzzing of the kernels against slow plain-Python references, over random trees, vocabularies and
probability vectors with zeros and ties, plus the NaN/inf guards.

Replay: the kernel and its reference read the same seeded rng stream, so they must make the same decisions and
return the same tokens (one `random()` per examined draft, one per sampled token, in order).

NaN/inf policy (kernels/sampling.py): logits are checked where they enter — `process_logits` and the samplers
raise ValueError naming the rows with NaN, +inf or all -inf; a partial -inf is a mask (probability 0, never
sampled). `sample_from` raises on a non-finite or zero total. Verification takes probabilities that came through
`process_logits` and argmax ids, so it adds no check of its own; a NaN that reaches it anyway still raises when a
token is sampled from the poisoned row. A temperature so small that 1/T overflows is the greedy limit.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.sampling import make_sampler, process_logits, sample_from
from kernels.tree import TreeLayout, kv_gather_indices, verify_greedy_tree, verify_sampling_tree
from kernels.verify import verify_greedy, verify_sampling
from toy_lm import slow_process

N = 200  # examples per property (7 properties: 1,400 examples, ~20 s)
FUZZ = settings(max_examples=N, deadline=None, database=None)

# ----------------------------------------------------------------------------- slow references (plain Python)


def slow_sample(weights, rng) -> int:
    """Inverse CDF with one rng.random(): the first index whose running sum exceeds u * total."""
    w = [float(x) for x in weights]
    total, cdf = 0.0, []
    for x in w:
        total += x
        cdf.append(total)
    if not (total > 0 and math.isfinite(total)):
        raise ValueError("cannot sample")
    u = rng.random() * total
    for i, c in enumerate(cdf):
        if c > u:
            return i
    return max(i for i, x in enumerate(w) if x > 0)


def slow_residual(p, q) -> list[float]:
    r = [max(0.0, float(a) - float(b)) for a, b in zip(p, q)]
    z = sum(r)
    return [x / z for x in r] if z > 0 else [float(a) / sum(map(float, p)) for a in p]


def slow_accepts(u, qx, px) -> bool:
    return qx > 0 and u * qx < px  # accept with probability min(1, p/q); q = 0 (an impossible draft) rejects


def slow_verify_chain(draft, p, q, rng):
    for i, x in enumerate(draft):
        if q is None:
            y = slow_sample(p[i], rng)
            if y != x:
                return i, y
        elif not slow_accepts(rng.random(), float(q[i][x]), float(p[i][x])):
            return i, slow_sample(slow_residual(p[i], q[i]), rng)
    return len(draft), slow_sample(p[len(draft)], rng)


def slow_verify_tree(tokens, parents, p, q, rng, replacement):
    kids = {n: [c for c in range(1, len(parents)) if parents[c] == n] for n in range(len(parents))}
    path, n = [0], 0
    while kids[n]:
        if q is None:
            y = slow_sample(p[n], rng)
            hit = [c for c in kids[n] if tokens[c] == y]
            if not hit:
                return path, y
            n = hit[0]
        else:
            p_cur, q_cur, chosen = [float(x) for x in p[n]], [float(x) for x in q[n]], None
            for c in kids[n]:
                x = tokens[c]
                qx = q_cur[x]
                if slow_accepts(rng.random(), qx, p_cur[x]):
                    chosen = c
                    break
                p_cur = slow_residual(p_cur, q_cur)
                if not replacement and qx > 0:
                    q_cur[x] = 0.0
                    rest = sum(q_cur)
                    if rest > 0:
                        q_cur = [v / rest for v in q_cur]
            if chosen is None:
                return path, slow_sample(p_cur, rng)
            n = chosen
        path.append(n)
    return path, slow_sample(p[n], rng)


def slow_ancestors(parents, i) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


# ----------------------------------------------------------------------------- strategies

ENTRY = st.sampled_from([0.0, 0.0, 0.25, 0.25, 0.5, 1.0]) | st.floats(0.0, 1.0)  # zeros and ties are common


@st.composite
def dist(draw, vocab):
    row = np.array(draw(st.lists(ENTRY, min_size=vocab, max_size=vocab)))
    if row.sum() <= 0:
        row[draw(st.integers(0, vocab - 1))] = 1.0
    return row / row.sum()


@st.composite
def trees(draw, max_nodes=48):
    s = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, s)]


@st.composite
def chain_case(draw):
    vocab, k = draw(st.integers(1, 12)), draw(st.integers(0, 8))
    p = np.stack([draw(dist(vocab)) for _ in range(k + 1)])
    q = np.stack([draw(dist(vocab)) for _ in range(k)]) if k and draw(st.booleans()) else None
    draft = np.array([draw(st.integers(0, vocab - 1)) for _ in range(k)], np.int64)  # q = 0 drafts included
    return draft, p, (None if q is None else q), draw(st.integers(0, 2**32 - 1))


@st.composite
def tree_case(draw):
    parents = draw(trees(max_nodes=24))
    s, vocab = len(parents), draw(st.integers(1, 6))
    p = np.stack([draw(dist(vocab)) for _ in range(s)])
    q = np.stack([draw(dist(vocab)) for _ in range(s)]) if draw(st.booleans()) else None
    tokens = [0] + [draw(st.integers(0, vocab - 1)) for _ in range(1, s)]  # duplicate siblings included
    return np.array(tokens), np.array(parents), p, q, draw(st.booleans()), draw(st.integers(0, 2**32 - 1))


LOGIT = st.sampled_from([0.0, 0.0, 1.0, 1.0, -np.inf]) | st.floats(-30, 30)
LOGITS = st.lists(LOGIT, min_size=1, max_size=40).filter(lambda xs: any(np.isfinite(xs)))
# logits a vanishing temperature separates (gaps >= 1/8; a 1e-282 gap stays a near-tie even at T = 1e-45)
COARSE = st.lists(st.sampled_from([-np.inf]) | st.integers(-240, 240).map(lambda i: i / 8), min_size=1,
                  max_size=40).filter(lambda xs: any(np.isfinite(xs)))

# ----------------------------------------------------------------------------- verification: replay


@FUZZ
@given(case=chain_case())
def test_chain_verification_replays_the_slow_reference(case):
    draft, p, q, seed = case
    got = verify_sampling(draft, p, q, np.random.default_rng(seed))
    assert got == slow_verify_chain(draft.tolist(), p, q, np.random.default_rng(seed))
    n, nxt = got
    assert p[n, nxt] > 0 or q is not None and n < len(draft)  # a recovered token can come from the residual only
    argmax = np.random.default_rng(seed).integers(0, p.shape[1], len(draft) + 1)
    n_g, nxt_g = verify_greedy(draft, argmax)
    assert list(draft[:n_g]) == list(argmax[:n_g]) and nxt_g == argmax[n_g]


@FUZZ
@given(case=tree_case())
def test_tree_verification_replays_the_slow_reference(case):
    tokens, parents, p, q, replacement, seed = case
    got = verify_sampling_tree(tokens, parents, p, q, np.random.default_rng(seed), replacement)
    ref = slow_verify_tree(tokens.tolist(), parents.tolist(), p, None if q is None else q,
                           np.random.default_rng(seed), replacement)
    assert got == ref
    path, _ = got
    np.testing.assert_array_equal(kv_gather_indices(path, 7), 7 + np.array(path))


@FUZZ
@given(parents=trees(), past=st.integers(0, 40), data=st.data())
def test_tree_layout_and_greedy_walk_against_slow_references(parents, past, data):
    s = len(parents)
    lay = TreeLayout.from_parents(parents)
    bias = lay.attention_bias(past)
    assert bias.shape == (1, 1, s, past + s) and not bias[0, 0, :, :past].any()
    for i in range(s):
        anc = slow_ancestors(parents, i)
        assert lay.position_ids(past)[0, i] == past + len(anc) - 1
        assert [j for j in range(s) if bias[0, 0, i, past + j] == 0] == sorted(anc)
        assert lay.path_to(i) == sorted(anc)
    tokens = data.draw(st.lists(st.integers(0, 3), min_size=s, max_size=s))
    top = data.draw(st.lists(st.integers(0, 3), min_size=s, max_size=s))
    path, nxt = verify_greedy_tree(np.array(tokens), np.array(parents), np.array(top))
    n = 0
    for a in path[1:]:  # each step takes the first child carrying the target's argmax
        assert a == min(c for c in range(s) if parents[c] == n and tokens[c] == top[n])
        n = a
    assert not any(parents[c] == n and tokens[c] == top[n] for c in range(s)) and nxt == top[n]


# ----------------------------------------------------------------------------- sampling: reference, -inf masks, ties


@FUZZ
@given(logits=LOGITS, temperature=st.sampled_from([0.1, 0.7, 1.0, 3.0]), top_k=st.integers(0, 6),
       top_p=st.sampled_from([0.3, 0.9, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_sampling_with_masks_and_ties_matches_the_slow_reference(logits, temperature, top_k, top_p, seed):
    x = np.asarray(logits, np.float64)
    probs = process_logits(x, temperature, top_k, top_p)
    assert np.all(probs[np.isneginf(x)] == 0) and abs(probs.sum() - 1) < 1e-9
    ref = slow_process(x, temperature, top_k, top_p)
    np.testing.assert_allclose(probs, ref, atol=1e-6)
    tok = make_sampler(temperature, top_k, top_p)(x, np.random.default_rng(seed))
    assert probs[tok] > 0 and tok == slow_sample(probs, np.random.default_rng(seed))


@FUZZ
@given(logits=COARSE, temperature=st.sampled_from([1e-320, 1e-300, 1e-45, 1e-30]), top_k=st.integers(0, 6))
def test_vanishing_temperature_is_the_greedy_limit(logits, temperature, top_k):
    x = np.asarray(logits, np.float64)
    for dtype in (np.float32, np.float64):
        probs = process_logits(x.astype(dtype), temperature, top_k)
        assert np.all(np.isfinite(probs)) and abs(float(probs.sum()) - 1) < 1e-5
        top = x.astype(dtype).max()
        support = np.flatnonzero(probs > 0)
        assert np.all(x.astype(dtype)[support] == top)  # only maximal logits; ties split evenly
        assert np.allclose(probs[support], 1 / len(support), rtol=1e-5)
        assert int(np.argmax(x.astype(dtype))) == make_sampler(0.0)(x.astype(dtype))


# ----------------------------------------------------------------------------- NaN / inf guards


@FUZZ
@given(rows=st.lists(st.lists(LOGIT, min_size=3, max_size=3).filter(lambda xs: any(np.isfinite(xs))), min_size=1,
                     max_size=4), data=st.data())
def test_nan_and_inf_logits_raise_naming_the_row(rows, data):
    x = np.array(rows, np.float32)  # [R, 3], every row usable until one is poisoned
    r = data.draw(st.integers(0, len(rows) - 1))
    bad = data.draw(st.sampled_from(["nan", "+inf", "all -inf"]))
    if bad == "all -inf":
        x[r] = -np.inf
    else:
        x[r, data.draw(st.integers(0, 2))] = np.nan if bad == "nan" else np.inf
    word = {"nan": "NaN", "+inf": r"\+inf", "all -inf": "all -inf"}[bad]
    rows_named = rf"\[{r}\]" if bad != "all -inf" else rf"rows \[{r}\]"
    for call in (lambda: process_logits(x, 0.8), lambda: make_sampler(0.8)(x, np.random.default_rng(0)),
                 lambda: make_sampler(0.0)(x)):
        with pytest.raises(ValueError, match=word):
            call()
    with pytest.raises(ValueError, match=rows_named):
        process_logits(x, 1.0)


@FUZZ
@given(probs=st.lists(ENTRY, min_size=1, max_size=10), poison=st.sampled_from([np.nan, np.inf]), data=st.data())
def test_poisoned_probabilities_never_yield_a_token(probs, poison, data):
    p = np.array(probs, np.float64)
    p[data.draw(st.integers(0, len(p) - 1))] = poison
    with pytest.raises(ValueError, match="cannot sample"):
        sample_from(p, np.random.default_rng(0))
    # verification samples from a poisoned row → the same error, never a silent token
    rows = np.stack([p, np.full(len(p), 1 / len(p))])  # [2, V]: row 0 is examined first
    with pytest.raises(ValueError, match="cannot sample"):
        verify_sampling(np.zeros(1, np.int64), rows, None, np.random.default_rng(0))
    with pytest.raises(ValueError, match="cannot sample"):
        verify_sampling_tree(np.zeros(2, np.int64), np.array([-1, 0]), rows, None, np.random.default_rng(0))
