"""edge/runner.py's sessions: the load-time probes (the narrowest call that is bit-exact, exact trees), graphs with
int8 activations, and 1-token calls padded to the narrowest exact width."""
from __future__ import annotations

import numpy as np
import pytest

import edge
from edge.kv import KVCache
from edge.runner import probe_min_call


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
    single-query path) still makes greedy speculation lossy (an argmax tie flips): the probe compares bit for bit,
    and pads."""
    assert probe_min_call(_WidthSession(0)) == 1
    s = _WidthSession(1)
    assert probe_min_call(s) == 2 and s.cache.length == 0


def test_sessions_start_with_an_empty_cache_and_exact_trees(tiny_dir):
    """The load-time probes leave the target's and the drafter's caches empty, and an fp32 graph verifies trees
    exactly (Token Recycling then drafts trees): the tree probe places the sibling and masks the slot as a tree call
    does."""
    e = edge.load(tiny_dir, drafter="model", context=256)
    assert e.target.cache.length == 0 and e.target.tree_exact is True and not e.recycling.chains_only
    from edge.runner import GraphSession
    g = e.manifest.drafters[0]
    fresh = GraphSession(str(e.model_dir / g.file), e.manifest, g, 128)
    assert fresh.cache.length == 0


def test_a_graph_with_int8_activations_never_verifies_trees(tiny_dir):
    """Trees are never exact with int8 activations, even when the load-time probe happens to agree (here: the fp32
    graph described as int4 with accuracy_level 4): the manifest's int8_activations decides, not the probe alone."""
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
    is width independent, so the padded call must give the unpadded call's logits. Both kinds of call are checked: a
    causal call alone would pass even with the real row's bias opened onto the pad (GroupQueryAttention applies its
    own causal mask)."""
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


def test_a_call_width_binds_the_shape_of_each_call(tiny_dir):
    """A small call width keeps its binding's outputs bound between calls; a call of another shape on the same width
    (more candidates for sampling, fewer rows kept) binds its own, and one shaped as an earlier call finds its outputs
    again: every call returns its own rows, whatever the width's calls before it asked for."""
    from edge.manifest import load_manifest
    from edge.runner import GraphSession

    m = load_manifest(tiny_dir)
    s = GraphSession(str(tiny_dir / m.target.file), m, m.target, 128)
    s.prefill([5, 9, 11, 13, 17, 19])
    ids = [23, 29, 31]
    full = s.forward(ids).copy()  # [3, V]
    assert s.head
    for keep, sample in [(0, None), (0, (1.0, 64)), (0, None), (1, None), (0, (1.0, 64)), (1, (0.5, 16)), (0, None)]:
        rows = full if keep == 0 else full[-keep:]
        out = s.call(ids, keep=keep, logits=False, sample=sample)
        k = s.topk if sample is None else max(sample[1], s.topk)
        assert out.logits is None and out.top_ids.shape == (len(rows), k)
        assert out.top_ids[:, 0].tolist() == rows.argmax(-1).tolist() == out.best
        np.testing.assert_allclose(out.best_logits, rows.max(-1), rtol=1e-5)
        assert (out.top_probs is None) == (sample is None)


def test_sessions_stop_spinning_when_a_call_ends():
    """Target and drafter sessions take turns on the same cores: a pool still spinning after its call would take
    them from the other session's call."""
    from edge.runner import session_options

    so = session_options(2)
    assert so.get_session_config_entry("session.force_spinning_stop") == "1"
    assert so.intra_op_num_threads == 2


def test_threads_default_to_two_capped_by_the_usable_cores_and_more_than_cores_warns(monkeypatch):
    """No --threads: 2, or the cores this process may use if fewer (a 1-core container is not oversubscribed).
    Asking for more threads than cores is allowed with a warning (measured several times slower)."""
    import warnings

    import devices
    from edge.runner import DEFAULT_THREADS, check_threads

    for cores, want in ((1, 1), (2, 2), (16, DEFAULT_THREADS)):
        monkeypatch.setattr(devices, "usable_cores", lambda c=cores: c)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert check_threads(None) == want
            assert check_threads(cores) == cores
    monkeypatch.setattr(devices, "usable_cores", lambda: 2)
    with pytest.warns(RuntimeWarning, match="3 threads on the 2 cores.*--threads 2"):
        assert check_threads(3) == 3


def test_usable_cores_follow_the_affinity_mask_else_the_cpu_count(monkeypatch):
    """A container or `taskset` narrows the affinity mask below the machine's CPUs; an OS without the call (macOS)
    falls back to the CPU count."""
    import os

    from devices import usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert usable_cores() == 2
    monkeypatch.delattr(os, "sched_getaffinity")
    assert usable_cores() == 64
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cores() == 1
