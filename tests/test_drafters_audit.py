"""A mutation audit of edge/drafters.py, edge/kv.py and edge/runner.py (session 23): each test here catches a
plausible one-line bug that every other test let through (the mutation is named in its docstring); two found real
bugs (a hybrid tree longer than its budget, rank priors read from an overwritten row)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import edge
from edge.drafters import HybridDrafter, LookupDrafter, ModelDrafter, RecyclingDrafter, tree_template
from edge.kv import KVCache
from test_drafters import draft_paths as _paths
from edge.runner import GraphSession, probe_min_call


# ----------------------------------------------------------------------------- lookup

def test_lookup_rebuilds_on_a_divergence_after_a_common_prefix():
    """An edited last message (same start, different end) must not leave the old tail in the history: the drafts
    then continue text the conversation no longer holds. (Mutation: rebuild only when nothing is in common.)"""
    d = LookupDrafter()
    d.begin([1, 2, 3, 4, 5, 6])
    d.begin([1, 2, 3, 9, 7, 1, 2])
    assert d.history == [1, 2, 3, 9, 7, 1, 2]
    assert d.draft(3).tokens.tolist() == [3, 9, 7]


def test_lookup_finds_an_ngram_at_the_very_start_of_the_history():
    """(Mutation: `i > n` instead of `i >= n` in the index: an n-gram starting at position 0 is never indexed.)"""
    d = LookupDrafter(max_ngram=2, min_ngram=2)
    d.begin([1, 2, 3, 1, 2])
    assert d.draft(2).tokens.tolist() == [3, 1]


def test_lookup_bounded_history_keeps_the_recent_tokens():
    """Bounding the history must keep its recent half (what the next tokens continue), not the oldest tokens.
    (Mutation: `keep = h[: max_history // 2]`.)"""
    d = LookupDrafter(max_history=100)
    ctx = list(range(1000, 1300)) + [1290]
    d.begin(ctx)
    assert d.history == ctx[-len(d.history):] and 0 < len(d.history) <= 100
    assert d.draft(3).tokens.tolist() == [1291, 1292, 1293]


def test_lookup_long_match_reaching_the_start_of_the_history():
    """A repeat that runs back to the first token of the history is as long as it is. (Mutation: `pos - 1 - m > 0`
    stops one token short of the start: an 8-token repeat labelled as a 4-gram match.)"""
    a = [11, 12, 13, 14, 15, 16, 17, 18]
    d = LookupDrafter(max_ngram=4)
    d.begin(a + a)
    got = d.draft(2)
    assert got.tokens.tolist() == [11, 12] and got.source == "lookup:8"


# ----------------------------------------------------------------------------- model drafter with a fake session

class _FakeSession:
    """The slice of GraphSession a ModelDrafter uses, over a real KVCache: the greedy next token is a hash of the
    whole context held in the cache slots (so a drafter cache that holds one token too many or too few drafts
    something else). `conf(context)` gives the argmax's logit margin over the other V-1 (all equal)."""

    def __init__(self, vocab=50, capacity=64, margin=lambda ctx: 8.0):
        self.V, self.cache, self.margin = vocab, KVCache(1, 1, 1, capacity), margin
        self.slots = [None] * (capacity + 1)

    def next_token(self, ctx) -> int:
        return hash(tuple(ctx)) % self.V

    def forward(self, ids, keep=0):
        ids = [int(t) for t in ids]
        assert ids, "an empty call"
        self.cache.check_room(len(ids))
        L = self.cache.length
        self.slots[L : L + len(ids)] = ids
        rows = []
        for i in range(len(ids)):
            ctx = self.slots[: L + i + 1]
            row = np.zeros(self.V, np.float32)
            row[self.next_token(ctx)] = self.margin(ctx)
            rows.append(row)
        rows = np.array(rows)
        return rows if keep == 0 else rows[-keep:]

    prefill = GraphSession.prefill  # the real chunked prefill over this forward and cache


def _oracle(sess, ctx, n):
    """The n greedy tokens the drafter model would propose after ctx, computed from scratch."""
    ctx, out = list(ctx), []
    for _ in range(n):
        t = sess.next_token(ctx)
        out.append(t)
        ctx.append(t)
    return out


