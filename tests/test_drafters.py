"""Drafters in isolation (edge/drafters.py): table-driven cases and bounds; the model drafter over a stand-in session
whose greedy token is a hash of its whole context, so a drafter cache one token off drafts something else. The engine
tests check losslessness end to end."""
import itertools

import numpy as np
import pytest

from edge.drafters import Draft, HybridDrafter, LookupDrafter, ModelDrafter, RecyclingDrafter, tree_template
from edge.kv import KVCache
from edge.runner import GraphSession
from kernels.tree import TreeLayout


@pytest.mark.parametrize("history,budget,expected", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # longest suffix "1 2" seen before → what followed
    ([5, 6, 7, 8, 9, 6, 7], 2, [8, 9]),
    ([1, 2, 3], 4, []),  # no earlier occurrence of any suffix
    ([4, 4, 4, 4], 3, [4]),  # most recent earlier match, continuation clipped at the end of history
    ([9, 1, 2, 9, 3, 4, 1, 2], 2, [9, 3]),  # the most recent occurrence wins
])
def test_lookup_drafts(history, budget, expected):
    d = LookupDrafter(max_ngram=3)
    d.begin(history)
    assert d.draft(budget).tokens.tolist() == expected


def test_hybrid_accept_moves_the_recycling_root():
    """Hybrid's recycling half drafted from a stale root when accept skipped it (lossless, only slower)."""
    rec = RecyclingDrafter(100, k=2)
    h = HybridDrafter(LookupDrafter(), rec)
    h.begin([1, 2])
    h.accept([5, 6])
    assert (rec.prev, rec.root) == (5, 6)


def test_lookup_follows_accepts_and_resets_on_divergence():
    d = LookupDrafter()
    d.begin([1, 2, 3, 1])
    d.accept([2])
    assert d.draft(2).tokens.tolist() == [3, 1]
    d.begin([7, 8])  # a different conversation: history rebuilt, not appended
    assert d.history == [7, 8]


def test_lookup_history_is_bounded():
    d = LookupDrafter(max_history=1000)
    d.begin(list(range(5000)))
    assert len(d.history) <= 1000 and len(d.index) <= 4 * 1000


@pytest.mark.parametrize("nodes", [1, 2, 5, 8, 16, 32])
def test_tree_template_is_a_valid_tree(nodes):
    t = tree_template(nodes, [0.5, 0.2, 0.1, 0.05])
    assert len(t) == nodes
    for i, (parent, rank) in enumerate(t):
        assert -1 <= parent < i and 0 <= rank < 4
    # siblings are distinct ranks
    pairs = [(p, r) for p, r in t]
    assert len(set(pairs)) == len(pairs)
    # the most likely path (rank 0 chain) is grown first
    assert t[0] == (-1, 0)


def test_recycling_drafts_from_observed_candidates_and_is_bounded():
    V = 49152
    d = RecyclingDrafter(V, k=8)
    assert d.nbytes < 2 * 1024 * 1024
    d.begin([10])
    assert len(d.draft(8)) == 0  # nothing observed for token 10 yet
    d.observe([10, 20], np.array([[20, 21, 22, 23, 24, 25, 26, 27], [30, 31, 32, 33, 34, 35, 36, 37]]))
    dr = d.draft(4)
    lay = TreeLayout.from_parents(np.concatenate([[-1], dr.parents]))
    assert dr.tokens[0] == 20 and dr.parents[0] == 0  # rank-0 successor of the root first
    for i, tok in enumerate(dr.tokens):  # every node is a recorded successor of its parent
        parent_tok = 10 if dr.parents[i] == 0 else dr.tokens[dr.parents[i] - 1]
        assert tok in d.adj[parent_tok]
    assert lay.num_nodes == len(dr) + 1


