"""edge.tools.soak (edge/tools/soak.py): its loop against a scripted engine (interruptions, new chats, the series it
records, the cache check), main()'s exit status and summary, the bounds it checks on the tiny export, and its flags
refused before anything runs."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from edge.tools import soak
from helpers import run_module


def test_soak_bad_flags_fail_before_running(tmp_path):
    for flags, needle in ((["--turns", "0"], "--turns"), (["--every", "0"], "--every"), (["--group", "0"], "--group"),
                          (["--drafter", "bogus"], "--drafter"), (["--max-tokens", "0"], "--max-tokens"),
                          (["--model-dir", str(tmp_path / "nope")], "no such model directory")):
        r = run_module(["edge.tools.soak", *flags], timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (flags, r.stderr)
        assert needle in r.stderr, (flags, r.stderr)


class FakeChat:
    def __init__(self, engine):
        self.engine, self.resets, self.closed_at = engine, [], []

    def send(self, q, max_tokens):
        e = self.engine
        e.turn += 1
        turn = e.turn
        e.cached += [0] * 6
        e.target.cache.length = len(e.cached) + 1  # mid-answer: a row that closing the answer rolls back
        try:
            for _ in range(3):
                yield SimpleNamespace(token_ids=[1, 2])
        except GeneratorExit:
            self.closed_at.append(turn)
            e.target.cache.length = len(e.cached)
            raise
        e.target.cache.length = len(e.cached) - (1 if turn in e.desync else 0)

    def reset(self, keep_drafter_state=False):
        self.resets.append((self.engine.turn, keep_drafter_state))


def _fake_engine(desync=()):
    e = SimpleNamespace(turn=0, cached=[], desync=set(desync), target=SimpleNamespace(cache=SimpleNamespace(length=0)),
                        manifest=SimpleNamespace(name="fake"), default_drafter="hybrid")
    e.the_chat = FakeChat(e)
    e.chat = lambda system=None: e.the_chat
    return e


@pytest.fixture
def scripted(monkeypatch):
    rss = iter(range(100, 10000))
    monkeypatch.setattr(soak, "rss_mb", lambda: float(next(rss)))
    monkeypatch.setattr(soak, "peak_rss_mb", lambda: 5000.0)
    monkeypatch.setattr(soak, "drafter_state", lambda engine: {"lookup_history": 1, "lookup_history_bound": 1})
    monkeypatch.setattr(soak, "predicted_mb", lambda engine: {"peak_mb": 4999.9})


def test_soak_loop_interrupts_resets_and_records_as_documented(scripted):
    e = _fake_engine(desync=[7])
    r = soak.soak(e, 23, group=10, interrupt_every=4, every=5, marks=(1, 100, 500))
    assert e.the_chat.closed_at == [4, 8, 12, 16, 20] and r["interrupted_turns"] == 5
    assert r["generated_tokens"] == 18 * 6 + 5 * 2  # an interrupted answer counts the chunk it gave
    assert e.the_chat.resets == [(10, True), (20, True)]  # new chats, the drafter state kept
    assert [row["turn"] for row in r["series"]] == [1, 5, 10, 15, 20, 23]
    assert r["rss_mb_at"] == {"1": 100.0} and r["rss_mb_last"] == 105.0 and r["rss_growth_mb"] == 5.0
    assert r["peak_rss_mb"] == 5000.0 and r["within_prediction"] is False  # the peak, not the RSS now
    assert r["errors"] == ["turn 7: KV cache holds 41 tokens, engine thinks 42"]


def test_soak_main_exits_1_on_errors_and_prints_the_summary_without_the_series(monkeypatch, tmp_path, capsys):
    import edge

    monkeypatch.setattr(edge, "load", lambda *a, **k: "engine")
    for errors, rc in (([], 0), (["turn 3: beyond bounds: ['x']"], 1)):
        rep = {"turns": 3, "errors": errors, "series": [{"turn": 1}]}
        monkeypatch.setattr(soak, "soak", lambda *a, **k: rep)
        out = tmp_path / "s.json"
        assert soak.main(["--turns", "3", "--json", str(out)]) == rc
        assert json.loads(out.read_text()) == rep
        assert json.loads(capsys.readouterr().out) == {"turns": 3, "errors": errors}


def test_soak_bounds_hold_every_template_budget_and_the_prediction_leaves_room_for_a_call(tiny_dir):
    import edge
    from edge.engine import MAX_DRAFT_LEN

    e = edge.load(tiny_dir, drafter="none", context=256)
    for nodes in range(MAX_DRAFT_LEN + 1):  # one template per draft budget 0..64 is within the bound
        e.recycling.template(nodes)
    state = soak.drafter_state(e)
    assert state["recycling_templates"] == MAX_DRAFT_LEN + 1 and soak.within_bounds(state) == []
    assert soak.within_bounds({**state, "recycling_templates": MAX_DRAFT_LEN + 2}) == ["recycling_templates"]
    assert soak.within_bounds({**state, "lookup_history": state["lookup_history_bound"]}) == []
    pred = soak.predicted_mb(e)
    assert pred["context"] < e.context and pred["peak_mb"] >= pred["plain_peak_mb"] > 0