def test_model_drafter_drafts_follow_the_committed_context_through_partial_accepts():
    """After every accept (all, some, or none of the drafts taken) the next draft equals what the drafter model
    proposes from scratch after the committed context, and the drafter's cache holds exactly committed tokens.
    (Mutations: the pending root counted as a fed draft, so rollback trims one token too many; the pending tokens
    after an accept taken from the target's token only, losing the last accepted draft.)"""
    sess = _FakeSession()
    d = ModelDrafter(sess, np.arange(sess.V), sess.V)
    ctx = [3, 1, 4, 1, 5]
    d.begin(ctx)
    rng = np.random.default_rng(0)
    for step in range(12):
        drafted = d.draft(4).tokens.tolist()
        assert drafted == _oracle(sess, ctx, 4), step
        n_acc = [4, 0, 2, 3, 1][step % 5]  # all, none, some
        bonus = int(rng.integers(sess.V))
        new = drafted[:n_acc] + [bonus]
        d.accept(new)
        ctx += new
        assert sess.cache.tokens + d.pending == ctx and sess.cache.length == len(sess.cache.tokens), step


def test_model_drafter_begin_on_a_context_it_already_holds():
    """A new request whose context equals everything in the drafter's cache (its drafts were all accepted, the
    answer ended) still leaves the last token pending, so the next draft has a root to feed. (Mutation: the common
    prefix search runs over the whole context, pending becomes empty and the draft call feeds nothing.)"""
    sess = _FakeSession()
    d = ModelDrafter(sess, np.arange(sess.V), sess.V)
    ctx = [7, 8, 9]
    d.begin(ctx)
    d.draft(3)  # the drafter's cache now holds ctx + the first two drafts
    again = list(sess.cache.tokens)
    d.begin(again)
    assert sess.cache.tokens + d.pending == again and d.pending == again[-1:]
    assert d.draft(2).tokens.tolist() == _oracle(sess, again, 2)


def test_model_drafter_threshold_reads_the_softmax_confidence():
    """Drafting stops when the drafter's top probability drops below the threshold — but never before its first
    token. (Mutations: confidence from the raw logits, not shifted by the max: 1/sum(exp(logits)); the stop rule
    applied to the first token too.)"""
    sure = _FakeSession(margin=lambda ctx: 8.0)  # top probability ≈ 0.98 over 50 tokens
    d = ModelDrafter(sure, np.arange(sure.V), sure.V, threshold=0.5)
    d.begin([1, 2, 3])
    assert len(d.draft(4)) == 4
    flat = _FakeSession(margin=lambda ctx: 0.5)  # top probability ≈ 0.03: below the threshold from the start
    d = ModelDrafter(flat, np.arange(flat.V), flat.V, threshold=0.5)
    d.begin([1, 2, 3])
    assert len(d.draft(4)) == 1


# ----------------------------------------------------------------------------- Token Recycling and its trees

@pytest.mark.parametrize("nodes", [4, 8, 16, 24])
def test_tree_template_holds_the_most_likely_paths(nodes):
    """With decreasing per-rank priors the template is the `nodes` most probable paths (probability = product of
    the priors of the ranks along it), every rank included. (Mutations: a next sibling scored from its elder
    sibling's path instead of their parent's; the last rank never grown.)"""
    prior = [0.45, 0.25, 0.15, 0.1]
    t = tree_template(nodes, prior)
    score = []
    for parent, rank in t:
        score.append((score[parent] if parent >= 0 else 1.0) * prior[rank])
    paths = [np.prod([prior[r] for r in seq])
             for depth in range(1, 6) for seq in itertools.product(range(4), repeat=depth)]
    best = sorted(paths, reverse=True)[:nodes]
    assert np.allclose(sorted(score, reverse=True), best)


def test_recycling_tree_never_drafts_from_a_row_it_never_observed():
    """A token whose successors were never observed has an all-zero row: drafting its "children" proposes token 0
    over and over. (Mutation: the `seen` check on a node's parent dropped.)"""
    d = RecyclingDrafter(100, k=4)
    d.observe([10, 20], np.array([[20, 21, 22, 23], [30, 31, 32, 33]]))
    d.begin([10])
    dr = d.draft(16)
    for i, tok in enumerate(dr.tokens.tolist()):
        p = int(dr.parents[i])
        parent_tok = 10 if p == 0 else int(dr.tokens[p - 1])
        assert d.seen[parent_tok], (i, tok, parent_tok)
    assert 0 not in dr.tokens.tolist()


