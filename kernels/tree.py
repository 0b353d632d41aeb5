"""Token trees for speculative decoding: layout (mask, positions), verification, KV gathers.

Convention: one verify call lays its tokens out as nodes ``0..S-1`` in topological order.
Node 0 is the root, the last committed token whose K/V is not yet in the cache;
``parents[0] == -1`` and ``0 <= parents[i] < i`` for ``i >= 1``. Row i of the target's logits
(and of ``p``) predicts the child of node i; row i of ``q`` is the distribution node i's
children were drafted from. Siblings are "in index order": a drafter that samples siblings
one after another must number them in that order. A chain of K drafts is the tree
``parents = [-1, 0, 1, ..., K-1]``.

``p``/``q`` and accepted / recovered / bonus tokens are as defined in :mod:`kernels.verify`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kernels.sampling import sample_from
from kernels.verify import recovered_distribution


def _check_parents(parents) -> np.ndarray:
    """Validate the tree convention; returns parents as a fresh int32 array [S]."""
    arr = np.asarray(parents)
    if arr.ndim != 1 or arr.shape[0] == 0:
        raise ValueError(f"parents must be a non-empty 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"parents must hold integer node indices, got dtype {arr.dtype}")
    if arr[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {arr[0]}")
    idx = np.arange(1, arr.shape[0])
    bad = np.flatnonzero((arr[1:] < 0) | (arr[1:] >= idx))
    if bad.size:
        i = int(bad[0]) + 1
        raise ValueError(
            f"parents must satisfy 0 <= parents[i] < i for i >= 1 (topological order; see "
            f"topological_order() to relabel), got parents[{i}] = {arr[i]}"
        )
    return arr.astype(np.int32)


def _depths(parents: np.ndarray) -> np.ndarray:
    depths = np.zeros(parents.shape[0], dtype=np.int32)
    pl = parents.tolist()
    for i in range(1, len(pl)):
        depths[i] = depths[pl[i]] + 1
    return depths


def _children(parents: np.ndarray) -> list[list[int]]:
    """Children of every node, each list in index order."""
    pl = np.asarray(parents).tolist()
    kids: list[list[int]] = [[] for _ in pl]
    for i in range(1, len(pl)):
        kids[pl[i]].append(i)
    return kids


def chain_parents(k: int) -> np.ndarray:
    """Parents of a chain: the root plus k drafts, ``[-1, 0, 1, ..., k-1]`` (int32 [k+1])."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return np.arange(-1, k, dtype=np.int32)


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """Shape of one verify call's token tree: parents and depths, both int32 [S], read-only.

    The ancestor matrix is built once per layout and cached; :meth:`attention_bias` only
    prepends the (all-visible) committed past to it.
    """

    parents: np.ndarray  # [S] int32
    depths: np.ndarray  # [S] int32

    def __post_init__(self) -> None:
        parents = _check_parents(self.parents)
        depths = np.asarray(self.depths)
        expected = _depths(parents)
        if depths.shape != expected.shape or not np.array_equal(depths, expected):
            raise ValueError(f"depths {depths.tolist()} do not match parents {parents.tolist()}")
        parents.setflags(write=False)
        expected.setflags(write=False)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "depths", expected)

    @classmethod
    def from_parents(cls, parents) -> TreeLayout:
        """Layout from a parent list in the convention above (ValueError otherwise)."""
        parents = _check_parents(parents)
        return cls(parents, _depths(parents))

    @classmethod
    def from_chain(cls, k: int) -> TreeLayout:
        """A chain: the root plus k drafts."""
        return cls.from_parents(chain_parents(k))

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    def __len__(self) -> int:
        return self.num_nodes

    @cached_property
    def _ancestors(self) -> np.ndarray:
        # Row i = row of its parent plus itself; parents come first, so one pass suffices.
        s = self.num_nodes
        anc = np.eye(s, dtype=bool)
        pl = self.parents.tolist()
        for i in range(1, s):
            anc[i] |= anc[pl[i]]
        anc.setflags(write=False)
        return anc

    def ancestor_mask(self) -> np.ndarray:
        """bool [S, S]: ``mask[i, j]`` iff node j is node i or one of its ancestors."""
        return self._ancestors.copy()

    def position_ids(self, past_len: int) -> np.ndarray:
        """int64 [1, S]: ``past_len + depth`` (node 0 sits right after the committed past)."""
        return (past_len + self.depths.astype(np.int64))[None, :]

    def attention_bias(self, past_len: int, dtype=np.float32) -> np.ndarray:
        """Additive attention bias [1, 1, S, past_len + S].

        0 where node i may attend (every committed past column, and its ancestors including
        itself), ``np.finfo(dtype).min`` elsewhere.
        """
        s = self.num_nodes
        bias = np.zeros((1, 1, s, past_len + s), dtype=dtype)
        bias[0, 0, :, past_len:][~self._ancestors] = np.finfo(dtype).min
        return bias

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive."""
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be in [0, {self.num_nodes}), got {node}")
        return np.flatnonzero(self._ancestors[node]).tolist()


def topological_order(parents_any_order) -> tuple[np.ndarray, np.ndarray]:
    """Relabel an arbitrary parent list into the convention (root 0, parents before children).

    parents_any_order: [S] ints, indices into the same list, exactly one -1 (the root).
    Returns ``(order, new_parents)``: ``order[new] = old`` index (int64 [S]) and the parents in
    new labels (int32 [S]). Among the nodes ready at each step the smallest old index goes
    first, so siblings keep their relative order and an already-valid list is unchanged.
    """
    old = np.asarray(parents_any_order)
    if old.ndim != 1 or old.shape[0] == 0 or old.dtype.kind not in "iu":
        raise ValueError(f"parents must be a non-empty 1-D integer array, got {old!r}")
    s = old.shape[0]
    roots = np.flatnonzero(old == -1)
    if roots.size != 1:
        raise ValueError(f"need exactly one root (parent -1), got {roots.size}")
    bad = np.flatnonzero(((old < 0) & (old != -1)) | (old >= s) | (old == np.arange(s)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"parents[{i}] = {old[i]} is not a node index in [0, {s}) or is a self-loop"
        )
    kids: list[list[int]] = [[] for _ in range(s)]
    for i, par in enumerate(old.tolist()):
        if par >= 0:
            kids[par].append(i)
    order: list[int] = []
    ready = [int(roots[0])]
    while ready:
        n = heapq.heappop(ready)
        order.append(n)
        for c in kids[n]:
            heapq.heappush(ready, c)
    if len(order) != s:
        raise ValueError("parents contain a cycle: some nodes are not reachable from the root")
    new_label = np.empty(s, dtype=np.int64)
    new_label[order] = np.arange(s)
    order_arr = np.asarray(order, dtype=np.int64)
    new_parents = np.where(old[order_arr] < 0, -1, new_label[old[order_arr]]).astype(np.int32)
    return order_arr, new_parents


def verify_greedy_tree(
    tokens: np.ndarray, parents: np.ndarray, target_argmax: np.ndarray
) -> tuple[list[int], int]:
    """Greedy tree verification: follow the target argmax down the tree from the root.

    tokens: [S] ints (tokens[0], the root, is not checked); parents: [S] in the convention;
    target_argmax: [S] ints, argmax of each logits row. At node n move to the first child
    (index order) whose token equals ``target_argmax[n]``; stop when there is none.
    Returns ``(accepted_nodes, next_token)``: the path starting with 0, and the target argmax
    at its last node (a correction, or the bonus token when a leaf is reached).
    """
    parents = _check_parents(parents)
    tokens = np.asarray(tokens)
    target_argmax = np.asarray(target_argmax)
    s = parents.shape[0]
    assert tokens.shape == (s,) and target_argmax.shape == (s,), (tokens.shape, target_argmax.shape)
    kids = _children(parents)
    tok, top = tokens.tolist(), target_argmax.tolist()
    path = [0]
    n = 0
    while True:
        nxt = next((c for c in kids[n] if tok[c] == top[n]), None)
        if nxt is None:
            return path, int(top[n])
        path.append(nxt)
        n = nxt


def verify_sampling_tree(
    tokens: np.ndarray,
    parents: np.ndarray,
    p: np.ndarray,
    q: np.ndarray | None,
    rng: np.random.Generator,
    replacement: bool = False,
) -> tuple[list[int], int]:
    """Lossless multi-draft verification by recursive rejection sampling over a token tree.

    tokens: [S] ints (tokens[0] is the root); parents: [S] in the convention; p: [S, V] target
    probabilities (row n: the child of node n); q: [S, V] drafter probabilities (row n: the
    distribution node n's children were drafted from), or None for deterministic children.

    Walk from the root. At node n with children c1..cm (index order), start from
    ``p_cur = p[n]``, ``q_cur = q[n]`` and for each child c with token x:

    - accept c with probability ``min(1, p_cur[x] / q_cur[x])`` and descend into it;
    - on rejection ``p_cur <- normalize(max(0, p_cur - q_cur))``, and when siblings were drawn
      without replacement (``replacement=False``) also ``q_cur <- normalize(q_cur with x
      zeroed)``, the next sibling's true drafting distribution.

    If every child is rejected (or n is a leaf) the next token is drawn from ``p_cur`` (a
    recovered token; at a leaf, the bonus token from ``p[n]``).

    References: i.i.d. siblings (``replacement=True``) -- SpecInfer's multi-step speculative
    sampling (Miao et al. 2024, arXiv:2305.09781); siblings without replacement -- recursive
    rejection sampling of Recursive Speculative Decoding (Jeon et al. 2024, arXiv:2402.14160);
    multi-draft verification as optimal transport -- SpecTr (Sun et al. 2023, arXiv:2310.15141).
    A single child per node reduces to :func:`kernels.verify.verify_sampling` and consumes
    the same rng draws.

    ``q is None`` (lookup / token-recycling trees): children are point masses. Sample
    ``y ~ p[n]``; move to the first child carrying y, else y is the next token. This is the
    rule above with ``q_cur = onehot(x)``: a rejected x leaves ``p_cur`` = p without x, so a
    later sibling carrying the same x has ``p_cur[x] = 0`` and is rejected -- duplicate
    siblings act as one.

    Returns ``(accepted_nodes, next_token)``; accepted_nodes starts with 0.
    """
    parents = _check_parents(parents)
    tokens = np.asarray(tokens)
    p = np.asarray(p)
    s = parents.shape[0]
    assert tokens.shape == (s,) and p.ndim == 2 and p.shape[0] == s, (tokens.shape, p.shape)
    if q is not None:
        q = np.asarray(q)
        assert q.shape == p.shape, (q.shape, p.shape)
    kids = _children(parents)
    tok = tokens.tolist()
    path = [0]
    n = 0
    while kids[n]:
        if q is None:
            y = sample_from(p[n], rng)
            nxt = next((c for c in kids[n] if tok[c] == y), None)
            if nxt is None:
                return path, y
        else:
            nxt, p_cur = _choose_child(kids[n], tok, p[n], q[n], rng, replacement)
            if nxt is None:
                return path, sample_from(p_cur, rng)
        path.append(nxt)
        n = nxt
    return path, sample_from(p[n], rng)


def _choose_child(children, tok, p_n, q_n, rng, replacement):
    """Recursive rejection sampling among one node's children.

    Returns ``(accepted child or None, p_cur)``; p_n, q_n: [V].
    """
    p_cur = p_n
    q_cur = q_n
    for c in children:
        x = tok[c]
        qx = q_cur[x]
        u = rng.random()
        if qx > 0 and u * qx < p_cur[x]:
            return c, p_cur
        p_cur = recovered_distribution(p_cur, q_cur)
        if not replacement and qx > 0:
            q_cur = q_cur.copy()
            q_cur[x] = 0.0
            rest = q_cur.sum()
            if rest > 0:
                q_cur /= rest
    return None, p_cur


def kv_gather_indices(accepted_nodes, past_len: int) -> np.ndarray:
    """Cache slots to keep after a tree verify: ``past_len + accepted_nodes`` (int64 [n]).

    The KV cache moves slot ``past_len + accepted_nodes[j]`` to slot ``past_len + j``.
    """
    nodes = np.asarray(accepted_nodes, dtype=np.int64)
    assert nodes.ndim == 1 and nodes.size >= 1 and nodes[0] == 0, nodes
    assert np.all(np.diff(nodes) > 0), "accepted nodes must be a root-to-node path"
    return past_len + nodes
