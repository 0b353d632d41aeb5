"""Acceptance statistics and draft-tree shapes: what the planner expects a drafter to earn per verify call.

Model (greedy verification; sampling runs measure their own rates the same way): at depth d below an accepted
node, the target's next token equals the drafter's rank-r candidate with probability a[d, r], independently of
the path. Candidates are distinct tokens, so these events are exclusive: sum_r a[d, r] <= 1. A node is accepted
when every node on its path is, so

    P(node accepted)  = prod over its path of a[depth, rank]
    E[accepted]       = draft_rate * sum over nodes of P(node accepted)

(`draft_rate`: the share of steps where the drafter proposes anything at all; lookup drafting often has no
match). For a chain of K rank-0 nodes this is sum_{d<=K} prod_{j<=d} a[j, 0], with a[j, 0] the familiar
per-depth conditional acceptance rate.

Depths are 1-based (depth 1 = the first draft token after the root); ranks are 0-based.
Tree shapes follow `edge.drafters.Draft.parents`: node i (0-based) has parent parents[i] in [0, i], an index
into [root] + nodes, so a chain of K is parents = (0, 1, ..., K-1).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

MAX_DEPTH = 64
MAX_RANK = 4


@dataclass(frozen=True)
class TreeShape:
    name: str  # "none" | "chain" | "best-first"
    parents: tuple[int, ...]  # [N], into [root] + nodes
    ranks: tuple[int, ...]  # [N], rank of each node among its siblings (0 = the drafter's top choice)

    def __post_init__(self):
        assert len(self.parents) == len(self.ranks), (len(self.parents), len(self.ranks))
        for i, p in enumerate(self.parents):
            assert 0 <= p <= i, f"node {i}: parent {p} must come before it"

    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        return cls("chain" if k else "none", tuple(range(k)), (0,) * k)

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0]  # the root
        for p in self.parents:
            d.append(d[p] + 1)
        return tuple(d[1:])

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def widths(self) -> tuple[int, ...]:
        """Nodes per depth 1..depth: the rows of each drafter call when a model drafts level by level."""
        w = [0] * self.depth
        for d in self.depths:
            w[d - 1] += 1
        return tuple(w)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(len(self)))

    def prefix(self, n: int) -> "TreeShape":
        """The first n nodes (a valid tree: parents come first)."""
        return TreeShape(self.name if n else "none", self.parents[:n], self.ranks[:n])


class AcceptanceStats:
    """Per-depth (and per-rank) acceptance rates as exponential moving averages, updated online.

    A prior counts as `prior_weight` observations, so the first few observations move the estimate quickly and
    later ones with weight `beta` (a moving average that follows a conversation's drift)."""

    def __init__(self, prior: float | Sequence[float] = 0.3, *, draft_rate: float = 1.0, beta: float = 0.1,
                 prior_weight: float = 4.0, rank_decay: float = 0.5, max_depth: int = MAX_DEPTH,
                 max_rank: int = MAX_RANK):
        if not 0 < beta <= 1:
            raise ValueError(f"beta must be in (0, 1] (got {beta})")
        if not 0 <= draft_rate <= 1:
            raise ValueError(f"draft_rate must be in [0, 1] (got {draft_rate})")
        p = np.full(max_depth, float(prior)) if np.ndim(prior) == 0 else np.asarray(prior, np.float64)
        if p.shape[0] < max_depth:  # a short prior list: its last value continues
            p = np.concatenate([p, np.full(max_depth - p.shape[0], p[-1] if p.size else 0.0)])
        p = p[:max_depth]
        if not np.all((p >= 0) & (p <= 1)):  # NaN fails both comparisons
            raise ValueError(f"acceptance priors must be in [0, 1] (got {p.tolist()})")
        self.beta, self.prior_weight, self.max_depth, self.max_rank = beta, prior_weight, max_depth, max_rank
        self.rate = p[:, None] * rank_decay ** np.arange(max_rank)[None, :]  # [depth, rank]
        self.count = np.zeros((max_depth, max_rank))
        self.draft_rate = float(draft_rate)
        self.draft_count = 0.0
        self._table: np.ndarray | None = None  # consistent a[depth, rank], rebuilt when `rate` changes
        self._table_of: np.ndarray | None = None

    # ------------------------------------------------------------------ updates
    def _ema(self, value: float, old: float, count: float) -> float:
        w = max(self.beta, 1.0 / (count + self.prior_weight))
        return old + w * (value - old)

    def _observe_rate(self, drafted: bool) -> None:
        self.draft_rate = self._ema(float(drafted), self.draft_rate, self.draft_count)
        self.draft_count += 1

    def _observe(self, depth: int, rank: int, hit: bool) -> None:
        d = depth - 1
        if d >= self.max_depth or rank >= self.max_rank:
            return
        rate, count, width = self._cells()
        i = d * width + rank
        n = count[i]
        rate[i] = self._ema(float(hit), rate[i], n)
        count[i] = n + 1.0
        self._table = None

    def _cells(self) -> tuple:
        """(rate, count, row width): flat memoryviews of the two tables, whose indexing gives and takes Python
        floats. A drafter's statistics are updated every decode step, right after an ONNX Runtime call, when each
        numpy scalar read or write costs a microsecond or more. Rebuilt when a table has been replaced; never
        copied with the statistics (`__getstate__`)."""
        m = self.__dict__.get("_views")
        if m is None or m[0] is not self.rate or m[1] is not self.count:
            for name in ("rate", "count"):  # (only a table set from outside can be another layout)
                a = getattr(self, name)
                if a.dtype != np.float64 or not a.flags.c_contiguous:
                    setattr(self, name, np.ascontiguousarray(a, np.float64))
            m = self._views = (self.rate, self.count, memoryview(self.rate).cast("B").cast("d"),
                               memoryview(self.count).cast("B").cast("d"), self.rate.shape[1])
        return m[2:]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_views", None)  # memoryviews cannot be copied; the copy makes its own on first use
        return state

    def update(self, drafted: int, accepted: int) -> None:
        """One chain step: `drafted` tokens verified, the first `accepted` of them accepted. Depths past the first
        rejection were never tested and are left alone."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be in [0, drafted] (got {accepted} of {drafted})")
        self._observe_rate(drafted > 0)
        # `_observe` at rank 0 of each depth tested, the tables read once
        depths = min(accepted + 1, drafted, self.max_depth)
        if depths <= 0 or self.max_rank <= 0:
            return
        rate, count, width = self._cells()
        for d in range(depths):
            i = d * width  # rank 0
            n = count[i]
            rate[i] = self._ema(float(d < accepted), rate[i], n)
            count[i] = n + 1.0
        self._table = None

    def update_tree(self, offered: Sequence[int], accepted_ranks: Sequence[int]) -> None:
        """One tree step. offered[i]: how many candidates (ranks 0..offered[i]-1) the tree held at depth i+1 under
        the accepted path; accepted_ranks[i]: the rank the target took there. A shorter `accepted_ranks` means the
        depth after it was rejected (every offered rank missed)."""
        if len(accepted_ranks) > len(offered):
            raise ValueError("more accepted depths than offered depths")
        for i, hit in enumerate(accepted_ranks):  # all checked before anything is observed
            if not 0 <= hit < offered[i]:
                raise ValueError(f"depth {i + 1}: accepted rank {hit} not among the {offered[i]} offered")
        self._observe_rate(len(offered) > 0 and offered[0] > 0)
        for i, m in enumerate(offered):
            hit = accepted_ranks[i] if i < len(accepted_ranks) else None
            for r in range(min(m, self.max_rank)):
                self._observe(i + 1, r, r == hit)
            if hit is None:
                break

    # ------------------------------------------------------------------ queries
    def table(self) -> np.ndarray:
        """[max_depth, max_rank] a[depth, rank] made consistent: non-increasing in rank, each depth summing to <= 1
        (raw moving averages of different ranks can disagree)."""
        if self._table is None or not np.array_equal(self._table_of, self.rate):  # `rate` may be set directly
            self._table_of = self.rate.copy()
            t = np.clip(self.rate, 0.0, 1.0)
            t[:, 1:] = np.minimum(t[:, 1:], np.minimum.accumulate(t, axis=1)[:, :-1])
            room = 1.0 - np.concatenate([np.zeros((t.shape[0], 1)), np.cumsum(t, axis=1)[:, :-1]], axis=1)
            self._table = np.maximum(np.minimum(t, room), 0.0)
        return self._table

    def accept_prob(self, depth: int, rank: int = 0) -> float:
        """a[depth, rank] from `table()`; depths past max_depth reuse the last one, ranks past max_rank are 0."""
        if depth < 1 or rank < 0:
            raise ValueError(f"depth >= 1 and rank >= 0 (got {depth}, {rank})")
        if rank >= self.max_rank:
            return 0.0
        return float(self.table()[min(depth, self.max_depth) - 1, rank])

    def node_probs(self, shape: TreeShape) -> np.ndarray:
        """[N] probability that each node is accepted (given the drafter proposed this step)."""
        t = self.table()
        p = [1.0]
        for parent, depth, rank in zip(shape.parents, shape.depths, shape.ranks):
            p.append(p[parent] * (float(t[min(depth, self.max_depth) - 1, rank]) if rank < self.max_rank else 0.0))
        return np.asarray(p[1:])

    def expected_accepted(self, shape: TreeShape | int) -> float:
        """E[accepted draft tokens per verify call] for a tree shape (or a chain length)."""
        if isinstance(shape, int):
            shape = TreeShape.chain(shape)
        return self.draft_rate * float(self.node_probs(shape).sum())

    def best_first(self, n: int) -> TreeShape:
        """The n-node tree with the largest E[accepted]: nodes in decreasing order of P(node accepted).

        Optimal for this model because a node's probability never exceeds its parent's (a <= 1) nor its lower-rank
        sibling's (a non-increasing in rank), so the n most probable nodes always form a valid tree (Sequoia's
        and SpecInfer's dynamic-tree argument). Prefixes of the result are the best smaller trees."""
        parents, ranks, probs = [], [], [1.0]
        depth_of = [0]
        heap: list[tuple[float, int, int, int, int]] = []  # (-p, tiebreak, parent index, depth, rank)
        seq = 0

        def push(parent: int, depth: int, rank: int):
            nonlocal seq
            if depth > self.max_depth or rank >= self.max_rank:
                return
            p = probs[parent] * self.accept_prob(depth, rank)
            if p > 0:
                heapq.heappush(heap, (-p, seq, parent, depth, rank))
                seq += 1

        push(0, 1, 0)
        while heap and len(parents) < n:
            negp, _, parent, depth, rank = heapq.heappop(heap)
            parents.append(parent)
            ranks.append(rank)
            probs.append(-negp)
            depth_of.append(depth)
            me = len(parents)  # index of this node in [root] + nodes
            push(me, depth + 1, 0)
            push(parent, depth, rank + 1)
        name = "best-first" if parents else "none"
        return TreeShape(name, tuple(parents), tuple(ranks))

    # ------------------------------------------------------------------ persistence (calibration JSON)
    def to_dict(self) -> dict:
        return {"rate": self.rate.round(6).tolist(), "count": self.count.tolist(), "draft_rate": self.draft_rate,
                "draft_count": self.draft_count, "beta": self.beta, "prior_weight": self.prior_weight}

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceStats":
        """The inverse of `to_dict`; ValueError naming what is wrong (a calibration file is user input)."""
        if not isinstance(d, dict) or "rate" not in d:
            raise ValueError(f"acceptance entry must be an object with a 'rate' table (got {d!r:.80})")
        try:
            rate = np.asarray(d["rate"], np.float64)
            count = np.asarray(d.get("count", np.zeros_like(rate)), np.float64)
            nums = {k: float(d.get(k, v)) for k, v in (("beta", 0.1), ("prior_weight", 4.0), ("draft_rate", 1.0),
                                                        ("draft_count", 0.0))}
        except (TypeError, ValueError) as e:
            raise ValueError(f"acceptance entry: not numbers ({e})") from None
        if rate.ndim != 2 or 0 in rate.shape or not np.all((rate >= 0) & (rate <= 1)):
            raise ValueError(f"acceptance rate must be a [depth][rank] table of probabilities (got shape "
                             f"{rate.shape})")
        if count.shape != rate.shape or not np.all(np.isfinite(count) & (count >= 0)):
            raise ValueError(f"acceptance count must be a table of counts >= 0 shaped like rate {rate.shape}")
        if not (0 < nums["beta"] <= 1 and 0 <= nums["draft_rate"] <= 1 and 0 <= nums["prior_weight"] < np.inf
                and 0 <= nums["draft_count"] < np.inf):
            raise ValueError(f"acceptance entry: beta in (0, 1], draft_rate in [0, 1], prior_weight and "
                             f"draft_count finite >= 0 (got {nums})")
        s = cls(0.0, beta=nums["beta"], prior_weight=nums["prior_weight"], max_depth=rate.shape[0],
                max_rank=rate.shape[1], draft_rate=nums["draft_rate"])
        s.rate, s._table = rate, None
        s.count, s.draft_count = count, nums["draft_count"]
        return s

    def __repr__(self) -> str:
        head = ", ".join(f"{self.accept_prob(d):.2f}" for d in range(1, 5))
        return f"AcceptanceStats(a[1..4, rank 0]=[{head}], draft_rate={self.draft_rate:.2f})"


# Measured priors per kind of drafted token: the share accepted (given every token before it was) over one
# `edge-bench --modes none,hybrid --reps 2` run of all 180 prompts of ../shared/workloads/public.jsonl (SmolLM2-135M,
# w8a8; labels tested >= 100 times, capped at 0.98). A fresh process starts from these instead of a flat 0.3, so its
# first answer already trusts a span that has matched 16 tokens and distrusts a lone 1-gram. Other models start from
# the same table and move away from it within a few dozen steps (moving average, `prior_weight`).
MEASURED_TOKEN_PRIORS = {
    "lookup:16@1": 0.95, "lookup:16@1/agree": 0.95, "lookup:16@2+": 0.96, "lookup:16@2+/agree": 0.97,
    "lookup:16@2+/parted": 0.95, "lookup:16@2+/split": 0.95, "lookup:1@1": 0.26, "lookup:1@1/agree": 0.41,
    "lookup:1@1/split": 0.15, "lookup:1@2+": 0.67, "lookup:1@2+/agree": 0.75, "lookup:1@2+/parted": 0.35,
    "lookup:2@1": 0.53, "lookup:2@1/agree": 0.67, "lookup:2@1/split": 0.34, "lookup:2@2+": 0.75,
    "lookup:2@2+/agree": 0.81, "lookup:2@2+/parted": 0.45, "lookup:2@2+/split": 0.79, "lookup:32@1": 0.98,
    "lookup:32@1/agree": 0.98, "lookup:32@2+": 0.98, "lookup:32@2+/agree": 0.98, "lookup:32@2+/parted": 0.98,
    "lookup:32@2+/split": 0.93, "lookup:3@1": 0.6, "lookup:3@1/agree": 0.75, "lookup:3@1/split": 0.41,
    "lookup:3@2+": 0.8, "lookup:3@2+/agree": 0.85, "lookup:3@2+/parted": 0.78, "lookup:3@2+/split": 0.73,
    "lookup:4@1": 0.71, "lookup:4@1/agree": 0.83, "lookup:4@1/split": 0.59, "lookup:4@2+": 0.79,
    "lookup:4@2+/agree": 0.86, "lookup:4@2+/parted": 0.7, "lookup:4@2+/split": 0.78, "lookup:8@1": 0.85,
    "lookup:8@1/agree": 0.88, "lookup:8@1/split": 0.84, "lookup:8@2+": 0.9, "lookup:8@2+/agree": 0.92,
    "lookup:8@2+/parted": 0.91, "lookup:8@2+/split": 0.86, "recycling:b@1": 0.45, "recycling:b@1/agree": 0.76,
    "recycling:b@1/split": 0.19, "recycling:b@2+": 0.75, "recycling:b@2+/agree": 0.87,
    "recycling:b@2+/parted": 0.32, "recycling:b@2+/split": 0.42, "recycling:u@1": 0.27, "recycling:u@1/agree": 0.42,
    "recycling:u@1/split": 0.18, "recycling:u@2+": 0.28,
}


class TokenAcceptance:
    """Acceptance of free drafts (lookup spans, recycling chains) per *kind of token*, not per depth: each drafted
    token carries a label (what found it: "lookup:3" = a 3-gram match, "lookup:16" = a match reaching 16+ tokens,
    "recycling:b" = successor of the last two tokens, "recycling:u" = of the last one; whether it is the first token
    of the draft; whether another candidate chain drafted the same tokens up to it: /agree, /parted, /split), and
    each label keeps the rate at which such a token was accepted once every token before it was.

    Why not per depth: after the first token a chain's tokens are accepted at much the same rate at any depth, so
    one shared "deeper" estimate learns from every step instead of a sliver of them (offline, over the plain greedy
    answers of the public prompt set, per-depth estimates cost code, rag and translation 0.1-0.2x of speedup).
    Bounded: one entry per label, and labels come from a small fixed set."""

    def __init__(self, priors: dict[str, float] | None = None, default: float = 0.3, beta: float = 0.05,
                 prior_weight: float = 4.0):
        if not 0 < beta <= 1:
            raise ValueError(f"beta must be in (0, 1] (got {beta})")
        self.priors = dict(priors or {})
        self.default, self.beta, self.prior_weight = default, beta, prior_weight
        self.rate: dict[str, float] = {}
        self.count: dict[str, float] = {}
        self.hits: dict[str, float] = {}  # accepted of `count` tested, over the whole life (the EMA forgets)
        self._resolved: dict[str, float] = {}  # label -> its prior, looked up once (a few dozen labels at most)

    def _prior(self, label: str) -> float:
        """The label's own prior if there is one (`MEASURED_TOKEN_PRIORS`), else that of the label without its
        agreement suffix, else its family's ("lookup", "recycling"), else the default."""
        p = self._resolved.get(label)
        if p is None:
            p = next((self.priors[k] for k in (label, label.split("/")[0], label.split("@")[0].split(":")[0])
                      if k in self.priors), self.default)
            self._resolved[label] = p
        return p

    def _rate(self, label: str) -> float:
        """The label's current rate; its prior until it has been tested (looked up only then: this runs every step)."""
        return self.rate[label] if label in self.rate else self._prior(label)

    def probs(self, labels: Sequence[str]) -> list[float]:
        """[N] conditional acceptance of each token given all before it were accepted."""
        rate, prior = self.rate, self._prior  # (runs every decode step: `_rate` inlined)
        return [rate[x] if x in rate else prior(x) for x in labels]

    def update(self, labels: Sequence[str], accepted: int) -> None:
        """One verified chain: the first `accepted` tokens were accepted, the next one (if any) rejected; tokens
        after it were never tested."""
        if not 0 <= accepted <= len(labels):
            raise ValueError(f"accepted must be in [0, {len(labels)}] (got {accepted})")
        rate, count, hits, beta, weight = self.rate, self.count, self.hits, self.beta, self.prior_weight
        for j in range(min(accepted + 1, len(labels))):  # (runs every decode step: `_rate` inlined)
            x = labels[j]
            old = rate[x] if x in rate else self._prior(x)
            n = count.get(x, 0.0)
            w = max(beta, 1.0 / (n + weight))
            hit = float(j < accepted)
            rate[x] = old + w * (hit - old)
            count[x] = n + 1
            hits[x] = hits.get(x, 0.0) + hit

    def tested(self) -> dict[str, tuple[float, float]]:
        """Per label: (accepted, tested) drafted tokens over the whole life."""
        return {x: (self.hits.get(x, 0.0), n) for x, n in self.count.items()}

    def summary(self) -> dict[str, dict[str, float]]:
        """Per label: the current (moving) rate, the lifetime rate and how many tokens were tested."""
        return {x: {"rate": round(self.rate[x], 4), "lifetime": round(h / n, 4), "n": int(n)}
                for x, (h, n) in sorted(self.tested().items())}

    def __repr__(self) -> str:
        return "TokenAcceptance(" + ", ".join(f"{k}={v:.2f}" for k, v in sorted(self.rate.items())) + ")"