def test_recycling_priors_count_the_rank_in_the_row_the_draft_used():
    """In the engine's order — draft from the root's row, the verify call's observe(), then accept() — the rank
    prior that grows is the rank the target's token had in the row the draft was read from."""
    d = RecyclingDrafter(100, k=4)
    d.observe([1], np.array([[20, 21, 22, 23]]))  # an earlier call: after 1 the target ranked 20, 21, 22, 23
    d.begin([0, 1])
    dr = d.draft(4)
    before = d.prior_counts.copy()
    top = np.array([[22, 20, 21, 23]] + [[0, 0, 0, 0]] * len(dr))  # this call: the target's top after 1 is 22
    d.observe([1] + dr.tokens.tolist(), top, [-1] + dr.parents.tolist(), before=0)
    d.accept([22])
    assert np.allclose(d.prior_counts - before, [0, 0, 1, 0])


def test_recycling_keeps_the_best_k_candidates_of_a_wider_call():
    """A sampling call can return more candidates than the matrix keeps (the head's k): the best k are kept.
    (Mutation: the last k columns kept.)"""
    d = RecyclingDrafter(100, k=2)
    d.observe([5, 6], np.array([[7, 8, 9, 10], [11, 12, 13, 14]]))
    assert d.adj[5].tolist() == [7, 8] and d.adj[6].tolist() == [11, 12]


def test_recycling_one_token_accept_keeps_the_pair_context():
    """A step that accepts no draft emits one token; the token before the new root is then the old root, and the
    next chain starts from the two-token table. (Mutation: prev reset to None after a one-token accept.)"""
    d = RecyclingDrafter(100, k=2, chains_only=True)
    d.observe([4, 5], np.array([[5, 60], [6, 61]]), before=3)  # verified: (3, 4) -> 5, (4, 5) -> 6
    d.observe([5], np.array([[40, 41]]), before=9)  # the one-token row of 5 says 40; the pair (4, 5) says 6
    d.begin([3, 4])
    d.accept([5])
    assert (d.prev, d.root) == (4, 5)
    dr = d.draft(1)
    assert dr.tokens.tolist() == [6] and dr.labels == ("recycling:b",)


def test_hybrid_tree_keeps_recycling_alternatives_at_the_root():
    """The merged tree holds the retrieved chain plus the recycling tree's other branches, including the root's
    other children (alternatives to the chain's first token). (Mutation: a recycling node is skipped when its parent
    is the root, so the hybrid tree degenerates to the lookup chain.)"""
    look = LookupDrafter()
    look.begin([1, 2, 3, 4, 1, 2])  # the chain after "1 2": 3, 4, 1
    rec = RecyclingDrafter(100, k=2)
    rec.observe([2], np.array([[3, 8]]))  # root 2's candidates: 3 (on the chain), 8 (an alternative)
    rec.begin([1, 2])
    dr = HybridDrafter(look, rec, lookup_len=3).draft(4)
    root_kids = [int(t) for t, p in zip(dr.tokens, dr.parents) if p == 0]
    assert sorted(root_kids) == [3, 8]


def test_hybrid_tree_nodes_keep_their_recycling_parents():
    """Every node of the merged tree is a prefix of the retrieved chain or a root-to-node path of the recycling tree,
    and every recycling path (within the budget) is there. (Mutation: a recycling node below a merged node points
    one index too far back, so its path reads through the wrong parent.)"""
    look = LookupDrafter()
    look.begin([1, 2, 3, 4, 1, 2])  # chain: 3, 4, 1
    rec = RecyclingDrafter(100, k=2)
    rec.observe([2, 8, 3, 5], np.array([[3, 8], [5, 6], [4, 9], [7, 2]]))
    rec.begin([1, 2])
    tree = rec.draft(6)
    chain = look.draft(3)
    allowed = {tuple(chain.tokens[: i + 1].tolist()) for i in range(len(chain))} | set(_paths(tree))
    merged = _paths(HybridDrafter(look, rec, lookup_len=3).draft(6))
    assert set(merged) <= allowed and len(set(merged)) == len(merged)
    assert set(_paths(tree)) <= set(merged)


