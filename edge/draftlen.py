"""Adaptive draft length: how many draft tokens each step sends to verification, and what it learns from each step.

Two rules, both "the most expected tokens per millisecond" (SpecDec's criterion):
- chains whose drafts cost a model call (the model drafter; lookup with a fixed source): the length K that maximises
  E[accepted + 1] / (draft cost + verify cost at width K + 1), from the drafter's online acceptance
  (`memory.planner.best_chain_length`);
- free drafts (lookup, recycling, hybrid on chains): the longest chain is drafted, then cut where the expected rate is
  best, pricing each token by the acceptance of its kind of token (`token_labels`), the stand-in for SpecDec++'s
  learned stopping head.
A drafter switched off this way is still tried with PROBE_K tokens every PROBE_EVERY steps, so its acceptance can
recover when the text changes. Verify costs come from the calls timed at about the current context (per context
bucket: a wide call's cost grows with the cache each row reads), else the planner's reference curve.
"""
from __future__ import annotations

from typing import Callable, Sequence

from memory.acceptance import MEASURED_TOKEN_PRIORS, AcceptanceStats, TokenAcceptance
from memory.footprint import drafter_graph, top1_agreement
from memory.planner import DEFAULT_PRIORS, Latency, LatencyCurve, best_chain_length, best_prefix

from .drafters import DRAFTER_KINDS, Draft

# a 3-row call costs ~1.15x a padded 1-token call on the 2-core dev VM: a probe is cheap
PROBE_EVERY, PROBE_K = 8, 2


def ema_ms(old_ms: float | None, seconds: float) -> float:
    """A moving average of times in ms, 80% the past (the first time: itself)."""
    return 1000 * seconds if old_ms is None else 0.8 * old_ms + 200 * seconds


def token_labels(d: Draft, kind: str, others: Sequence[Draft] = ()) -> tuple[str, ...]:
    """Acceptance labels of a free draft's tokens: what found each (`Draft.labels`, else its source, else the
    drafter), "@1" for the first token and "@2+" for the others, plus, when the step has other candidate chains,
    whether one of them drafted the same tokens up to and including this one ("/agree"), none had even the first
    token ("/split"), or they agreed at first and parted — or the other chain ended — before this token ("/parted")."""
    base = d.labels if d.labels is not None else (d.source or kind,) * len(d)
    toks = d.ids
    common = 0  # longest prefix any other candidate shares with this one
    for o in others:
        ot, n = o.ids, 0
        m = min(len(ot), len(toks))
        while n < m and ot[n] == toks[n]:
            n += 1
        common = max(common, n)

    # the suffixes by position, built a run at a time (every step labels every candidate's tokens)
    n = len(base)
    if not others:
        tails = ["@1"] + ["@2+"] * (n - 1)
    elif common:
        agree = min(common, n)
        tails = ["@1/agree"] + ["@2+/agree"] * (agree - 1) + ["@2+/parted"] * (n - agree)
    else:
        tails = ["@1/split"] + ["@2+/split"] * (n - 1)
    return tuple(map(str.__add__, base, tails))


class _Memo(dict):
    """f(s), each s computed once: a hit is the dict's own lookup, without a Python frame."""

    def __init__(self, f: Callable[[int], float]):
        super().__init__()
        self.f = f

    def __missing__(self, s: int) -> float:
        v = self[s] = self.f(s)
        return v