def test_recycling_accept_counts_where_the_next_token_sat():
    """Each step that drafted a tree moves the rank prior: +1 at the rank of the root's row (as the draft read it)
    that held the target's next token, a miss when none did; the tree templates are re-grown from the priors every
    64 such steps. A step without a tree draft teaches nothing."""
    d = RecyclingDrafter(100, k=4)
    d.observe([1, 2], np.array([[2, 5, 6, 7], [3, 8, 9, 10]]))
    before, misses = d.prior_counts.copy(), d.misses
    d.begin([0, 1])
    d.draft(4)
    d.accept([6, 3])  # rank 2 of root 1's row
    assert np.allclose(d.prior_counts - before, [0, 0, 1, 0]) and d.misses == misses
    d.begin([0, 1])
    d.draft(4)
    d.accept([99])  # not in the row
    assert np.allclose(d.prior_counts - before, [0, 0, 1, 0]) and d.misses == misses + 1
    d.begin([0, 50])
    d.draft(4)
    d.accept([3])  # root 50 was never observed: nothing drafted, nothing to learn
    d.begin([0, 1])
    d.accept([2])  # no draft this step
    d.begin([0, 1])
    d.draft(4)
    d.begin([0, 1])  # that draft was never verified (an interrupted answer): a new request starts
    d.accept([5])
    d.begin([0, 2])
    d.observe([1, 2], np.array([[2, 5, 6, 7], [3, 8, 9, 10]]))
    d.draft(4)
    d.accept([3, 20])  # rank 0 of root 2's row; the next root, 20, was never observed:
    d.draft(4)  # nothing drafted, so the next step teaches nothing (not against root 2's row)
    d.accept([9])
    assert np.allclose(d.prior_counts - before, [1, 0, 1, 0]) and d.misses == misses + 1
    d.template(4)
    for _ in range(61):  # 64 counted steps in all
        d.begin([0, 1])
        assert d._templates
        d.draft(4)
        d.accept([2])
    assert not d._templates


def test_chain_drafts_share_read_only_parents():
    c = Draft.chain([5, 6, 7])
    assert c.is_chain and c.parents.tolist() == [0, 1, 2] and not c.parents.flags.writeable
    assert c.head(2).is_chain and c.head(2).parents.tolist() == [0, 1]
    assert Draft.empty().is_chain and len(Draft.empty().parents) == 0
    long = Draft.chain(range(300))
    assert long.parents.tolist() == list(range(300))


def test_recycling_chains_only_gives_a_chain():
    d = RecyclingDrafter(100, k=4, chains_only=True)
    d.observe([1, 2, 3], np.array([[2, 5, 6, 7], [3, 8, 9, 10], [4, 11, 12, 13]]))
    d.begin([1])
    dr = d.draft(5)
    assert dr.is_chain and dr.tokens.tolist() == [2, 3, 4]


def draft_paths(dr) -> list[tuple[int, ...]]:
    """Each draft node's root-to-node path of tokens."""
    out = []
    for i in range(len(dr)):
        path, j = [], i + 1
        while j > 0:
            path.append(int(dr.tokens[j - 1]))
            j = int(dr.parents[j - 1])
        out.append(tuple(reversed(path)))
    return out


def test_hybrid_merges_common_prefix():
    look = LookupDrafter()
    look.begin([1, 2, 3, 4, 1, 2])
    rec = RecyclingDrafter(100, k=2)
    rec.observe([2, 3, 7], np.array([[3, 7], [4, 9], [8, 6]]))
    rec.begin([1, 2])
    h = HybridDrafter(look, rec, lookup_len=3)
    dr = h.draft(4)
    paths = set(draft_paths(dr))
    assert (3, 4, 1) in paths  # the retrieved chain
    assert len(paths) == len(dr)  # no duplicate root-to-node paths after the merge
    assert dr.tokens[:3].tolist() == [3, 4, 1]


def test_draft_chain_helpers():
    assert Draft.chain([5, 6]).is_chain and not Draft(np.array([5, 6]), np.array([0, 0])).is_chain
    assert len(Draft.empty()) == 0


