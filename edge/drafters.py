"""Drafters behind one three-verb protocol (llama.cpp common/speculative.h; transformers' candidate generators):

    begin(context)    the whole token context; the last token is the pending root (not yet in the target cache)
    draft(budget)     → Draft(tokens, parents, q): up to `budget` guesses after the root
    accept(tokens)    the tokens the target emitted this step (accepted drafts + its own next token)

Drafters whose drafts cost no model call also offer `chains(budget)`: candidate chains the engine prices token by
token (`edge.draftlen`). `DRAFTER_KINDS` is the registry: each drafter's name, default draft length and what it
needs of the target.

`parents[i]` is the index of node i's parent in the verify call, where node 0 is the root and draft token i is
node i+1; a chain has parents = [0, 1, 2, …]. `q[i]` is the distribution node i+1 was drafted from (target
vocabulary), or None for deterministic drafters (lookup), which verification then treats as point masses.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from kernels.sampling import process_logits, sample_from
from memory.footprint import (DRAFTERS, PREFILL_CHUNK, RECYCLING_PAIR_SLOTS, recycling_id_bytes,
                              recycling_pair_key_bytes)


_CHAIN_PARENTS = np.arange(256, dtype=np.int64)
_CHAIN_PARENTS.flags.writeable = False  # shared by every chain's `parents` (read-only views)
_CHAIN_VIEWS = [_CHAIN_PARENTS[:n] for n in range(len(_CHAIN_PARENTS) + 1)]  # made once: a draft is built every step


class Draft:
    """tokens [N] int64; parents [N] int64, into [root] + tokens; q [N, V] or None.

    `source`: what produced it, for acceptance statistics finer than the drafter ("lookup:3": a span found by a
    3-gram match; "recycling"); empty = the drafter's own name. `labels`: per token, what found it (chains from
    free drafters: "lookup:3", "recycling:b" / "recycling:u"); the engine prices each token by its label's
    acceptance (memory.acceptance.TokenAcceptance); None: the source for all. `known_chain`: set by `chain` (and
    `empty`), known to be a chain without comparing parents.

    A chain made from a list of Python ints keeps that list (`ids`) and makes its `tokens` array only when one is
    read: a free draft is built, labelled, cut and verified every step, right after an ONNX Runtime call, when each
    numpy call (an array from a list, a `tolist`) costs microseconds, and that path reads only the list."""

    __slots__ = ("_tokens", "_ids", "parents", "q", "source", "labels", "known_chain")

    def __init__(self, tokens, parents, q: np.ndarray | None = None, source: str = "",
                 labels: tuple[str, ...] | None = None, known_chain: bool = False):
        if isinstance(tokens, list):
            self._tokens, self._ids = None, tokens
        else:
            self._tokens, self._ids = tokens, None
        self.parents, self.q, self.source, self.labels, self.known_chain = parents, q, source, labels, known_chain

    @property
    def tokens(self) -> np.ndarray:
        """[N] int64."""
        if self._tokens is None:
            self._tokens = np.asarray(self._ids, np.int64)
        return self._tokens

    @property
    def ids(self) -> list[int]:
        """The tokens as a list of Python ints (do not modify it)."""
        if self._ids is None:
            self._ids = self._tokens.tolist()
        return self._ids

    @classmethod
    def empty(cls) -> "Draft":
        """No draft: one shared instance with read-only arrays (plain decoding asks for it every step)."""
        return _EMPTY

    @classmethod
    def chain(cls, tokens, q=None, source: str = "", labels=None) -> "Draft":
        """A chain of `tokens`: a list of Python ints (kept as it is: the caller hands it over), else any sequence
        of ids (an array of int64)."""
        if not isinstance(tokens, list):
            tokens = np.asarray(tokens, np.int64)
        n = len(tokens)
        parents = _CHAIN_VIEWS[n] if n < len(_CHAIN_VIEWS) else np.arange(n, dtype=np.int64)
        return cls(tokens, parents, q, source, None if labels is None else tuple(labels), known_chain=True)

    def head(self, n: int) -> "Draft":
        """The first n tokens of a chain."""
        assert self.is_chain, "only chains are cut by length"
        return Draft.chain(self._ids[:n] if self._ids is not None else self._tokens[:n],
                           None if self.q is None else self.q[:n], self.source,
                           None if self.labels is None else self.labels[:n])

    @property
    def is_chain(self) -> bool:
        return self.known_chain or bool(np.array_equal(self.parents, np.arange(len(self))))

    def __len__(self) -> int:
        return len(self._ids) if self._ids is not None else len(self._tokens)

    def __repr__(self) -> str:
        return (f"Draft(tokens={self.ids}, parents={self.parents.tolist()}, q={'None' if self.q is None else 'array'}, "
                f"source={self.source!r}, labels={self.labels!r})")


_EMPTY = Draft.chain(np.zeros(0, np.int64))
_EMPTY.tokens.flags.writeable = False


@runtime_checkable
class Drafter(Protocol):
    """The three verbs every drafter speaks."""

    def begin(self, context: list[int]) -> None: ...

    def draft(self, budget: int) -> "Draft": ...

    def accept(self, tokens: list[int]) -> None: ...


@runtime_checkable
class FreeDrafter(Drafter, Protocol):
    """A drafter whose drafts cost no model call: it offers candidate chains to price token by token."""

    def chains(self, budget: int) -> list["Draft"]: ...


@runtime_checkable
class Observer(Protocol):
    """A drafter fed by every speculative target call (its candidates after each verified token)."""

    def observe(self, tokens, top_ids, parents=None, before: int | None = None) -> None: ...


@dataclass(frozen=True)
class DrafterKind:
    """What the engine needs to know of a drafter before running it."""
    name: str
    default_len: int  # draft tokens (chain) or nodes (tree) per call when the request sets no draft_len
    free: bool  # drafts cost no model call: chains are cut token by token (`edge.draftlen.DraftLength.draft_free`)
    needs_topk: bool  # reads the target's on-graph top-k (Token Recycling's candidates)
    trees: bool  # drafts trees where the target verifies trees exactly (else chains)


# the memory model's drafter names (memory.footprint.DRAFTERS) are the registry's keys, in its order
DRAFTER_KINDS = {k.name: k for k in (
    DrafterKind("none", 0, free=False, needs_topk=False, trees=False),
    DrafterKind("lookup", 16, free=True, needs_topk=False, trees=False),
    DrafterKind("recycling", 8, free=True, needs_topk=True, trees=True),
    DrafterKind("hybrid", 16, free=True, needs_topk=True, trees=True),
    DrafterKind("model", 6, free=False, needs_topk=False, trees=False),
)}
assert tuple(DRAFTER_KINDS) == DRAFTERS, (tuple(DRAFTER_KINDS), DRAFTERS)
# what a user may ask for: "auto" lets the engine (or its memory plan) choose
DRAFTER_CHOICES = ("auto", "hybrid", "recycling", "model", "lookup", "none")


class NoDrafter:
    """Plain decoding: the reference every lossless test compares against."""

    name = "none"

    def begin(self, context) -> None:
        pass

    def draft(self, budget: int) -> Draft:
        return Draft.empty()

    def accept(self, tokens) -> None:
        pass


LONG_MATCH = (4, 8, 16, 32)  # lookup label classes once the longest n-gram matches (see _match_class)


class LookupDrafter:
    """Prompt lookup over the whole history (prompt, earlier turns, this answer): find the most recent earlier
    occurrence of the longest suffix n-gram and propose what followed it. A second turn that repeats or edits
    earlier text gets long spans (CopySpec). O(max_ngram) per token: an index from n-gram to the position after
    its most recent occurrence."""

    name = "lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_history: int = 1 << 20):
        self.max_ngram, self.min_ngram, self.max_history = max_ngram, min_ngram, max_history
        self.history: list[int] = []
        self.index: dict[tuple, int] = {}

    def begin(self, context) -> None:
        context = [int(t) for t in context]
        n = 0
        while n < min(len(context), len(self.history)) and context[n] == self.history[n]:
            n += 1
        if n < len(self.history):  # diverged (new chat, edited history): rebuild
            self.history, self.index = [], {}
            n = 0
        self._extend(context[n:])

    def _extend(self, tokens) -> None:
        h, index, lo, hi = self.history, self.index, self.min_ngram, self.max_ngram
        for t in tokens:
            i = len(h)
            for n in range(lo, min(hi, i) + 1):
                index[tuple(h[i - n : i])] = i  # that n-gram was followed by position i
            h.append(int(t))
        if len(h) > self.max_history:  # bounded memory: keep the recent half
            keep = h[-self.max_history // 2 :]
            self.history, self.index = [], {}
            self._extend(keep)

    def draft(self, budget: int) -> Draft:
        h = self.history
        for n in range(min(self.max_ngram, len(h)), self.min_ngram - 1, -1):
            pos = self.index.get(tuple(h[len(h) - n :]))
            if pos is not None:  # a longer match is a more reliable continuation: its own statistics
                return Draft.chain(h[pos : pos + budget], source=f"lookup:{self._match_class(pos, n)}")
        return Draft.empty()

    def chains(self, budget: int) -> list[Draft]:
        return [self.draft(budget)]

    def _match_class(self, pos: int, n: int) -> int:
        """The label's match length: n below max_ngram; at max_ngram the match is followed further back and
        classed by the largest of n, 4, 8, 16, 32 that it reaches. A span that has matched 30 tokens — a
        second turn rewriting the first answer, a summary quoting its source — is continued far more often than
        one found by a 4-gram, so it earns its own acceptance rate and longer drafts."""
        if n < self.max_ngram:
            return n
        h, m = self.history, n
        i, j = pos - 1 - m, len(h) - 1 - m  # the next pair of tokens to compare, walking back
        longest = min(LONG_MATCH[-1], pos)  # (the earlier occurrence cannot match past the history's start)
        while m < longest and h[i] == h[j]:
            m, i, j = m + 1, i - 1, j - 1
        return max([n] + [b for b in LONG_MATCH if b <= m])  # never below the n-gram that matched

    def accept(self, tokens) -> None:
        self._extend(tokens)

    @property
    def nbytes(self) -> int:
        return 8 * len(self.history) + 120 * len(self.index)


class ModelDrafter:
    """An exported trimmed-vocabulary drafter (early-exit, or a separate small checkpoint): its own graph session
    and KV cache, rolled back to what the target accepted after every step. Stops drafting early when its own
    confidence drops below `threshold` (SpecDec++'s stopping rule with max-probability as the stand-in for the
    trained acceptance head)."""

    name = "model"

    def __init__(self, session, id_map: np.ndarray, target_vocab: int, threshold: float = 0.0,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, rng=None, input_vocab: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK):
        self.sess = session
        self.prefill_chunk = prefill_chunk  # rows per prefill call: the target's (what the memory plan counts)
        # a drafter from its own checkpoint may have fewer embedding rows than the target has logits (padding
        # rows): such an id, if the target ever commits one, is fed as id 0 (the target verifies every draft)
        self.input_vocab = input_vocab
        self.id_map = np.asarray(id_map, np.int64)
        self.target_vocab = target_vocab
        self.threshold = threshold
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.rng = rng
        self.pending: list[int] = []  # committed by the target, not yet fed to the drafter
        self.drafted: list[int] = []
        self.fed = 0

    def begin(self, context) -> None:
        context = [int(t) for t in context]
        # the drafter's cache holds the ids it was fed (`_inputs`): the longest prefix of those is kept
        cache = self.sess.cache
        n = cache.common_prefix(self._inputs(context), len(context) - 1)
        cache.trim(cache.length - n)
        self.pending = context[n:]
        # bulk-feed all but the last few pending tokens now, so draft() calls stay short
        if len(self.pending) > 1:
            self.sess.prefill(self._inputs(self.pending[:-1]), chunk=self.prefill_chunk)
            self.pending = self.pending[-1:]
        self.drafted = []

    def _inputs(self, ids: list[int]) -> list[int]:
        n = self.input_vocab
        return ids if n is None else [t if t < n else 0 for t in ids]

    def _dist(self, logits: np.ndarray):
        """→ (token id in the target vocabulary, confidence, q over the target vocabulary or None)."""
        if self.temperature == 0:
            i = int(np.argmax(logits))
            if self.threshold > 0:
                z = logits - logits[i]
                conf = 1.0 / float(np.exp(z).sum())
            else:
                conf = 1.0
            return int(self.id_map[i]), conf, None
        p = process_logits(logits, self.temperature, self.top_k, self.top_p)
        i = sample_from(p, self.rng)
        q = np.zeros(self.target_vocab, np.float64)
        q[self.id_map] = p
        return int(self.id_map[i]), float(p.max()), q

    def draft(self, budget: int) -> Draft:
        toks, qs = [], []
        feed = self.pending
        budget = min(budget, max(0, self.sess.cache.room() - len(feed) - 1))
        self.fed = 0  # drafted tokens that went into the drafter cache
        for k in range(budget):
            fed = self._inputs(feed)
            logits = self.sess.forward(fed, keep=1)[-1]
            self.sess.cache.append(len(fed), fed)
            if k > 0:
                self.fed += 1
            tok, conf, q = self._dist(logits)
            if k > 0 and conf < self.threshold:
                break
            toks.append(tok)
            qs.append(q)
            feed = [tok]
        if budget:
            self.pending = []
        self.drafted = toks
        if not toks:
            return Draft.empty()
        return Draft.chain(toks, None if qs[0] is None else np.stack(qs))

    def accept(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        n_acc = len(tokens) - 1  # accepted drafts; tokens[-1] is the target's own token
        keep = min(n_acc, self.fed)
        drop = self.fed - keep
        self.sess.cache.trim(drop)
        self.pending = self.pending + tokens[keep:]  # pending is [] after any draft() that fed the drafter
        self.drafted, self.fed = [], 0


def tree_template(nodes: int, rank_prior) -> list[tuple[int, int]]:
    """A static draft-tree shape for `nodes` nodes: [(parent, rank)] in BFS-compatible order (parent -1 = root).
    Grown greedily by path probability, the product of per-rank priors along the path (DySpec's rule with
    static priors), so the tree spends its nodes where acceptance is likeliest."""
    import heapq

    prior = np.asarray(rank_prior, np.float64)
    out: list[tuple[int, int]] = []
    heap = [(-prior[0], -1, 0, 1.0)]  # (-score, parent, rank, parent score)
    while heap and len(out) < nodes:
        neg, parent, rank, pscore = heapq.heappop(heap)
        out.append((parent, rank))
        me = len(out) - 1
        score = -neg
        heapq.heappush(heap, (-score * prior[0], me, 0, score))  # first child
        if rank + 1 < len(prior):  # next sibling
            heapq.heappush(heap, (-pscore * prior[rank + 1], parent, rank + 1, pscore))
    return out


_TYPECODES = {("u", 2): "H", ("u", 4): "I", ("u", 8): "Q", ("i", 4): "i", ("b", 1): "?"}  # numpy → array/struct


class RecyclingDrafter:
    """Token Recycling (Luo et al., 2024): every verify call's top-k candidates — mostly "trash" that was never
    emitted — are kept as each token's likely successors in an adjacency matrix [V, k]; a draft tree is read out of
    it along a static template grown from per-rank acceptance priors, which adapt to observed acceptance.
    Training-free and free to run; state is bounded (uint16 ids when V < 65536: 49152 × 8 × 2 B ≈ 0.8 MB).

    Chains (for targets that verify chains only) first follow a second table: the target's top successor after the
    last *two* tokens, a hashed cache of PAIR_SLOTS pairs (key and one id each: 0.75 MB here; a newer pair
    overwrites an older one in its slot). Where a pair is known it is right more often than the one-token row
    (offline over the public prompt set's greedy answers: 44% vs 25% for summarization's first draft tokens), and
    each token's label says which table it came from, so the engine prices them apart."""

    name = "recycling"
    PAIR_SLOTS = RECYCLING_PAIR_SLOTS  # the footprint model counts the same bytes
    _HASH_MUL = 0x9E3779B97F4A7C15  # Fibonacci hashing: 2^64 / golden ratio
    _HASH_SHIFT = 64 - (PAIR_SLOTS.bit_length() - 1)  # keep the top log2(PAIR_SLOTS) bits

    def __init__(self, vocab: int, k: int = 8, nodes: int = 8, chains_only: bool = False):
        self.k = k
        self.chains_only = chains_only  # the target cannot verify trees exactly: draft the rank-0 path only
        self.adj = np.zeros((vocab, k), np.uint16 if recycling_id_bytes(vocab) == 2 else np.int32)
        self.seen = np.zeros(vocab, bool)
        self.prior_counts = np.array([8.0, 2.5, 1.2, 0.7, 0.5, 0.35, 0.25, 0.2][:k] + [0.1] * max(0, k - 8))
        self.misses = 8.0
        self._since_regrow = 0  # accepted steps since the templates were last re-grown from the priors
        self._drafted_row: list[int] | None = None  # the root's candidates as the last tree draft read them
        self.nodes = nodes
        self._templates: dict[int, list] = {}
        self.root: int | None = None
        self.prev: int | None = None  # the token before the root
        self.vocab = vocab
        key_t = np.uint32 if recycling_pair_key_bytes(vocab) == 4 else np.uint64  # max = empty slot
        self.pair_key = np.full(self.PAIR_SLOTS, np.iinfo(key_t).max, key_t)
        self.pair_next = np.zeros(self.PAIR_SLOTS, self.adj.dtype)

    @property
    def nbytes(self) -> int:
        return self.adj.nbytes + self.seen.nbytes + self.pair_key.nbytes + self.pair_next.nbytes

    def _tables(self) -> tuple:
        """Flat memoryviews of adj, seen, pair_key and pair_next. A step reads and writes a few entries of each
        right after a target call, when every numpy access (a fancy-indexed row write, a scalar read) costs
        microseconds; a memoryview's own indexing gives and takes Python ints. Rebuilt when an array has been
        replaced; never copied with the drafter (`__getstate__`)."""
        m = self.__dict__.get("_views")
        if m is None or m[0] is not self.adj or m[1] is not self.seen or m[2] is not self.pair_key \
                or m[3] is not self.pair_next:
            arrays = (self.adj, self.seen, self.pair_key, self.pair_next)
            m = self._views = arrays + tuple(memoryview(a).cast("B").cast(_TYPECODES[a.dtype.kind, a.itemsize])
                                             for a in arrays)
        return m[4:]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_views", None)  # memoryviews cannot be copied; the copy makes its own on first use
        return state

    def _slot(self, key: int) -> int:
        """Fibonacci hashing of a pair key onto PAIR_SLOTS: the top bits of key · 2^64/φ (mod 2^64). Plain Python:
        the table is read and written a few keys at a time, right after ONNX Runtime calls that leave every cache
        cold, where each numpy dispatch costs tens of µs."""
        return ((key * self._HASH_MUL) & 0xFFFFFFFFFFFFFFFF) >> self._HASH_SHIFT

    def pair_successor(self, prev: int, tok: int) -> int | None:
        """The target's top candidate after (prev, tok) the last time that pair was verified, if still cached."""
        return self._pair_successor(prev, tok, self._tables())

    def _pair_successor(self, prev: int, tok: int, tables: tuple) -> int | None:
        _, _, keys, nexts = tables
        key = prev * self.vocab + tok
        slot = self._slot(key)
        return nexts[slot] if keys[slot] == key else None

    def rank_prior(self) -> np.ndarray:
        return self.prior_counts / (self.prior_counts.sum() + self.misses)

    def template(self, nodes: int) -> list[tuple[int, int]]:
        t = self._templates.get(nodes)
        if t is None:
            t = tree_template(nodes, self.rank_prior())  # chains-only targets draft `_chain` instead
            self._templates[nodes] = t
        return t

    def begin(self, context) -> None:
        self.root = int(context[-1])
        self.prev = int(context[-2]) if len(context) >= 2 else None
        self._drafted_row = None  # a draft an interrupted answer never verified

    def observe(self, tokens, top_ids, parents=None, before: int | None = None) -> None:
        """tokens [S] of a verify call (tokens[0] = the root), top_ids [S, >=k] the target's candidates after each;
        parents [S] (parents[0] = -1) when the call was a tree, None for a chain; `before`: the committed token
        before the root (default: the one this drafter tracked, which is only current while it is drafting)."""
        # one numpy call for the rows, the rest through memoryviews (`_tables`): this runs right after a target call,
        # when every numpy call costs tens of µs (a fancy-indexed row write ~70 µs)
        t = [int(x) for x in tokens]  # Python ints: the pair keys below are hashed with 64-bit wraparound
        rows = np.asarray(top_ids).tolist()
        adj, seen, keys, nexts = self._tables()
        k, code = self.k, adj.format
        for x, row in zip(t, rows):  # a token seen twice keeps its last row
            adj[x * k : x * k + k] = array(code, row if len(row) == k else row[:k])
            seen[x] = True
        before = self.prev if before is None else int(before)
        if before is None:
            return
        prevs = [before] + (t[:-1] if parents is None else [t[q] for q in list(parents)[1:]])
        v, mul, shift = self.vocab, self._HASH_MUL, self._HASH_SHIFT
        for prev, tok, row in zip(prevs, t, rows):  # a later pair in the same slot wins
            key = prev * v + tok
            slot = ((key * mul) & 0xFFFFFFFFFFFFFFFF) >> shift  # `_slot`, inlined
            keys[slot] = key
            nexts[slot] = row[0]

    def _chain(self, budget: int) -> Draft:
        toks, labels = [], []
        prev, tok = self.prev, self.root
        adj, seen, keys, nexts = self._tables()
        k, v, mul, shift = self.k, self.vocab, self._HASH_MUL, self._HASH_SHIFT
        while len(toks) < budget:
            nxt = None
            if prev is not None:  # `_pair_successor`, inlined: up to a draft's length of lookups every step
                key = prev * v + tok
                slot = ((key * mul) & 0xFFFFFFFFFFFFFFFF) >> shift  # `_slot`
                if keys[slot] == key:
                    nxt = nexts[slot]
            if nxt is not None:
                labels.append("recycling:b")
            elif seen[tok]:
                nxt = adj[tok * k]
                labels.append("recycling:u")
            else:
                break
            toks.append(nxt)
            prev, tok = tok, nxt
        return Draft.chain(toks, source="recycling", labels=labels)

    def draft(self, budget: int) -> Draft:
        if budget <= 0 or self.root is None or not self._tables()[1][self.root]:
            return Draft.empty()
        if self.chains_only:
            return self._chain(budget)
        self._drafted_row = self.adj[self.root].tolist()  # the verify call's observe() overwrites the row
        toks, parents, node_tok = [], [], []
        where = {}  # template node → draft index
        for i, (parent, rank) in enumerate(self.template(budget)):
            ptok = self.root if parent < 0 else node_tok[parent]
            node_tok.append(None)
            if ptok is None or not self.seen[ptok] or (parent >= 0 and parent not in where):
                continue
            tok = int(self.adj[ptok, rank])
            node_tok[i] = tok
            where[i] = len(toks)
            toks.append(tok)
            parents.append(0 if parent < 0 else where[parent] + 1)
        return Draft(np.asarray(toks, np.int64), np.asarray(parents, np.int64), source="recycling")

    def chains(self, budget: int) -> list[Draft]:
        return [self.draft(budget)]

    def accept(self, tokens) -> None:
        # adapt the tree template's per-rank priors: where in the root's candidate row, as the draft read it, did
        # the target's next token sit? (Read after the verify call, the row is that call's own top-k: rank 0.)
        row, self._drafted_row = self._drafted_row, None
        if row is not None:
            tok = int(tokens[0])
            if tok in row:
                self.prior_counts[row.index(tok)] += 1
            else:
                self.misses += 1
            self._since_regrow += 1
            if self._since_regrow >= 64:
                self._since_regrow = 0
                self._templates.clear()  # re-grow templates from the updated priors now and then
        self.prev = int(tokens[-2]) if len(tokens) >= 2 else self.root
        self.root = int(tokens[-1])