def test_hybrid_begin_moves_the_recycling_root():
    """A new request's hybrid drafter must draft recycling nodes after the new context's last token, not after the
    last request's. (Mutation: HybridDrafter.begin forgets to begin the recycling half.)"""
    rec = RecyclingDrafter(100, k=2)
    h = HybridDrafter(LookupDrafter(), rec)
    h.begin([1, 2])
    h.accept([5, 6])
    h.begin([30, 40, 50])
    assert (rec.prev, rec.root) == (40, 50)


def test_hybrid_draft_stays_within_its_budget():
    """`draft(budget)` promises up to `budget` guesses (the engine sizes it to the memory
    plan's cap, draft_len and the KV room left), but the merge stops only at len(chain) + budget nodes."""
    look = LookupDrafter()
    look.begin([1, 2, 3, 4, 1, 2])
    rec = RecyclingDrafter(100, k=4)
    rec.observe([2, 3, 7], np.array([[9, 8, 7, 6], [4, 9, 10, 11], [8, 6, 5, 4]]))
    rec.begin([1, 2])
    h = HybridDrafter(look, rec)
    for budget in (1, 2, 4, 8):
        assert len(h.draft(budget)) <= budget, budget


# ----------------------------------------------------------------------------- KV cache

def _numbered_cache(capacity=8, length=2):
    c = KVCache(layers=2, kv_heads=1, head_dim=1, capacity=capacity)
    for a in c.arrays:
        a[...] = np.arange(a.shape[2], dtype=np.float32)[:, None]  # slot j holds j
    c.length = length
    return c


@pytest.mark.parametrize("idx,expected", [([0, 1, 2], [2, 3, 4]), ([0, 2, 3], [2, 4, 5]), ([1], [3]),
                                          ([2, 4], [4, 6]), ([0, 1, 4], [2, 3, 6])])
def test_kv_keep_moves_exactly_the_kept_slots(idx, expected):
    c = _numbered_cache()
    c.keep(idx)
    assert c.length == 2 + len(idx)
    assert c.buf[:, :, 0, 0, : c.length, 0].tolist() == [[[0, 1] + expected] * 2] * 2


def test_kv_bounds():
    """The cache fills exactly to capacity and refuses a rollback past its start. (Mutations: check_room / append
    off by one; room() one short; trim without its bound.)"""
    c = KVCache(1, 1, 1, capacity=4)
    c.check_room(4)
    c.append(4)
    assert c.room() == 0 and c.length == 4
    with pytest.raises(AssertionError):
        c.trim(5)
    c.trim(4)
    assert c.room() == 4


# ----------------------------------------------------------------------------- runner probes

class _WidthSession:
    """probe_min_call's view of a session whose first row moves by `eps` when the call has a second row."""

    def __init__(self, ulps):
        self.cache, self.ulps = KVCache(1, 1, 1, 64), ulps

    def forward(self, ids):
        rows = np.tile(np.linspace(-4, 4, 16, dtype=np.float32), (len(ids), 1))
        if len(ids) > 1:
            for _ in range(self.ulps):
                rows[0] = np.nextafter(rows[0], np.float32(np.inf))
        return rows


def test_min_call_probe_is_bit_exact():
    """A 1-row call that differs from the 2-row call's first row by one float32 ulp (~2e-7, GroupQueryAttention's
    single-query path) still makes greedy
    speculation lossy (an argmax tie flips): the probe must pad. (Mutation: np.allclose for np.array_equal.)"""
    assert probe_min_call(_WidthSession(0)) == 1
    s = _WidthSession(1)
    assert probe_min_call(s) == 2 and s.cache.length == 0


def test_sessions_start_with_an_empty_cache_and_exact_trees(tiny_dir):
    """The load-time probes leave the target's and the drafter's caches empty, and an fp32 graph verifies trees
    exactly (Token Recycling then drafts trees). (Mutations: a probe rolls back one token short; the tree probe
    puts the sibling at the wrong position or masks the wrong slot, so fp32 trees are switched off.)"""
    e = edge.load(tiny_dir, drafter="model", context=256)
    assert e.target.cache.length == 0 and e.target.tree_exact is True and not e.recycling.chains_only
    from edge.runner import GraphSession
    g = e.manifest.drafters[0]
    fresh = GraphSession(str(e.model_dir / g.file), e.manifest, g, 128)
    assert fresh.cache.length == 0