def test_lookup_drafts_name_their_match_length():
    """The engine keeps acceptance statistics per matched n-gram length: each draft says which it came from."""
    d = LookupDrafter(max_ngram=4)
    d.begin([1, 2, 3, 4, 5, 6, 9, 2, 3, 4])  # suffix (2, 3, 4) occurred before, (9, 2, 3, 4) did not
    got = d.draft(3)
    assert got.source == "lookup:3" and got.tokens.tolist() == [5, 6, 9]
    d.begin([7, 8, 1, 7])
    assert d.draft(2).source == "lookup:1"
    assert d.draft(2).head(1).source == "lookup:1" and len(d.draft(2).head(1)) == 1
    r = RecyclingDrafter(16, k=2, chains_only=True)
    h = HybridDrafter(d, r)
    assert [c.source for c in h.chains(3) if len(c)] == ["lookup:1"]  # recycling has seen nothing yet


@pytest.mark.parametrize("run,label", [(4, "lookup:4"), (7, "lookup:4"), (8, "lookup:8"), (15, "lookup:8"),
                                       (16, "lookup:16"), (31, "lookup:16"), (32, "lookup:32"), (60, "lookup:32")])
def test_lookup_labels_long_matches_by_how_far_they_match(run, label):
    """At the longest n-gram the match is followed further back: a span continuing a 20-token repeat (a rewrite
    of an earlier answer) is labelled apart from one found by a bare 4-gram."""
    rng = np.random.default_rng(run)
    text = rng.permutation(1000)[:run + 10].tolist()
    d = LookupDrafter(max_ngram=4)
    d.begin([5000] + text + [6000] + text[:run])  # the last `run` tokens repeat text[:run]; a distinct token before
    got = d.draft(3)
    assert got.source == label and got.tokens.tolist() == text[run : run + 3]


@pytest.mark.parametrize("max_ngram,run,label", [(3, 3, "lookup:3"), (3, 20, "lookup:16"), (6, 6, "lookup:6"),
                                                 (6, 7, "lookup:6"), (6, 9, "lookup:8"), (6, 40, "lookup:32")])
def test_lookup_long_match_class_never_below_the_ngram(max_ngram, run, label):
    rng = np.random.default_rng(run)
    text = rng.permutation(1000)[:run + 10].tolist()
    d = LookupDrafter(max_ngram=max_ngram)
    d.begin([5000] + text + [6000] + text[:run])
    assert d.draft(3).source == label


def test_recycling_pair_table_keys_on_the_token_before():
    """Chains follow the successor of the last two tokens where that pair was verified, else of the last token; the
    labels say which table each token came from. Chain rows pair with the row before, tree rows with their parent,
    and the root with the committed token before it."""
    d = RecyclingDrafter(100, k=2, chains_only=True)
    d.observe([1, 2, 3], np.array([[2, 50], [3, 51], [4, 52]]), before=9)  # a chain call after ... 9
    assert [d.pair_successor(9, 1), d.pair_successor(1, 2), d.pair_successor(2, 3)] == [2, 3, 4]
    assert d.pair_successor(7, 2) is None  # never seen after 7
    d.observe([2, 60, 61], np.array([[70, 71], [72, 73], [74, 75]]), parents=[-1, 0, 0], before=8)  # a tree
    assert d.pair_successor(2, 61) == 74 and d.pair_successor(60, 61) is None  # 61's parent is the root, 2
    assert d.pair_successor(1, 2) == 3  # another context of 2 kept its own successor
    d.begin([5, 1, 2])  # ... 1, 2 pending
    dr = d.draft(3)
    # (1, 2) → 3 from the pair table; (2, 3) → 4; (3, 4) was never verified: 4's own row is empty (not seen) → stop
    assert dr.tokens.tolist() == [3, 4] and dr.labels == ("recycling:b", "recycling:b")
    d.begin([5, 6, 2])  # (6, 2) unknown: 2's one-token row (last written by the tree call) → 70
    dr = d.draft(1)
    assert dr.tokens.tolist() == [70] and dr.labels == ("recycling:u",)
    d.accept([70, 71])
    assert (d.prev, d.root) == (70, 71)


