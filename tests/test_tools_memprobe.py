"""edge.tools.memprobe (edge/tools/memprobe.py): filler text cut to exactly n tokens, one measurement sized to its
run and reporting its own peak, and the JSON it takes from argv or stdin."""
from __future__ import annotations

import io
import json
import sys
from types import SimpleNamespace

import pytest

from edge.tools import memprobe


class SeamCodec:
    """Characters are tokens, except that "ca" is one: "abc" repeated merges at every seam, as BPE does."""
    bos = None

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            n = 2 if text[i:i + 2] == "ca" else 1
            out.append(text[i:i + n])
            i += n
        return out

    def decode(self, ids):
        return "".join(ids)


@pytest.mark.parametrize("n", [1, 2, 10, 31])
def test_filler_text_refines_the_cut_until_it_encodes_to_n_tokens(n):
    codec = SeamCodec()
    text = memprobe.filler_text(codec, n, "abc")  # the first cut of n tokens re-encodes to about 2n/3
    assert len(codec.encode(text)) == n, text


def test_filler_text_of_an_empty_unit_repeats_the_bos_token():
    codec = SimpleNamespace(bos=None, encode=lambda t: list(t), decode=lambda ids: "".join(map(str, ids)))
    assert memprobe.filler_text(codec, 3, "") == "000"


def test_measure_sizes_the_cache_to_the_run_and_reports_its_own_peak_in_mib(tiny_dir, monkeypatch):
    units = []
    real_filler = memprobe.filler_text

    def filler(codec, n, unit):
        units.append(unit)
        return real_filler(codec, n, unit)

    monkeypatch.setattr(memprobe, "filler_text", filler)
    monkeypatch.setattr(memprobe, "peak_rss_bytes", lambda children=False: (999 if children else 300) * 2**20)
    r = memprobe.measure(str(tiny_dir), context=40, k=4, decode=6, text="x" * 9000)
    assert (r["drafter"], r["decode"], r["capacity"]) == ("lookup", 10, 40 + 10 + 5 + 8)
    assert r["peak_rss_mb"] == 300.0  # this process's own peak, MB of 2**20 bytes
    assert units == ["x" * (8 * 40 + 4096)]
    assert abs(r["prompt_tokens"] - 40) <= 2 and r["widest_call"] <= 5
    r = memprobe.measure(str(tiny_dir), context=40, k=0, decode=6)
    assert (r["drafter"], r["decode"], r["capacity"], r["drafted"]) == ("none", 6, 40 + 6 + 1 + 8, 0)


def test_memprobe_main_takes_the_json_from_argv_or_stdin(monkeypatch, capsys):
    monkeypatch.setattr(memprobe, "measure", lambda **kw: {"got": kw})
    assert memprobe.main(['{"model_dir": "m", "context": 8, "k": 2}']) == 0
    assert json.loads(capsys.readouterr().out) == {"got": {"model_dir": "m", "context": 8, "k": 2}}
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"model_dir": "s", "context": 9, "k": 0}'))
    assert memprobe.main([]) == 0
    assert json.loads(capsys.readouterr().out) == {"got": {"model_dir": "s", "context": 9, "k": 0}}


def test_replay_answers_each_prompt_reps_times_in_its_own_engine(tiny_dir, tmp_path, monkeypatch):
    """A workload replayed as edge-bench feeds it: every item's first turn, `reps` times, grouped by category;
    a prompt longer than the context is skipped, not fatal; the engine keeps its drafter state across requests."""
    prompts = tmp_path / "w.jsonl"
    rows = [{"id": "a", "category": "qa", "turns": ["the quick brown fox", "a second turn, never sent"]},
            {"id": "b", "category": "code", "turns": ["def add(a, b):"]},
            {"id": "long", "category": "qa", "turns": ["word " * 400]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    asked = []
    from edge.engine import Engine
    real = Engine.chat

    def chat(self, *a, **kw):
        c = real(self, *a, **kw)
        ask = c.ask
        c.ask = lambda text, **k: (asked.append(text), ask(text, **k))[1]
        return c

    monkeypatch.setattr(Engine, "chat", chat)
    monkeypatch.setattr(memprobe, "peak_rss_bytes", lambda children=False: 300 * 2**20)
    r = memprobe.replay(str(tiny_dir), str(prompts), context=128, reps=2, max_tokens=4, drafter="hybrid")
    assert (r["requests"], r["skipped"], r["drafter"]) == (4, 2, "hybrid")
    assert asked == ["def add(a, b):"] * 2 + ["the quick brown fox"] * 2  # code before qa, as edge-bench orders
    assert r["peak_rss_mb"] == 300.0


def test_memprobe_main_replays_a_prompt_file(monkeypatch, capsys):
    monkeypatch.setattr(memprobe, "replay", lambda **kw: {"replayed": kw})
    assert memprobe.main(['{"model_dir": "m", "prompts": "p.jsonl", "reps": 2}']) == 0
    assert json.loads(capsys.readouterr().out) == {"replayed": {"model_dir": "m", "prompts": "p.jsonl", "reps": 2}}