class HybridDrafter:
    """Lookup and recycling in one tree (RASD-style fusion by longest common prefix): the retrieved chain first,
    then the recycling tree's nodes that are not already on it, within one node budget."""

    name = "hybrid"

    def __init__(self, lookup: LookupDrafter, recycling: RecyclingDrafter, lookup_len: int = 12):
        self.lookup, self.recycling, self.lookup_len = lookup, recycling, lookup_len

    def begin(self, context) -> None:
        self.lookup.begin(context)
        self.recycling.begin(context)

    def observe(self, tokens, top_ids, parents=None, before: int | None = None) -> None:
        self.recycling.observe(tokens, top_ids, parents, before)

    def chains(self, budget: int) -> list[Draft]:
        """Chains-only targets: the retrieved span and the recycling chain as alternatives; the engine verifies the
        one whose length-adjusted expected tokens per millisecond is higher (by each source's acceptance)."""
        return [self.lookup.draft(budget), self.recycling.draft(budget)]

    def draft(self, budget: int) -> Draft:
        chain = self.lookup.draft(min(self.lookup_len, budget))
        if (len(chain) and self.recycling.chains_only) or len(chain) >= budget:
            return chain  # chains only: the retrieved span wins when there is one; or it fills the budget alone
        tree = self.recycling.draft(budget)
        if not len(chain):
            return tree
        # trie merge: key = path of tokens from the root
        ids = chain.ids
        toks, parents = list(ids), list(range(len(chain)))
        index = {tuple(ids[: i + 1]): i + 1 for i in range(len(chain))}
        paths = [()]
        for t, p in zip(tree.tokens.tolist(), tree.parents.tolist()):
            path = paths[p] + (t,)
            paths.append(path)
            if path in index or paths[p] not in index and p != 0:
                continue
            if len(toks) >= budget:
                break
            index[path] = len(toks) + 1
            toks.append(t)
            parents.append(0 if p == 0 else index[paths[p]])
        return Draft(np.asarray(toks, np.int64), np.asarray(parents, np.int64))

    def accept(self, tokens) -> None:
        self.lookup.accept(tokens)
        self.recycling.accept(tokens)