def test_recycling_observe_takes_numpy_ids_like_python_ints():
    """Token ids given as an int64 array (numpy scalars, whose products would not wrap like the hash needs) fill
    the same tables as the same ids given as Python ints."""
    top = np.array([[2, 50], [3, 51], [4, 52]])
    ids = np.array([40000, 2, 3], np.int64)
    a = RecyclingDrafter(49152, k=2)
    a.observe([40000, 2, 3], top, before=49151)
    for given in (ids, list(ids)):  # an array, and a list of numpy scalars
        b = RecyclingDrafter(49152, k=2)
        b.observe(given, top, before=np.int64(49151))
        for x, y in ((a.adj, b.adj), (a.seen, b.seen), (a.pair_key, b.pair_key), (a.pair_next, b.pair_next)):
            assert np.array_equal(x, y)
        assert b.pair_successor(49151, 40000) == 2 and b.pair_successor(2, 3) == 4


def test_recycling_pair_table_is_bounded_and_evicts_without_lying():
    """A fixed number of slots (memory stays under 2 MB at this vocabulary with the [V, k] matrix); a newer pair
    that hashes to an occupied slot evicts the older one, which then reads as unknown, never as another's id."""
    V = 49152
    d = RecyclingDrafter(V, k=8)
    assert d.nbytes < 2 * 1024 * 1024 and d.pair_key.dtype == np.uint32
    first = {}
    for k in range(1, 400_000):  # two keys sharing a slot
        s = d._slot(k)
        if s in first:
            a, b = first[s], k
            break
        first[s] = k
    (pa, ta), (pb, tb) = divmod(a, V), divmod(b, V)
    d.observe([ta], np.array([[11] * 8]), before=pa)
    assert d.pair_successor(pa, ta) == 11
    d.observe([tb], np.array([[12] * 8]), before=pb)
    assert d.pair_successor(pb, tb) == 12 and d.pair_successor(pa, ta) is None
    # one call that sees the same pair three times keeps the last successor, as writing them one by one would
    d.observe([5, 5, 5], np.array([[1] * 8, [2] * 8, [3] * 8]), before=5)
    assert d.pair_successor(5, 5) == 3
    big = RecyclingDrafter(262144, k=2)  # Gemma-3's vocabulary: keys no longer fit 32 bits
    assert big.pair_key.dtype == np.uint64
    big.observe([262143], np.array([[7, 8]]), before=262142)
    assert big.pair_successor(262142, 262143) == 7


def test_recycling_copies_and_replaced_tables_read_their_own_arrays():
    """The tables are read and written through views of their arrays: a copy (a drafter state kept aside) has its
    own, which later observations of the original leave alone, and an array replaced on the drafter is the one read
    and written from then on."""
    import copy

    d = RecyclingDrafter(49152, k=2, chains_only=True)
    d.observe([5, 6], np.array([[6, 9], [7, 9]]), before=4)
    saved = copy.deepcopy(d)
    d.observe([5, 6], np.array([[8, 9], [3, 9]]), before=4)
    assert saved.pair_successor(4, 5) == 6 and saved.adj[5].tolist() == [6, 9] and d.pair_successor(4, 5) == 8
    saved.observe([6], np.array([[1, 2]]), before=5)
    assert saved.pair_successor(5, 6) == 1 and d.pair_successor(5, 6) == 3
    d.begin([4, 5])
    assert d.draft(2).tokens.tolist() == [8]  # (8 was never observed: nothing follows it)
    d.adj, d.seen = np.zeros_like(d.adj), np.zeros_like(d.seen)
    d.pair_key, d.pair_next = np.full_like(d.pair_key, np.iinfo(d.pair_key.dtype).max), np.zeros_like(d.pair_next)
    assert d.pair_successor(4, 5) is None and len(d.draft(2)) == 0
    d.observe([5], np.array([[2, 9]]), before=4)
    assert d.adj[5].tolist() == [2, 9] and d.seen[5] and d.pair_successor(4, 5) == 2