class DraftLength:
    """The adaptive draft-length policy of one engine and what it has learned: acceptance per drafter and per kind
    of drafted token, call time by width per context bucket, the model drafter's cost per token.

    What it reads of the engine, each when it needs it: `manifest()` (the export's latency figures and drafter
    graphs), `cache_length()` (the target's committed length), `min_call` (its narrowest call), `calibration()`
    (the device profile's calibration, or None) and `model_graph()` (the drafter graph running, None before one
    runs: a model drafter's prior is that graph's measured agreement)."""

    def __init__(self, manifest: Callable, cache_length: Callable[[], int], min_call: int,
                 calibration: Callable[[], dict | None], model_graph: Callable[[], str | None]):
        self._manifest, self.min_call = manifest, min_call
        self._cache_length, self._calibration, self._model_graph = cache_length, calibration, model_graph
        self.acceptance: dict[str, AcceptanceStats] = {}  # per drafter: what the planner reads
        self.token_acceptance = TokenAcceptance({**{k: a for k, (a, _) in DEFAULT_PRIORS.items()},
                                                 **MEASURED_TOKEN_PRIORS})
        self.idle: dict[str, int] = {}  # steps since the last probe on which the length chosen was 0
        self.calls_at: dict[int, dict[int, float]] = {}  # context bucket -> width -> mean call ms
        self.call_ms: dict[int, float] = {}  # the current bucket's
        self.curves: dict[int, LatencyCurve] = {}  # reference call times by width, per context bucket
        self._ref_memo: _Memo | None = None  # the latest reference curve's values (`_reference_ms`)
        self.draft_ms = 0.0  # model drafter: ms per drafted token (moving average)
        self._unverified: list[Draft] = []  # this step's candidate chains that were not verified

    # ------------------------------------------------------------------ what a call costs
    def at_context(self) -> None:
        """Start a step: call times are read and recorded for the bucket of the current context."""
        self.call_ms = self.calls_at.setdefault(self._cache_length().bit_length(), {})

    def verify_ms(self, s: int) -> float:
        """Mean call time at width s measured at about this context, else the reference curve at this context
        (`reference_curve`) scaled to the narrowest call measured at about this context (else as it is)."""
        return self.verify_prices(s, s)[s]

    def verify_prices(self, lo: int, hi: int) -> list[float | None]:
        """`verify_ms(s)` at index s for every width s in [lo, hi] (None below lo), in one pass: a step prices a
        dozen widths or more, and the reference curve is read once for all it has not timed."""
        calls = self.call_ms
        widths = range(lo, hi + 1)
        timed = [calls.get(s) for s in widths]
        if None in timed:
            ref = self._reference_ms()
            w = min(calls) if calls else None
            timed = [t if t is not None else ref[s] if w is None else calls[w] * ref[s] / ref[w]
                     for s, t in zip(widths, timed)]
        return [None] * lo + timed

    def _reference_ms(self) -> _Memo:
        """`reference_curve()` by width, each width evaluated once per curve (a curve never changes once made, and
        the widths a step prices that were not timed are priced from it every step)."""
        curve = self.reference_curve()
        memo = self._ref_memo
        if memo is None or memo.f is not curve:
            memo = self._ref_memo = _Memo(curve)
        return memo

    def reference_curve(self) -> LatencyCurve:
        """What a call of each width costs at the current context before any is timed there, as the planner prices
        it (`Latency.target_for`): a calibration's target curves (edge-profile on this device), else the export's
        engine-way timings at two contexts, else its one-row time and curve at 128 tokens (or the defaults). Kept
        per context bucket: the first context seen in a bucket prices it."""
        length = self._cache_length()
        bucket = length.bit_length()
        curve = self.curves.get(bucket)
        if curve is None:
            lat = Latency.from_calibration(self._manifest(), (self._calibration() or {}).get("latency"))
            curve = self.curves[bucket] = lat.target_for(max(1, length))
        return curve

    def call_widths(self) -> set[int]:
        """Widths of the decode calls timed so far, at any context."""
        return {w for calls in self.calls_at.values() for w in calls}

    def timed_call(self, width: int, seconds: float) -> None:
        self.call_ms[width] = ema_ms(self.call_ms.get(width), seconds)

    def timed_draft(self, tokens: int, seconds: float) -> None:
        """A model drafter drafted `tokens` in `seconds` (its first draft too averages with 0: a cold start)."""
        if tokens:
            self.draft_ms = ema_ms(self.draft_ms, seconds / tokens)

    # ------------------------------------------------------------------ how many tokens to draft
    def stats(self, kind: str) -> AcceptanceStats:
        """The online acceptance of drafter `kind`, from its prior until measured."""
        st = self.acceptance.get(kind)
        if st is None:
            prior = DEFAULT_PRIORS.get(kind, (0.3, 1.0))[0]
            m = self._manifest()
            if kind == "model" and m.drafters:  # the graph running (or about to run): its agreement
                prior = top1_agreement(drafter_graph(m, self._model_graph()), 0.3)
            st = self.acceptance[kind] = AcceptanceStats(prior)
        return st

    def probe(self, kind: str, k_max: int) -> int:
        """The length chosen was 0. Without drafts its acceptance estimate would never change again (for the rest of
        the engine's life: a lookup drafter that failed on open-ended prompts would stay off on the input-grounded
        ones that follow), so every PROBE_EVERY-th such step drafts PROBE_K tokens anyway."""
        n = self.idle.get(kind, 0) + 1
        self.idle[kind] = 0 if n >= PROBE_EVERY else n
        return min(PROBE_K, k_max) if n >= PROBE_EVERY else 0

    def choose_k(self, kind: str, k_max: int) -> int:
        """SpecDec-style adaptive length: the K with the best expected tokens per ms (memory.planner)."""
        if kind == "none" or k_max <= 0:
            return 0
        cost = self.draft_ms if kind == "model" else 0.0
        return best_chain_length(self.stats(kind), self.verify_ms, cost, k_max, self.min_call)

    def draft_free(self, drafter, kind: str, budget: int) -> Draft:
        """Drafts that cost nothing (lookup, recycling, hybrid on chains): draft the longest chains first, then cut
        each to the length with the best expected tokens per millisecond, each token priced by the acceptance of its
        kind (`token_labels`); with several candidate chains (hybrid: the retrieved span and the recycling chain) the
        best rate wins. Nothing worth drafting: every PROBE_EVERY-th time a short probe."""
        self._unverified = []
        if budget <= 0:
            return Draft.empty()
        cands = [c for c in drafter.chains(budget) if len(c)]
        if not cands:
            return Draft.empty()
        best, best_rate = None, 0.0
        # every width a cut is priced at, once per step: from the narrowest call to one past the longest candidate
        mc = self.min_call
        prices = self.verify_prices(max(1, mc), max(max(map(len, cands)) + 1, mc)).__getitem__
        labelled, chosen = [], None
        for i, c in enumerate(cands):
            labels = token_labels(c, kind, cands[:i] + cands[i + 1 :])
            labelled.append(Draft.chain(c.ids, None, c.source, labels))
            k, rate = best_prefix(self.token_acceptance.probs(labels), prices, mc)
            if k and rate > best_rate:
                best, best_rate, chosen = labelled[-1].head(k), rate, i
        if best is None:
            k = self.probe(labelled[0].source or kind, len(labelled[0]))
            best, chosen = (labelled[0].head(k), 0) if k else (None, None)
        self._unverified = [c for i, c in enumerate(labelled) if i != chosen]
        return best or Draft.empty()

    def is_free(self, kind: str, fixed: bool, tree: bool) -> bool:
        """Are this step's drafts cut by `draft_free`? Free chains whose length the request left open."""
        return DRAFTER_KINDS[kind].free and not fixed and not tree

    def draft(self, drafter, kind: str, k: int, room: int, *, fixed: bool, tree: bool) -> Draft:
        """This step's draft from `drafter` of `kind`, at most `room` tokens (what the answer and the cache still
        hold): a tree fills its `k` nodes; a chain takes the request's draft_len `k` when `fixed`, else the adaptive
        length up to `k` (the memory plan's cap or the drafter's default)."""
        if kind == "none":  # plain decoding
            return Draft.empty()
        if self.is_free(kind, fixed, tree):
            return self.draft_free(drafter, kind, min(k, room))
        k_step = k if fixed or tree else self.choose_k(kind, k)
        if k_step == 0 and kind != "none" and k > 0:
            k_step = self.probe(kind, k)
        budget = min(k_step, room)
        return drafter.draft(budget) if budget > 0 else Draft.empty()

    # ------------------------------------------------------------------ what a step teaches
    def learn(self, kind: str, d: Draft, accepted: int, truth: list[int], *, free: bool, tree: bool) -> None:
        """After verifying draft `d` of drafter `kind`: `accepted` of its tokens were accepted; `truth` is what the
        target produced (the accepted tokens and the next one); `free`: the draft was cut by `draft_free`; trees
        teach nothing here (their shape is fixed by the node budget)."""
        if free:  # the verified chain's tokens, then the candidates it beat, scored against the target
            if len(d):
                self.token_acceptance.update(d.labels, accepted)
            self.learn_unverified(truth)
        if not tree and len(d):
            self.stats(kind).update(len(d), accepted)  # per drafter: what the planner reads
            if d.source in DRAFTER_KINDS and d.source != kind:  # hybrid's recycling chain: recycling's too
                self.stats(d.source).update(len(d), accepted)

    def learn_unverified(self, truth: list[int]) -> None:
        """The candidates this step did not verify are scored against what the target produced (`truth`), as far as
        it reaches: a deterministic draft token would have been accepted exactly when it equals the target's token
        there. Without this a kind of token that is never chosen keeps its prior forever (a second turn's long
        retrieved spans lost to recycling chains priced on what they had earned while lookup's labels never
        moved)."""
        for c in self._unverified:
            toks = c.ids
            n = min(len(toks), len(truth))
            j = 0
            while j < n and toks[j] == truth[j]:
                j += 1
            self.token_acceptance.update(c.labels[: j + 1] if j < n else c.labels[:n], j)
        self._unverified = []

    def model_switched(self) -> None:
        """A model drafter now runs another graph: its acceptance and cost per token start over."""
        self.acceptance.pop("model", None)
        self.draft_ms = 0.0

    # ------------------------------------------------------------------ what persists
    def state(self) -> tuple:
        """What drafting has learned that a benchmark's repeats must not carry over (`Engine.drafter_state`)."""
        return self.acceptance, self.token_acceptance, self.idle

    def set_state(self, state: tuple) -> None:
        self.acceptance, self.token_acceptance, self.idle = state
