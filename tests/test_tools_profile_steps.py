"""edge-profile's steps one by one on fakes (edge/tools/profile.py): latency widths and contexts, prompt selection,
the speed sweep and its ratios, the acceptance counters, the flag lists and the sections a run keeps, the engine and
memory room main() sizes, and the budget chat's readings. The CLI end to end is in test_tools_profile.py."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from edge.tools import profile


def _items(*ids):
    return [{"id": i, "category": "qa", "turns": [i]} for i in ids]


class _Cache:
    def __init__(self, capacity):
        self.length, self.capacity = 0, capacity

    def trim(self, n):
        self.length -= n

    def room(self):
        return self.capacity - self.length


class _Session:
    def __init__(self, capacity):
        self.cache, self.calls = _Cache(capacity), []

    def prefill(self, ids):
        self.cache.length += len(ids)

    def forward(self, toks):
        self.calls.append(len(toks))


def test_call_latency_measures_widths_up_to_the_first_that_does_not_fit():
    s = _Session(64)
    assert [w for w, _ in profile.call_latency(s, [1, 56, 57, 2], context=8, reps=1)] == [1, 56]  # 56 + 8 = 64
    assert s.calls == [1, 56, 1, 56] and s.cache.length == 0
    assert profile.sizes_at([1, 2, 4, 8], 12, 16) == [1, 2, 4]  # 4 + 12 fills the 16 slots exactly


def test_measure_latency_drafters_at_the_first_context_and_target_at_the_rest(monkeypatch):
    import edge.runner

    seen = []

    def call_latency(session, sizes, context, reps, prog=None):
        seen.append((session, list(sizes), context))
        return [[s, 1.0] for s in sizes]

    monkeypatch.setattr(profile, "call_latency", call_latency)
    monkeypatch.setattr(edge.runner, "GraphSession", lambda path, m, g, *a: g.name)
    g = SimpleNamespace(name="ee1", file="ee1.onnx")
    e = SimpleNamespace(manifest=SimpleNamespace(drafters=[g]), target="target", context=20, model_dir=Path("."),
                        threads=1, providers=None)
    lat = profile.measure_latency(e, [1, 4, 8], [12, 16], 1, None)
    assert seen == [("target", [1, 4, 8], 12), ("target", [1, 4], 16), ("ee1", [1, 4, 8], 12)]
    assert lat["context"] == 12 and lat["target_at"] == [[16, [[1, 1.0], [4, 1.0]]]]
    seen.clear()
    assert "target_at" not in profile.measure_latency(e, [1], [12], 1, None)  # one context: no extra curves


def test_prompt_selection_per_category_and_round_robin(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": i, "category": c, "turns": ["x"]}) + "\n"
                         for i, c in enumerate(["qa", "qa", "qa", "code", "code"])))
    assert [it["id"] for it in profile.load_prompts(str(f), 1)] == [0, 3]
    assert [it["id"] for it in profile.load_prompts(str(f), 2)] == [0, 1, 3, 4]
    assert [it["id"] for it in profile.round_robin(profile.load_prompts(str(f), 0))] == [0, 3, 1, 4, 2]


def test_speed_ratios_are_block_medians_and_the_fallback_is_the_fastest_at_the_top_k():
    res = profile.summarize_speed({"none": [10.0, 10.0, 10.0], "plan": [10.0, 20.0, 60.0]})
    assert res["plan"] == {"tok_s": 20.0, "ratio_vs_none": 2.0, "runs": [10.0, 20.0, 60.0]}
    pair = {"0": {"context": 256, "peak_rss_mb": 200.0}, "4": {"peak_rss_mb": 202.0}, "64": {"peak_rss_mb": 220.0}}
    speed = {"plan": {"drafter": "model"}, "results": {"plan": {"ratio_vs_none": 1.5},
                                                        "chain:lookup:64": {"ratio_vs_none": 1.0},
                                                        "chain:recycling:64": {"ratio_vs_none": 2.0}}}
    assert profile.specmemo_pair(pair, 4, 64, speed)["throughput_kept_pct"] == 75.0  # of the fastest at K=64


def test_speed_sweep_rotates_configs_per_prompt_and_only_plan_runs_under_the_plan():
    calls = []

    class E:
        plan = None

        def drafter_state(self):
            return None

        def set_drafter_state(self, s):
            pass

        def generate(self, prompt, max_tokens, drafter, draft_len=None):
            calls.append((prompt, drafter, self.plan))
            return SimpleNamespace(stats=SimpleNamespace(decode_tok_s=10.0, generated=5))

    configs = [("none", "none", None), ("plan", None, None), ("chain:lookup:4", "lookup", 4)]
    plan0 = object()
    profile.speed_sweep(E(), _items("a", "b"), configs, 2, 8, plan0, None)
    calls = calls[1:]  # the warm-up
    order = [[d for _, d, _ in calls[3 * b:3 * b + 3]] for b in range(4)]
    assert order == [["none", None, "lookup"], [None, "lookup", "none"], [None, "lookup", "none"],
                     ["lookup", "none", None]]  # rep 0: a, b; rep 1: a, b
    assert all((p is plan0) == (d is None) for _, d, p in calls)


def test_a_one_token_answer_has_no_speed_in_the_sweep():
    """A run that answered one token has no decode speed: the engine reports 0.0 for it, which the sweep counted in
    its medians and ratios (edge-bench leaves such runs out); a config without any speed is None, not a crash."""
    res = profile.summarize_speed({"none": [10.0, 10.0, None], "plan": [None, 20.0, 60.0], "x": [None, None, None]})
    assert res["plan"] == {"tok_s": 40.0, "ratio_vs_none": 2.0, "runs": [None, 20.0, 60.0]}
    assert res["none"]["tok_s"] == 10.0 and res["x"] == {"tok_s": None, "ratio_vs_none": None, "runs": [None] * 3}

    class R:
        def __init__(self, n):
            self.stats = SimpleNamespace(generated=n, decode_tok_s=0.0 if n < 2 else 50.0)

    class E:
        plan = None
        answers = iter([1, 5, 1, 5])  # a: none, plan; b: plan, none (rotated): one token in a's none, b's plan

        def drafter_state(self):
            return None

        def set_drafter_state(self, s):
            pass

        def generate(self, *a, max_tokens=0, **k):
            return R(5) if max_tokens == 8 else R(next(self.answers))

    out = profile.speed_sweep(E(), _items("a", "b"), [("none", "none", None), ("plan", None, None)], 1, 16, None, None)
    assert out["none"]["runs"] == [None, 50.0] and out["plan"]["runs"] == [50.0, None]
    assert out["plan"]["tok_s"] == 50.0 and out["plan"]["ratio_vs_none"] is None  # no block has both speeds
    speed = {"plan": {"drafter": "lookup"}, "results": {"plan": {"ratio_vs_none": None},
                                                         "chain:lookup:64": {"ratio_vs_none": None}}}
    pair = {"0": {"context": 256, "peak_rss_mb": 200.0}, "4": {"peak_rss_mb": 202.0}, "64": {"peak_rss_mb": 220.0}}
    assert "throughput_kept_pct" not in profile.specmemo_pair(pair, 4, 64, speed)


def test_measure_acceptance_caps_draft_rate_hands_beta_back_and_carries_learning_over():
    class Chat:
        def __init__(self, e):
            self.e = e

        def ask(self, turn, max_tokens, drafter, draft_len):
            self.e.seen.append((turn, drafter, draft_len, self.e.learned))
            self.e.learned = self.e.learned + (turn,)
            if drafter == "model":  # 0.2 accepted per step, below what any K=4 draft is expected to keep
                return SimpleNamespace(stats=SimpleNamespace(steps=10, accepted=2, drafted=40,
                                                             overhead_ms_per_step=0.5))
            return SimpleNamespace(stats=SimpleNamespace(steps=2, accepted=30, drafted=32, overhead_ms_per_step=0.5))

    class E:
        def __init__(self):
            self.manifest = SimpleNamespace(drafters=[])
            self.target = SimpleNamespace(topk=True, tree_exact=True)
            self.acceptance, self.learned, self.seen = {}, (), []
            self.policy = self  # what edge-profile reads of the draft-length policy

        def drafter_state(self):
            return self.learned

        def set_drafter_state(self, s):
            self.learned, self.acceptance = s, {}

        def chat(self):
            return Chat(self)

    e = E()
    assert profile.chain_kinds(e) == ["lookup"]  # trees verified exactly: recycling fills trees, left to priors
    e.target.tree_exact = False
    assert profile.chain_kinds(e) == ["lookup", "recycling", "hybrid"]
    e.target.tree_exact = True
    out, counters = profile.measure_acceptance(e, _items("p0", "p1"), 16, 4, 8, None)
    assert out["lookup"]["draft_rate"] == 1.0 and counters["lookup"]["draft_rate"] == 1.0  # 15/step: capped
    assert out["lookup"]["beta"] == 0.1
    assert e.seen == [("p0", "lookup", 16, ()), ("p1", "lookup", 16, ("p0",))]  # p1 drafts from what p0 taught
    from memory.acceptance import AcceptanceStats
    from memory.planner import DEFAULT_PRIORS

    e = E()
    e.manifest.drafters = ["ee1"]
    out, counters = profile.measure_acceptance(e, _items("p0"), 16, 4, 8, None)
    assert [(d, k) for _, d, k, _ in e.seen] == [("lookup", 16), ("model", 4)]
    prior = DEFAULT_PRIORS.get("model", (0.3, 1.0))[0]  # the prior measure_acceptance starts the model from
    given = AcceptanceStats(prior, beta=1e-3, prior_weight=1.0).expected_accepted(4)
    assert 0.2 / given < 1 and out["model"]["draft_rate"] == pytest.approx(0.2 / given)  # from the K it drafted


def test_flag_lists_steps_and_earlier_sections(tmp_path):
    with pytest.raises(argparse.ArgumentTypeError):
        profile._int_list(1)(" , ")
    with pytest.raises(argparse.ArgumentTypeError):
        profile._drafter_list(",")
    assert profile._running_step(["acceptance", "speed"], {}) == "acceptance"
    assert profile._running_step(["acceptance"], {"acceptance": 1.0}) == "last"
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps({"device_class": "cpu", "source": "t", "model": {"name": "x"},
                             "latency": {"target": [[1, 10.0], [4, 11.0]]}, "memory": {"baseline_mb": 90.0}}))
    # the sections this run re-measures are its own; the others are kept, from the same export only
    assert set(profile._earlier_sections(p, {"name": "x"}, {"latency"})) == {"memory"}
    assert profile._earlier_sections(p, {"name": "y"}, set()) == {}


def test_profile_main_sizes_the_engine_for_the_latency_contexts(tmp_path, monkeypatch, capsys):
    import edge
    import edge.manifest

    from edge.engine import EngineError

    seen = {}

    def engine(model_dir, drafter, threads, context):
        seen["context"] = context
        raise EngineError("stop here")

    monkeypatch.setattr(edge, "Engine", engine)
    monkeypatch.setattr(edge.manifest, "load_manifest",
                        lambda d, verify: SimpleNamespace(target=SimpleNamespace(max_len=100000)))
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "a", "turns": ["hi"]}) + "\n")
    assert profile.main([str(f), "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--sizes", "1,16",
                         "--latency-contexts", "256,8000"]) == 2
    assert seen["context"] == 8000 + 16 + 8 and "stop here" in capsys.readouterr().err


def test_profile_main_latency_context_and_memory_room_and_the_overhead_it_writes(tiny_dir, tmp_path, monkeypatch,
                                                                              capsys):
    from edge.manifest import load_manifest

    cap = load_manifest(tiny_dir, verify="none").target.max_len
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "a", "category": "qa", "turns": ["the quick brown fox"]}) + "\n")
    got = {}

    def measure_latency(engine, sizes, contexts, reps, prog):
        got["contexts"] = contexts
        return {"target": [[1, 10.0], [2, 11.0]], "context": contexts[0], "drafters": {}}

    counters = {k: {"overhead_ms_per_step": v} for k, v in
                {"lookup": 1.0, "recycling": 2.0, "hybrid": 6.0, "model": 100.0}.items()}
    monkeypatch.setattr(profile, "measure_latency", measure_latency)
    monkeypatch.setattr(profile, "measure_acceptance", lambda *a: ({}, counters))
    out = tmp_path / "o"
    assert profile.main([str(f), "--model", str(tiny_dir), "--out", str(out), "--quiet", "--steps",
                         "latency,acceptance", "--sizes", "1", "--latency-contexts", f"{cap - 1}"]) == 0
    cal = json.loads((out / "calibration.json").read_text())
    assert got["contexts"] == [cap - 1]  # one row beside cap - 1 cached tokens fills the context exactly
    assert cal["latency"]["overhead_ms"] == 2.0  # median of the model-free drafters' overheads, not the model's

    def memory_point(model_dir, context, k, drafter, threads, text, cal=None):
        return {"context": context, "k": k, "widest_call": k + 1, "drafter": drafter, "peak_rss_mb": 100.0,
                "predicted_mb": 99.0}

    monkeypatch.setattr(profile, "memory_point", memory_point)
    room = cap - 2 * 8 - 40  # each memory run needs room for two K-token drafts beside its context
    capsys.readouterr()
    assert profile.main([str(f), "--model", str(tiny_dir), "--out", str(out), "--quiet", "--steps", "memory",
                         "--mem-ks", "0,8", "--contexts", f"{room},{room + 1}", "--specmemo-context", "0"]) == 0
    assert f"skipping --contexts [{room + 1}]" in capsys.readouterr().err
    doc = json.loads((out / "profile.json").read_text())
    assert sorted({p["context"] for p in doc["memory"]["points"]}) == [room]


def test_budget_chat_reads_each_turns_stats_and_a_peak_at_the_budget_is_within_it(tiny_dir, monkeypatch):
    import subprocess

    from edge.manifest import load_manifest

    def stats(peak, nodes):
        return json.dumps({"context_tokens": 20, "plan": {"drafter": "lookup", "nodes": nodes, "context": 128},
                           "memory_mb": {"predicted_peak": 99.5, "measured_peak_rss": peak},
                           "last_answer": {"decode_tok_s": 5.0}}, indent=1)

    calls = []

    def chat_cli(model_dir, budget, context, calibration, threads, stdin, max_tokens):
        calls.append((budget, context, stdin))
        err = f"> {stats(99.0, 4)}\n> {stats(100.0, 2)}\n" if len(calls) == 1 else "edge-chat: error: too small"
        return subprocess.CompletedProcess([], 0 if len(calls) == 1 else 2, "", err)

    monkeypatch.setattr(profile, "_chat_cli", chat_cli)
    items = [{"id": "a", "turns": ["hello  there"]}, {"id": "b", "turns": ["bye"]}]
    d = profile.budget_chat(tiny_dir, items, 3, 4096, 8, 100.0, None, 1)
    cap = load_manifest(tiny_dir, verify="none").target.max_len
    assert calls[0] == (100.0, cap, "hello there\n/stats json\nbye\n/stats json\nhello there\n/stats json\n/quit\n")
    assert d["peak_rss_mb"] == 100.0 and d["within_budget"] is True  # at the budget is within it
    assert d["nodes_by_turn"] == [4, 2] and d["turns"] == 2 and d["context"] == cap
    assert calls[1][0] == d["below_plain"]["budget_mb"] and d["below_plain"]["returncode"] == 2