def test_recycling_pair_slot_is_fibonacci_hashing():
    """`_slot` is the top log2(PAIR_SLOTS) bits of key · 0x9E3779B97F4A7C15 mod 2^64 (reference: numpy's wrapping uint64
    product), for 32-bit keys and for the 64-bit keys of a 262,144-token vocabulary."""
    rng = np.random.default_rng(1)
    for vocab in (49152, 262144):
        d = RecyclingDrafter(vocab, k=2)
        keys = np.concatenate([rng.integers(0, vocab * vocab, 2000, dtype=np.uint64),
                               np.array([0, 1, vocab * vocab - 1], np.uint64)])
        with np.errstate(over="ignore"):
            ref = (keys * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - (d.PAIR_SLOTS.bit_length() - 1))
        assert [d._slot(k) for k in keys.tolist()] == ref.tolist()
        assert int(ref.max()) < d.PAIR_SLOTS and len(set(ref.tolist())) > 1900  # spread over the table


def test_recycling_pair_table_reads_back_what_observe_wrote():
    d = RecyclingDrafter(49152, k=2)
    rng = np.random.default_rng(0)
    prev, tok = rng.integers(0, 49152, 500), rng.integers(0, 49152, 500)
    for p, t in zip(prev.tolist(), tok.tolist()):  # written one by one through observe, read back by the scalar hash
        d.observe([t], np.array([[t % 7, 0]]), before=p)
        assert d.pair_successor(p, t) == t % 7


# ----------------------------------------------------------------------------- lookup: history and matches

def test_lookup_rebuilds_on_a_divergence_after_a_common_prefix():
    """An edited last message (same start, different end) must not leave the old tail in the history, or the drafts
    continue text the conversation no longer holds: the history is rebuilt even when the two share a prefix."""
    d = LookupDrafter()
    d.begin([1, 2, 3, 4, 5, 6])
    d.begin([1, 2, 3, 9, 7, 1, 2])
    assert d.history == [1, 2, 3, 9, 7, 1, 2]
    assert d.draft(3).tokens.tolist() == [3, 9, 7]


def test_lookup_finds_an_ngram_at_the_very_start_of_the_history():
    """An n-gram that starts at the first position of the history is indexed too."""
    d = LookupDrafter(max_ngram=2, min_ngram=2)
    d.begin([1, 2, 3, 1, 2])
    assert d.draft(2).tokens.tolist() == [3, 1]


def test_lookup_bounded_history_keeps_the_recent_tokens():
    """Bounding the history keeps its recent half (what the next tokens continue), not the oldest tokens."""
    d = LookupDrafter(max_history=100)
    ctx = list(range(1000, 1300)) + [1290]
    d.begin(ctx)
    assert d.history == ctx[-len(d.history):] and 0 < len(d.history) <= 100
    assert d.draft(3).tokens.tolist() == [1291, 1292, 1293]


