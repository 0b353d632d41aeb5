"""export/pipeline.py: the measurements an export records in its manifest: the target's and each drafter's call
times per width, at one context and at a long one when the graph has room, as the planner reads them; and the
calibration text smoothing was measured on."""
from __future__ import annotations

import pytest

from conftest import VOCAB, tiny_export_options


def test_latency_stats_are_consistent(exported_llama):
    """The target's latency_ms_s1 is its one-row entry of latency_ms_by_s, and a drafter's latency_vs_target is
    its one-row latency over the target's one-row latency."""
    _, m = exported_llama
    t = m.target.stats
    assert t["latency_ms_s1"] == t["latency_ms_by_s"][0]
    h = 0.0005 + 1e-9  # every recorded latency and ratio is rounded to 3 decimals
    for g in m.drafters:
        d, tt = g.stats["latency_ms_s1"], t["latency_ms_s1"]
        lo, hi = (d - h) / (tt + h) - h, (d + h) / (tt - h) + h
        assert lo <= g.stats["latency_vs_target"] <= hi, (g.stats, t)


def test_smoothing_stat_counts_the_calibration_prompts(tmp_path, tiny_llama_dir):
    """The maxima come from the calibration prompts (all but the held-out ones): that is the count recorded."""
    from export import calibration
    from export.pipeline import export_model

    m = export_model(tiny_llama_dir, tmp_path / "out",
                     tiny_export_options(precision="w8a8", drafters=(), parity=False), progress=False)
    assert m.target.stats["smoothing"]["prompts"] == len(calibration.PROMPTS) - calibration.HELD_OUT


@pytest.mark.parametrize("max_len,long_past", [(300, 292), (40, None)])
def test_target_latency_is_timed_at_a_long_context_when_the_graph_has_room(tmp_path, tiny_llama_dir, monkeypatch,
                                                                          max_len, long_past):
    """The export times the target the engine's way at S = 1..8 over 128 cached tokens (fewer when --max-len leaves
    no room) and over up to 1,024 when the graph holds at least twice that first context; the manifest records
    both, and the planner prices contexts between them from it without a calibration. Each drafter graph is timed
    the same way over the first context, and the planner prices it from that rather than its numpy-fed figure."""
    import edge.measure
    from export.pipeline import VERIFY_SIZES, export_model
    from memory.planner import Latency

    timed = []
    real = edge.measure.call_latency

    def spy(session, sizes, context, reps, prog=None):
        timed.append((list(sizes), context, session.cache.capacity, session.vocab))
        return real(session, sizes, context, 1, prog)

    monkeypatch.setattr(edge.measure, "call_latency", spy)
    m = export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(max_len=max_len, distill=False,
                                                                         parity=False), progress=False)
    t, (d,) = m.target.stats, m.drafters
    past, sizes = min(128, max_len - VERIFY_SIZES), list(range(1, VERIFY_SIZES + 1))
    lat = Latency.from_calibration(m)
    if long_past:
        cap = long_past + VERIFY_SIZES
        assert timed == [(sizes, past, cap, VOCAB), (sizes, long_past, cap, VOCAB),
                         (sizes, past, past + VERIFY_SIZES, d.vocab)]
        assert [c for c, _ in t["latency_ms_by_s_at"]] == [past, long_past]
        assert all(len(by_s) == VERIFY_SIZES and all(x > 0 for x in by_s) for _, by_s in t["latency_ms_by_s_at"])
        assert lat.context == past and [c for c, _ in lat.target_at] == [long_past]
        assert lat.target(1) == t["latency_ms_by_s_at"][0][1][0]
        (c, by_s), = d.stats["latency_ms_by_s_at"]
        assert c == past and len(by_s) == VERIFY_SIZES and all(x > 0 for x in by_s)
        assert [lat.drafters[d.name](s) for s in sizes] == pytest.approx(by_s, rel=1e-12)
        assert m.parity["min_call"] == 1  # the target session's probe (fp32 graph with its pad row)
    else:
        assert timed == [] and "latency_ms_by_s_at" not in t and lat.target_at == ()
        assert "latency_ms_by_s_at" not in d.stats and lat.drafters[d.name](1) == d.stats["latency_ms_s1"]
        assert "min_call" not in m.parity