def test_a_graph_with_int8_activations_never_verifies_trees(tiny_dir):
    """Trees are never exact with int8 activations, even when the load-time probe happens to agree (here: the fp32
    graph described as int4 with accuracy_level 4). (Mutation: the manifest's int8_activations dropped from
    tree_exact, leaving the probe alone to decide.)"""
    import dataclasses

    from edge.manifest import load_manifest
    from edge.runner import GraphSession

    m = load_manifest(tiny_dir)
    g = dataclasses.replace(m.target, precision="int4", accuracy_level=4)
    assert g.int8_activations
    assert GraphSession(str(tiny_dir / m.target.file), m, g, 128).tree_exact is False
    assert GraphSession(str(tiny_dir / m.target.file), m, m.target, 128).tree_exact is True


@pytest.mark.parametrize("tree", [False, True])
def test_padded_single_row_calls_equal_unpadded_ones(tiny_dir, tree):
    """min_call 2 (older graphs whose 1-row path sums differently) pads a 1-token call with a second row that only
    sees itself; the real row must not see the pad row, and a tree call's own bias row must carry over. This export
    is width independent, so the padded call must give the unpadded call's logits. (Mutation: the first row's bias
    opened one column too far, onto the pad: a tree call's bias no longer fits; a causal call is saved by
    GroupQueryAttention's own causal mask.)"""
    from edge.manifest import load_manifest
    from edge.runner import GraphSession

    m = load_manifest(tiny_dir)
    s = GraphSession(str(tiny_dir / m.target.file), m, m.target, 128)
    s.prefill([5, 9, 11, 13, 17, 19])
    L = s.cache.length
    kw = dict(positions=np.array([L]), bias=np.zeros((1, 1, 1, L + 1), np.float32)) if tree else {}
    s.min_call = 1
    plain = s.forward([23], **kw).copy()
    s.min_call = 2
    out = s.call([23], **kw)
    padded = out.logits.copy()
    assert padded.shape == plain.shape == (1, s.vocab)
    np.testing.assert_allclose(padded, plain, atol=1e-4)
    assert out.top_ids.shape[0] == 1 and out.top_ids[0, 0] == plain[0].argmax()


def test_kv_grows_on_demand_and_keeps_every_slot():
    """Only the slots in use are allocated (rounded up); growing copies every old slot, pending ones too, tells
    the session which array it replaced, and never goes past capacity."""
    from memory.footprint import KV_GROW_SLOTS, kv_allocated_slots

    cap = 3 * KV_GROW_SLOTS + 5
    c = KVCache(layers=2, kv_heads=1, head_dim=1, capacity=cap)
    assert c.slots == KV_GROW_SLOTS and c.nbytes == 4 * (KV_GROW_SLOTS + 1) * 4
    for a in c.arrays:
        a[...] = np.arange(a.shape[2], dtype=np.float32)[:, None]
    seen = []
    assert not c.reserve(KV_GROW_SLOTS)
    assert c.reserve(KV_GROW_SLOTS + 1, lambda j, arr: seen.append((j, arr.shape[2])))
    assert c.slots == 2 * KV_GROW_SLOTS and seen == [(j, 2 * KV_GROW_SLOTS + 1) for j in range(4)]
    for a in c.arrays:
        assert a[0, 0, : KV_GROW_SLOTS + 1, 0].tolist() == list(range(KV_GROW_SLOTS + 1))
        assert not a[0, 0, KV_GROW_SLOTS + 1 :].any()
    assert c.reserve(cap + 100) and c.slots == cap  # never past capacity (check_room refuses beyond it)
    assert kv_allocated_slots(1, 10) == 10 and kv_allocated_slots(KV_GROW_SLOTS * 2 + 1, 10**6) == 3 * KV_GROW_SLOTS
    full = KVCache(layers=1, kv_heads=1, head_dim=1, capacity=cap, reserve_all=True)
    assert full.slots == cap