def test_lookup_long_match_reaching_the_start_of_the_history():
    """A repeat that runs back to the first token of the history is as long as it is: an 8-token repeat is labelled
    lookup:8, not stopped one token short of the start and labelled a 4-gram match."""
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

    def forward(self, ids, keep=0, prefill=False):
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

    def wide_prefill(self, s):
        return False


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
    proposes from scratch after the committed context, and the drafter's cache holds exactly the committed tokens: a
    rollback trims only drafts that were fed (the pending root is not one), and the tokens pending after an accept
    keep the last accepted draft."""
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
    """A new request whose context equals everything in the drafter's cache (its drafts were all accepted, the answer
    ended) still leaves the last token pending, so the next draft has a root to feed."""
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
    """Drafting stops when the drafter's top softmax probability (from the logits shifted by their maximum) drops
    below the threshold, but never before its first token."""
    sure = _FakeSession(margin=lambda ctx: 8.0)  # top probability ≈ 0.98 over 50 tokens
    d = ModelDrafter(sure, np.arange(sure.V), sure.V, threshold=0.5)
    d.begin([1, 2, 3])
    assert len(d.draft(4)) == 4
    flat = _FakeSession(margin=lambda ctx: 0.5)  # top probability ≈ 0.03: below the threshold from the start
    d = ModelDrafter(flat, np.arange(flat.V), flat.V, threshold=0.5)
    d.begin([1, 2, 3])
    assert len(d.draft(4)) == 1


# ----------------------------------------------------------------------------- Token Recycling and hybrid trees

@pytest.mark.parametrize("nodes", [4, 8, 16, 24])
def test_tree_template_holds_the_most_likely_paths(nodes):
    """With decreasing per-rank priors the template is the `nodes` most probable paths (probability = product of the
    priors of the ranks along it), every rank included: a next sibling is scored from its parent's path, not its
    elder sibling's, and the last rank grows too."""
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
    """A token whose successors were never observed has an all-zero row: the tree never drafts "children" from it,
    which would propose token 0 over and over."""
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
    """A sampling call can return more candidates than the matrix keeps (the head's k): the best k are kept, not the
    last k."""
    d = RecyclingDrafter(100, k=2)
    d.observe([5, 6], np.array([[7, 8, 9, 10], [11, 12, 13, 14]]))
    assert d.adj[5].tolist() == [7, 8] and d.adj[6].tolist() == [11, 12]


def test_recycling_one_token_accept_keeps_the_pair_context():
    """A step that accepts no draft emits one token; the token before the new root is then the old root, and the next
    chain starts from the two-token table."""
    d = RecyclingDrafter(100, k=2, chains_only=True)
    d.observe([4, 5], np.array([[5, 60], [6, 61]]), before=3)  # verified: (3, 4) -> 5, (4, 5) -> 6
    d.observe([5], np.array([[40, 41]]), before=9)  # the one-token row of 5 says 40; the pair (4, 5) says 6
    d.begin([3, 4])
    d.accept([5])
    assert (d.prev, d.root) == (4, 5)
    dr = d.draft(1)
    assert dr.tokens.tolist() == [6] and dr.labels == ("recycling:b",)


def test_hybrid_tree_keeps_recycling_alternatives_at_the_root():
    """The merged tree holds the retrieved chain plus the recycling tree's other branches, including the root's other
    children (alternatives to the chain's first token): it is more than the lookup chain."""
    look = LookupDrafter()
    look.begin([1, 2, 3, 4, 1, 2])  # the chain after "1 2": 3, 4, 1
    rec = RecyclingDrafter(100, k=2)
    rec.observe([2], np.array([[3, 8]]))  # root 2's candidates: 3 (on the chain), 8 (an alternative)
    rec.begin([1, 2])
    dr = HybridDrafter(look, rec, lookup_len=3).draft(4)
    root_kids = [int(t) for t, p in zip(dr.tokens, dr.parents) if p == 0]
    assert sorted(root_kids) == [3, 8]


def test_hybrid_tree_nodes_keep_their_recycling_parents():
    """Every node of the merged tree is a prefix of the retrieved chain or a root-to-node path of the recycling tree
    (a recycling node below a merged node points at its own parent), and every recycling path within the budget is
    there."""
    look = LookupDrafter()
    look.begin([1, 2, 3, 4, 1, 2])  # chain: 3, 4, 1
    rec = RecyclingDrafter(100, k=2)
    rec.observe([2, 8, 3, 5], np.array([[3, 8], [5, 6], [4, 9], [7, 2]]))
    rec.begin([1, 2])
    tree = rec.draft(6)
    chain = look.draft(3)
    allowed = {tuple(chain.tokens[: i + 1].tolist()) for i in range(len(chain))} | set(draft_paths(tree))
    merged = draft_paths(HybridDrafter(look, rec, lookup_len=3).draft(6))
    assert set(merged) <= allowed and len(set(merged)) == len(merged)
    assert set(draft_paths(tree)) <= set(merged)


def test_hybrid_begin_moves_the_recycling_root():
    """A new request's hybrid drafter drafts recycling nodes after the new context's last token, not after the last
    request's: begin() begins the recycling half too."""
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
