"""Drafters behind one three-verb protocol (llama.cpp common/speculative.h; transformers' candidate generators):

    begin(context)    the whole token context; the last token is the pending root (not yet in the target cache)
    draft(budget)     → Draft(tokens, parents, q): up to `budget` guesses after the root
    accept(tokens)    the tokens the target emitted this step (accepted drafts + its own next token)

`parents[i]` is the index of node i's parent in the verify call, where node 0 is the root and draft token i is
node i+1; a chain has parents = [0, 1, 2, …]. `q[i]` is the distribution node i+1 was drafted from (target
vocabulary), or None for deterministic drafters (lookup), which verification then treats as point masses.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.sampling import process_logits, sample_from


@dataclass
class Draft:
    tokens: np.ndarray  # [N] int64
    parents: np.ndarray  # [N] int64, into [root] + tokens
    q: np.ndarray | None = None  # [N, V] or None

    @classmethod
    def empty(cls) -> "Draft":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def chain(cls, tokens, q=None) -> "Draft":
        t = np.asarray(tokens, np.int64)
        return cls(t, np.arange(len(t), dtype=np.int64), q)

    @property
    def is_chain(self) -> bool:
        return bool(np.array_equal(self.parents, np.arange(len(self.tokens))))

    def __len__(self) -> int:
        return len(self.tokens)


class NoDrafter:
    """Plain decoding: the reference every lossless test compares against."""

    name = "none"

    def begin(self, context) -> None:
        pass

    def draft(self, budget: int) -> Draft:
        return Draft.empty()

    def accept(self, tokens) -> None:
        pass


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
        h = self.history
        for t in tokens:
            i = len(h)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if i >= n:
                    self.index[tuple(h[i - n : i])] = i  # that n-gram was followed by position i
            h.append(int(t))
        if len(h) > self.max_history:  # bounded memory: keep the recent half
            keep = h[-self.max_history // 2 :]
            self.history, self.index = [], {}
            self._extend(keep)

    def draft(self, budget: int) -> Draft:
        h = self.history
        for n in range(min(self.max_ngram, len(h)), self.min_ngram - 1, -1):
            pos = self.index.get(tuple(h[len(h) - n :]))
            if pos is not None:
                return Draft.chain(h[pos : pos + budget])
        return Draft.empty()

    def accept(self, tokens) -> None:
        self._extend(tokens)

    @property
    def nbytes(self) -> int:
        return 8 * len(self.history) + 120 * len(self.index)


class ModelDrafter:
    """The exported early-exit, trimmed-vocabulary drafter: its own graph session and KV cache, rolled back to what
    the target accepted after every step. Stops drafting early when its own confidence drops below `threshold`
    (SpecDec++'s stopping rule with max-probability as the stand-in for the trained acceptance head)."""

    name = "model"

    def __init__(self, session, id_map: np.ndarray, target_vocab: int, threshold: float = 0.0,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, rng=None):
        self.sess = session
        self.id_map = np.asarray(id_map, np.int64)
        self.target_vocab = target_vocab
        self.threshold = threshold
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.rng = rng
        self.cached: list[int] = []  # tokens in the drafter's KV cache
        self.pending: list[int] = []  # committed by the target, not yet fed to the drafter
        self.drafted: list[int] = []
        self.fed = 0

    def begin(self, context) -> None:
        context = [int(t) for t in context]
        n = 0
        lim = min(len(context) - 1, len(self.cached))
        while n < lim and context[n] == self.cached[n]:
            n += 1
        self.sess.cache.trim(self.sess.cache.length - n)
        self.cached = self.cached[:n]
        self.pending = context[n:]
        # bulk-feed all but the last few pending tokens now, so draft() calls stay short
        if len(self.pending) > 1:
            bulk = self.pending[:-1]
            self.sess.prefill(bulk)
            self.cached += bulk
            self.pending = self.pending[-1:]
        self.drafted = []

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
            logits = self.sess.forward(feed, keep=1)[-1]
            self.sess.cache.append(len(feed))
            self.cached += feed
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
        if drop:
            del self.cached[len(self.cached) - drop :]
        self.pending = self.pending + tokens[keep:]  # pending is [] after any draft() that fed the drafter
        self.drafted, self.fed = [], 0


def make_drafter(kind: str, engine, params) -> object:
    """Build a drafter for one generation; `engine` supplies sessions and id maps."""
    if kind == "none":
        return NoDrafter()
    if kind == "lookup":
        return engine.lookup
    if kind == "model":
        return engine.model_drafter(params)
    raise ValueError(f"unknown drafter {kind!r}: choose auto, model, lookup or none")
