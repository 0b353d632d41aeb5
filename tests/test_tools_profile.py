"""edge-profile and the calibration it writes, on the session's tiny export: the CLI end to end with tiny settings
(valid JSON, PNGs, one memory process per point), the planner reading a calibration and choosing differently
because of it, re-planning that shrinks K as a chat's context grows, /stats, clear errors, and the PNG writer."""
from __future__ import annotations

import json
from pathlib import Path
import os
import re
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

import edge
from edge import EngineError
from edge.planning import CalibrationError, load_calibration, make_plan, profile_for
from edge.tools.pngplot import plot_png
from edge.tools.profile import fit_baseline, planner_vs_sweep, specmemo_pair, summarize_speed, validation_table
from helpers import run_module
from memory import AcceptanceStats, Calibration, predict_peak

PROMPTS = [{"id": "a", "category": "qa", "turns": ["the quick brown fox jumps over the lazy dog"]},
           {"id": "b", "category": "code", "turns": ["def add(a, b):\n    return a + b\n"]}]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    p.write_text("".join(json.dumps(it) + "\n" for it in PROMPTS))
    return p


def calibration(tmp_path, accept: float, name: str = "cal.json", baseline_mb: float | None = None):
    """A calibration whose verify calls cost the same at any width: every drafter accepted at rate `accept`."""
    st = AcceptanceStats(accept, draft_rate=1.0).to_dict()
    cal = {"device_class": "cpu", "source": "test",
           "latency": {"target": [[1, 10.0], [128, 10.5]], "lookup_ms": 0.01, "recycling_ms": 0.01},
           "acceptance": {k: st for k in ("lookup", "recycling", "hybrid", "model")}}
    if baseline_mb is not None:
        cal["memory"] = {"baseline_mb": baseline_mb}
    p = tmp_path / name
    p.write_text(json.dumps(cal))
    return p


# ------------------------------------------------------------------------------------------- edge-profile
def test_edge_profile_end_to_end_writes_calibration_json_and_pngs(tiny_dir, prompts, tmp_path):
    out = tmp_path / "prof"
    r = run_module(["edge.tools.profile", str(prompts), "--model", str(tiny_dir), "--out", str(out),
                    "--sizes", "1,2,4", "--latency-reps", "1", "--latency-contexts", "16",
                    "--prompts-per-category", "1", "--max-tokens", "8", "--accept-k", "4", "--sweep-ks", "1,4",
                    "--sweep-drafters", "lookup", "--sweep-prompts", "1", "--reps", "1", "--contexts", "24,96",
                    "--mem-ks", "0,4", "--specmemo-context", "24", "--quiet"])
    assert r.returncode == 0, r.stderr[-3000:]
    cal = load_calibration(out / "calibration.json")  # valid as the planner reads it
    assert {"latency", "acceptance", "memory", "source"} <= set(cal)
    assert [s for s, _ in cal["latency"]["target"]] == [1, 2, 4] and all(ms > 0 for _, ms in cal["latency"]["target"])
    assert "lookup" in cal["acceptance"] and "model" in cal["acceptance"]
    doc = json.loads((out / "profile.json").read_text())
    pts = doc["memory"]["points"]
    assert [(p["context"], p["k"]) for p in pts] == [(24, 0), (24, 4), (96, 0), (96, 4)]
    for p in pts:  # one process per point: each measured its own peak next to the model's prediction
        assert 10 < p["peak_rss_mb"] < 2000 and p["predicted_mb"] > 0 and p["prompt_tokens"] >= p["context"] - 8
    assert cal["memory"]["baseline_mb"] == fit_baseline(pts, Calibration().baseline_mb)
    assert set(doc["speed"]["results"]) == {"none", "plan", "unmanaged", "chain:lookup:1", "chain:lookup:4"}
    assert doc["specmemo"]["planner_k"] >= 1 and "plain_peak_mb" in doc["specmemo"]
    for name in ("memory_vs_context.png", "predicted_vs_measured.png", "tokens_per_s_vs_k.png"):
        assert name in doc["plots"] and (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| context |" in r.stdout


def test_edge_profile_missing_prompt_file_is_one_clear_line(tmp_path):
    r = run_module(["edge.tools.profile", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "nope.jsonl not found" in r.stderr


@pytest.mark.parametrize("flags", [["--sizes", "x"], ["--sweep-ks", "x"], ["--contexts", "1k"], ["--sizes", "0"],
                                   ["--sizes", "-3"], ["--latency-reps", "0"], ["--mem-ks", "-1"], ["--reps", "0"]])
def test_edge_profile_bad_numbers_are_argument_errors(prompts, tmp_path, flags):
    r = run_module(["edge.tools.profile", str(prompts), "--out", str(tmp_path / "o"), *flags])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert flags[0] in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("flags", [
    ["--steps", "speed", "--budget-mb", "-5"], ["--steps", "speed", "--sweep-drafters", "foo"],
    ["--steps", "speed", "--sweep-prompts", "0"], ["--steps", "memory", "--mem-ks", "4", "--mem-drafter", "foo"],
    ["--steps", "chat", "--chat-turns", "0"], ["--steps", "acceptance", "--accept-k", "-3"],
    ["--steps", "acceptance", "--accept-k", "0"], ["--steps", "acceptance", "--accept-k", "65"],
    ["--steps", "acceptance", "--accept-k-model", "65"], ["--steps", "speed", "--sweep-ks", "1,65"],
    ["--steps", "memory", "--mem-ks", "0,65"], ["--steps", "latency", "--sizes", "1,5000"]])
def test_edge_profile_bad_values_are_refused_before_the_model_loads(tiny_dir, prompts, tmp_path, flags):
    """Not minutes into the run, by the step that uses them: argparse's exit 2 naming the flag, nothing written."""
    r = run_module(["edge.tools.profile", str(prompts), "--model", str(tiny_dir), "--out", str(tmp_path / "o"),
                    "--quiet", "--sizes", "1,2", "--latency-reps", "1", "--max-tokens", "4", "--reps", "1",
                    "--sweep-ks", "1", "--contexts", "24", "--specmemo-context", "0", "--chat-context", "64",
                    "--chat-max-tokens", "4", *flags])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"argument {flags[-2]}" in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("stop,rc,said", [(KeyboardInterrupt(), 130, "interrupted during the acceptance step"),
                                          (EngineError("drafter broke"), 1, "error: drafter broke (in the acceptance")])
def test_edge_profile_cut_short_writes_this_runs_steps_and_installs_nothing(tiny_dir, prompts, tmp_path, monkeypatch,
                                                                            capsys, stop, rc, said):
    """Ctrl-C or an engine error in a step: calibration.json and profile.json hold this run's finished steps (not a
    previous run's calibration) and say the run was cut short; --install installs nothing; the exit code says so."""
    from edge.tools import profile
    from edge.planning import default_calibration_path

    def cut(*a, **k):
        raise stop
    monkeypatch.setattr(profile, "measure_acceptance", cut)
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    for earlier in (False, True):  # no calibration.json yet, then a previous run's
        out = tmp_path / f"prof-{earlier}"
        if earlier:
            out.mkdir()
            (out / "calibration.json").write_bytes(calibration(tmp_path, 0.9).read_bytes())
        assert profile.main([str(prompts), "--model", str(tiny_dir), "--out", str(out), "--steps", "latency,acceptance",
                             "--sizes", "1,2", "--latency-reps", "1", "--latency-contexts", "16", "--install",
                             "--quiet"]) == rc
        err = capsys.readouterr().err
        assert said in err and "not installed" in err, err
        cal = load_calibration(out / "calibration.json")
        assert [s for s, _ in cal["latency"]["target"]] == [1, 2] and "acceptance" not in cal
        assert "acceptance step" in cal["source"]
        doc = json.loads((out / "profile.json").read_text())
        assert doc["stopped"]["step"] == "acceptance" and "latency" in doc
        assert not default_calibration_path(tiny_dir).exists()


@pytest.mark.parametrize("flags,said", [
    (["--steps", ""], "names no step"), (["--steps", " , "], "names no step"),
    (["--steps", "memory", "--contexts", "100000"], "no --contexts value fits")])
def test_edge_profile_runs_that_would_measure_nothing_are_refused(tiny_dir, prompts, tmp_path, flags, said):
    """They exited 0 having done nothing, or failed mid-run with "max() arg is an empty sequence"."""
    r = run_module(["edge.tools.profile", str(prompts), "--model", str(tiny_dir), "--out", str(tmp_path / "o"),
                    "--quiet", "--specmemo-context", "0", *flags])
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o" / "calibration.json").exists()


def test_edge_profile_a_run_of_some_steps_keeps_the_other_sections(tiny_dir, prompts, tmp_path, capsys):
    """Re-measuring latency alone kept no acceptance, and acceptance alone no latency: the planner silently fell
    back to its defaults for the rest. Sections of another export are not kept."""
    from edge.tools import profile

    out = tmp_path / "prof"
    small = ["--model", str(tiny_dir), "--out", str(out), "--quiet", "--sizes", "1,2", "--latency-reps", "1",
             "--latency-contexts", "16", "--max-tokens", "4", "--accept-k", "2"]
    assert profile.main([str(prompts), *small, "--steps", "latency"]) == 0
    first = load_calibration(out / "calibration.json")
    assert profile.main([str(prompts), *small, "--steps", "acceptance"]) == 0
    cal = load_calibration(out / "calibration.json")
    assert cal["latency"]["target"] == first["latency"]["target"] and "lookup" in cal["acceptance"]
    assert "latency from an earlier run" in cal["source"]
    assert profile.main([str(prompts), *small, "--steps", "latency"]) == 0
    assert "lookup" in load_calibration(out / "calibration.json")["acceptance"]
    doc = json.loads((out / "calibration.json").read_text())
    doc["model"]["target_sha256"] = "another export"
    (out / "calibration.json").write_text(json.dumps(doc))
    assert profile.main([str(prompts), *small, "--steps", "latency"]) == 0
    assert "acceptance" not in load_calibration(out / "calibration.json")
    capsys.readouterr()


def test_edge_profile_measures_the_target_at_each_latency_context(tiny_dir, prompts, tmp_path, capsys):
    """The target's curve at every --latency-contexts value that fits (the planner interpolates between them), the
    drafters' at the first; a context with no room for a call is named and skipped, not a traceback."""
    from edge.tools import profile
    from edge.manifest import load_manifest
    from memory.planner import Latency

    out = tmp_path / "prof"
    capsys.readouterr()
    assert profile.main([str(prompts), "--model", str(tiny_dir), "--out", str(out), "--quiet", "--steps", "latency",
                         "--sizes", "1,2", "--latency-reps", "1", "--latency-contexts", "40,16,100000,16"]) == 0
    assert "skipping --latency-contexts [100000]" in capsys.readouterr().err
    lat = load_calibration(out / "calibration.json")["latency"]
    assert lat["context"] == 40 and [c for c, _ in lat["target_at"]] == [16]
    assert [s for s, _ in lat["target"]] == [s for s, _ in lat["target_at"][0][1]] == [1, 2]
    assert set(lat["drafters"]) == {g.name for g in load_manifest(tiny_dir, verify="none").drafters}
    curve = Latency.from_calibration(load_manifest(tiny_dir, verify="none"), lat)
    assert curve.target_for(16)(1) == lat["target_at"][0][1][0][1] and curve.target_for(40)(1) == lat["target"][0][1]
    assert profile.main([str(prompts), "--model", str(tiny_dir), "--out", str(out), "--quiet", "--steps", "latency",
                         "--sizes", "1", "--latency-contexts", "100000"]) == 2
    assert "no --latency-contexts value leaves room" in capsys.readouterr().err


def test_each_drafter_measures_acceptance_from_the_same_state(tiny_dir, prompts, monkeypatch):
    """Token Recycling learns from every run: measured after lookup and the model drafter had answered the same
    prompt, it recalled their answer (accepted ~50x more than when it ran first). Now its counts do not depend on
    which drafters ran before it."""
    from edge.tools import profile

    items = profile.load_prompts(str(prompts), 0)[:1]  # one prompt: what carries over to the next does not count
    got = []
    for kinds in (["recycling", "hybrid"], ["lookup", "model", "hybrid", "recycling"]):
        monkeypatch.setattr(profile, "chain_kinds", lambda engine, kinds=kinds: kinds)
        e = edge.load(tiny_dir, context=256)
        counters = profile.measure_acceptance(e, items, 4, 2, 24, None)[1]
        got.append({k: {n: v for n, v in c.items() if n != "overhead_ms_per_step"} for k, c in counters.items()})
    alone, after = got
    for kind in ("recycling", "hybrid"):
        assert alone[kind]["steps"] > 0 and alone[kind] == after[kind], (kind, alone[kind], after[kind])


def test_speed_sweep_repeats_draft_alike(tiny_dir, prompts):
    """A config's second repeat drafted from what its first (and every other config) had learnt on the same
    prompt: ~3x the first's accepted tokens. Every run of a prompt now starts from the same drafting state."""
    from edge.tools import profile

    e = edge.load(tiny_dir, context=256)
    seen = {}
    real = e.generate

    def generate(prompt, **kw):
        r = real(prompt, **kw)
        seen.setdefault((prompt, kw.get("drafter"), kw.get("draft_len")), []).append(r.stats.accepted)
        return r
    e.generate = generate
    items = profile.load_prompts(str(prompts), 0)
    configs = [("none", "none", None), ("chain:recycling:4", "recycling", 4), ("chain:hybrid:4", "hybrid", 4)]
    profile.speed_sweep(e, items, configs, 3, 24, None, None)
    runs = {k: v for k, v in seen.items() if k[1] in ("recycling", "hybrid")}
    assert len(runs) == 4 and any(sum(v) for v in runs.values())
    for k, v in runs.items():
        assert len(v) == 3 and len(set(v)) == 1, (k, v)


def test_edge_profile_output_under_a_file_is_one_clear_line(tiny_dir, prompts, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    r = run_module(["edge.tools.profile", str(prompts), "--model", str(tiny_dir), "--out", str(f / "o")])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--out" in r.stderr, r.stderr
    # without --model: refused before the embedded default is looked up (or exported: a minute of work)
    r = subprocess.run([sys.executable, "-m", "edge.tools.profile", str(prompts), "--out", str(f / "o")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "EDGESPEC_HOME": str(f / "home")})
    assert r.returncode == 2 and "--out" in r.stderr and "EDGESPEC_HOME" not in r.stderr, r.stderr
    # a good --out, a cache that cannot be made: one line naming the variable
    r = subprocess.run([sys.executable, "-m", "edge.tools.profile", str(prompts), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "EDGESPEC_HOME": str(f / "home")})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "EDGESPEC_HOME" in r.stderr, r.stderr


def test_pure_helpers():
    pts = [{"context": 256, "k": 0, "widest_call": 2, "drafter": "none", "peak_rss_mb": 250.0, "predicted_mb": 240.0},
           {"context": 256, "k": 16, "widest_call": 17, "drafter": "lookup", "peak_rss_mb": 251.0,
            "predicted_mb": 255.0}]
    assert fit_baseline(pts, 85.0) == 95.0  # the model then bounds every point from above
    assert "| 256 | 16 (17) | lookup | 251.0 | 255.0 | +1.6% |" in validation_table(pts)
    pair = {"0": {"context": 256, "peak_rss_mb": 200.0}, "4": {"peak_rss_mb": 202.0}, "64": {"peak_rss_mb": 220.0}}
    speed = {"plan": {"drafter": "lookup"}, "results": {"plan": {"tok_s": 30.0}, "chain:lookup:64": {"tok_s": 25.0}}}
    # ratios to plain within each (prompt, repeat) block: a slow block (machine busy) slows every config alike
    res = summarize_speed({"none": [10.0, 40.0, 20.0], "plan": [15.0, 60.0, 30.0], "unmanaged": [20.0, 80.0, 40.0],
                           "chain:lookup:4": [12.0, 52.0, 24.0]})
    assert res["plan"]["ratio_vs_none"] == 1.5 and res["chain:lookup:4"]["ratio_vs_none"] == 1.2
    assert planner_vs_sweep(res) == {"best_swept": {"config": "chain:lookup:4", "ratio_vs_none": 1.2, "tok_s": 24.0},
                                     "plan_ratio_vs_none": 1.5, "plan_vs_best": 1.25}
    d = specmemo_pair(pair, 4, 64, speed)
    assert d["planner_extra_pct_of_plain"] == 1.0 and d["unmanaged_extra_pct_of_plain"] == 10.0
    assert d["less_speculative_memory_pct"] == 90.0 and d["throughput_kept_pct"] == 120.0


# ------------------------------------------------------------------------------------------- the planner reads it
def test_the_planner_loads_the_calibration_and_its_choice_follows_it(tiny_dir, tmp_path):
    good = edge.load(tiny_dir, context=256, calibration=calibration(tmp_path, 0.95, "hi.json"))
    assert good.plan.drafter != "none" and good.plan.nodes >= 8, good.plan.reason
    assert "test" in good.profile.calibration["source"]
    bad = edge.load(tiny_dir, context=256, calibration=calibration(tmp_path, 0.0, "lo.json"))
    assert bad.plan.drafter == "none" and bad.default_drafter == "none"
    # the request still runs the engine's own drafter within the budget: its adaptive length and probes decide
    # per step (test_a_plan_for_plain_decoding_still_probes_and_can_recover)
    assert bad.generate("the quick brown fox", max_tokens=6).stats.drafter == bad._own
    # the memory section too: a larger baseline raises every predicted peak by exactly the difference
    m, prof = good.manifest, profile_for(None, calibration=calibration(tmp_path, 0.95, "b.json", 185.0))
    base = make_plan(m, good.profile, 64, 1e5, capacity=256)
    more = make_plan(m, prof, 64, 1e5, capacity=256)
    assert more.plain_peak_mb - base.plain_peak_mb == pytest.approx(185.0 - Calibration().baseline_mb)


def test_plan_json_and_auto_loaded_calibration(tiny_dir, tmp_path, monkeypatch, capsys):
    from edge.chat import main
    from edge.planning import default_calibration_path

    hi = calibration(tmp_path, 0.95, "hi.json")
    assert main(["--model", str(tiny_dir), "--plan", "--json", "--context", "64", "--budget-mb", "4096",
                 "--calibration", str(hi)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["calibration"] == "test" and rep["plan"]["drafter"] != "none"
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    dest = default_calibration_path(tiny_dir)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(calibration(tmp_path, 0.0, "lo.json").read_bytes())  # what edge-profile --install does
    assert edge.load(tiny_dir, context=256, budget_mb=4096).plan.drafter == "none"


def test_plan_shows_the_plan_of_the_drafter_asked_for(tiny_dir, tmp_path, capsys):
    """`edge-chat --plan --drafter X` prints the plan an engine loaded with X runs (X or plain decoding), as
    edge.load(drafter=X) plans it; it printed the auto plan whatever --drafter said."""
    from edge.chat import main

    hi = calibration(tmp_path, 0.95, "hi.json")
    flags = ["--model", str(tiny_dir), "--plan", "--json", "--context", "64", "--budget-mb", "4096",
             "--calibration", str(hi)]
    assert main(flags) == 0
    auto = json.loads(capsys.readouterr().out)["plan"]["drafter"]
    assert auto != "none"  # else an unrestricted plan would pass the check below too
    other = next(d for d in ("lookup", "recycling") if d != auto)
    assert main(flags + ["--drafter", other]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["drafter"] in (other, "none")
    engine = edge.load(tiny_dir, drafter=other, context=64, budget_mb=4096, calibration=hi)
    assert engine.plan.drafter in (other, "none")


def test_calibration_errors_are_clear(tiny_dir, tmp_path):
    with pytest.raises(CalibrationError, match="cannot read it.*edge-profile"):
        load_calibration(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"memroy": {}}))
    with pytest.raises(CalibrationError, match=r"unknown section\(s\) \['memroy'\]"):
        load_calibration(tmp_path / "bad.json")
    (tmp_path / "neg.json").write_text(json.dumps({"memory": {"baseline_mb": -1}}))
    with pytest.raises(CalibrationError, match="baseline_mb must be a finite number >= 0"):
        load_calibration(tmp_path / "neg.json")
    with pytest.raises(EngineError, match="missing.json"):
        edge.load(tiny_dir, context=256, calibration=tmp_path / "missing.json")


@pytest.mark.parametrize("doc,needle", [
    ({"latency": {"target": 5}}, "latency target"),
    ({"latency": {"target": [[1, 5], [2, -1]]}}, "latency target"),
    ({"latency": {"lookup_ms": -5}}, "lookup_ms"),
    ({"latency": {"overhead_ms": "abc"}}, "overhead_ms"),
    ({"latency": {"drafters": [1]}}, "latency drafters"),
    ({"memory": {"baseline_mb": 1e309}}, "baseline_mb must be a finite number"),
    ({"memory": {"baseline_mb": None}}, "baseline_mb must be a number"),
    ({"acceptance": [1]}, "section 'acceptance' must be an object"),
    ({"acceptance": {"lookup": {"rate": [0.5, 0.4]}}}, "acceptance['lookup']"),
    ({"acceptance": {"lookup": {"rate": [[1.5, 0]]}}}, "table of probabilities"),
    ({"acceptance": {"lookup": {"rate": [[0.5, 0]], "draft_rate": "x"}}}, "not numbers"),
    ({"acceptance": {"lookup": 3}}, "acceptance['lookup']"),
    ({"model": "x"}, "section 'model' must be an object"),
])
def test_malformed_calibrations_are_one_clear_error(tmp_path, tiny_dir, doc, needle):
    f = tmp_path / "cal.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match=re.escape(needle)):
        load_calibration(f)
    r = run_module(["edge.chat", "--model", str(tiny_dir), "--plan", "--budget-mb", "500", "--calibration", str(f)])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "cal.json" in r.stderr, r.stderr


def test_a_calibration_of_another_export_is_refused_and_an_installed_one_ignored(tiny_dir, tmp_path, monkeypatch):
    from edge.manifest import load_manifest
    from edge.planning import default_calibration_path, model_identity

    mine = model_identity(load_manifest(tiny_dir))
    assert mine["target_sha256"] and mine["name"]
    other = {**mine, "precision": "int4", "target_sha256": "0" * 64}
    for ident, ok in ((mine, True), (other, False)):
        f = tmp_path / "cal.json"
        f.write_text(json.dumps({"model": ident, "latency": {"lookup_ms": 0.02}}))
        if ok:
            assert profile_for(None, calibration=f, model_dir=tiny_dir).calibration["latency"]["lookup_ms"] == 0.02
        else:
            with pytest.raises(CalibrationError, match="run edge-profile on this model"):
                profile_for(None, calibration=f, model_dir=tiny_dir)
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    auto = default_calibration_path(tiny_dir)
    auto.parent.mkdir(parents=True)
    auto.write_text(json.dumps({"model": other, "latency": {"lookup_ms": 0.02}}))
    assert not profile_for(None, model_dir=tiny_dir).calibration  # a re-export since --install: not used


# ------------------------------------------------------------------------------------------- re-planning in a chat
def test_replanning_shrinks_k_as_the_chat_context_grows(tiny_dir, tmp_path):
    cal = calibration(tmp_path, 0.95)
    e = edge.load(tiny_dir, context=256, calibration=cal, budget_mb=1e5)
    # a budget that fits the unconstrained plan at the engine's first planning context (half the window) and plain
    # decoding at context 170, but not the first plan there: memory, not KV room, makes it shrink
    kw = dict(min_call=e.target.min_call, capacity=256, tree_exact=e.target.tree_exact)
    first, later = (make_plan(e.manifest, e.profile, c, 1e5, **kw) for c in (128, 170))
    budget = max(first.peak_mb, later.plain_peak_mb + 0.05)
    assert predict_peak(e.manifest, first, 170, min_call=e.target.min_call, capacity=256).total_mb > budget
    e = edge.load(tiny_dir, context=256, calibration=cal, budget_mb=budget)
    assert e.plan.nodes == first.nodes
    sizes = [e.plan.nodes]
    chat = e.chat()
    while e.plan.context < 165:  # short turns: the context grows a little each time
        chat.ask("the quick brown fox", max_tokens=16)
        sizes.append(e.plan.nodes)
        assert e.plan.peak_mb <= budget
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0], sizes


def test_a_planned_engine_answers_whatever_a_plain_one_does(tiny_dir, tmp_path):
    """A budget must not refuse requests an engine without one answers: prompt + max_tokens reaching the whole
    context (it ends with "length"), in one request and in a chat, greedy output unchanged."""
    cal = calibration(tmp_path, 0.9)
    free, planned = edge.load(tiny_dir, context=64), edge.load(tiny_dir, context=64, calibration=cal, budget_mb=1e5)
    for e in (free, planned):
        r = e.generate("the quick brown fox", max_tokens=200, drafter="none")
        assert r.finish_reason == "length" and r.stats.prompt_tokens + r.stats.generated >= 62
    ref = free.generate("the quick brown fox", max_tokens=200, drafter="none").token_ids
    assert planned.generate("the quick brown fox", max_tokens=200).token_ids == ref
    chat = planned.chat()
    for _ in range(3):
        try:
            chat.ask("the quick brown fox", max_tokens=20)
        except edge.ContextFull:  # the chat's own limit, as without a plan
            break
    assert planned.plan.context <= 64 - planned.target.min_call


def test_a_plan_decides_the_drafter_and_refuses_one_it_did_not_budget(tiny_dir, tmp_path):
    """edge-chat passes its --drafter (default auto) with every request: under a plan that means the plan's drafter,
    capped at its draft length. Loaded with a drafter, the planner chooses between it and plain decoding. Another
    drafter asked by name runs within the budget (as many draft tokens as fit); a model drafter whose session does
    not fit is refused before it opens."""
    cal = calibration(tmp_path, 0.9)
    e = edge.load(tiny_dir, context=256, calibration=cal, budget_mb=1e5, drafter="lookup")
    assert e.plan.drafter == "lookup"  # not hybrid or recycling, which the calibration rates as highly
    for asked in ("auto", "lookup", None):
        assert e.generate("the quick brown fox", max_tokens=8, drafter=asked).stats.drafter == "lookup"
    for asked in ("none", "hybrid", "recycling", "model"):  # a roomy budget: each fits
        assert e.generate("the quick brown fox", max_tokens=8, drafter=asked).stats.drafter == asked
    plain_mb = e.plan.plain_peak_mb
    tight = edge.load(tiny_dir, context=256, calibration=cal, budget_mb=plain_mb + 1.0, drafter="lookup")
    assert tight.plan.drafter == "lookup"
    with pytest.raises(EngineError, match="drafter 'model' does not fit the"):
        tight.generate("the quick brown fox", max_tokens=8, drafter="model")
    assert tight._drafter_sess is None
    e.generate("the quick brown fox", max_tokens=8, drafter="model")  # its session opens under the roomy budget
    e.budget_mb = tight.budget_mb  # then the budget shrinks: the refusal closes the session it no longer fits
    with pytest.raises(EngineError, match="drafter 'model' does not fit the"):
        e.generate("the quick brown fox", max_tokens=8, drafter="model")
    assert e._drafter_sess is None
    e = edge.load(tiny_dir, context=256, calibration=cal, budget_mb=1e5)
    drafted = e.generate("the quick brown fox jumps over the lazy dog " * 3, max_tokens=24, drafter="auto",
                         draft_len=64).stats
    assert drafted.drafter == e.plan.drafter != "none"
    assert drafted.drafted <= drafted.steps * e.plan.nodes  # the plan's cap holds for a fixed length too


def test_a_drafter_asked_by_name_drafts_as_long_as_asked_when_it_fits(tiny_dir, tmp_path):
    """Under a plan, a named drafter was capped at the planner's 16 tokens per call whatever the budget."""
    e = edge.load(tiny_dir, context=256, calibration=calibration(tmp_path, 0.9), budget_mb=1e5, drafter="none")
    prompt = "def add(a, b):"  # the tiny model's answer repeats one token: lookup drafts it as long as allowed
    free = edge.load(tiny_dir, context=256)
    free.generate(prompt, max_tokens=150, drafter="lookup", draft_len=40)
    assert max(free.policy.call_widths()) > 17  # without a plan the call is this wide
    e.generate(prompt, max_tokens=150, drafter="lookup", draft_len=40)
    assert max(e.policy.call_widths()) == max(free.policy.call_widths())


def test_replanning_follows_acceptance_both_ways_and_reset_plans_afresh(tiny_dir, tmp_path):
    """Re-plans do not ratchet: a turn of poor acceptance shortens drafting (or changes the drafter), a good one
    brings it back. reset() empties the context and plans as at load. Sampling requests are planned with their work
    arrays."""
    from memory import AcceptanceStats

    e = edge.load(tiny_dir, context=256, calibration=calibration(tmp_path, 0.9), budget_mb=1e5)
    first = e.plan
    kind = first.drafter
    e.policy.acceptance[kind] = AcceptanceStats(0.05)
    low = e._replan(100)
    e.policy.acceptance[kind] = AcceptanceStats(0.95)
    high = e._replan(100)
    assert high.drafter == kind and (low.drafter != kind or low.nodes < high.nodes), (low.reason, high.reason)
    e.plan = low
    e.policy.acceptance.pop(kind)
    e.reset()
    assert e.plan == first
    e.generate("the quick brown fox", max_tokens=4, temperature=0.8, seed=1)
    assert e.plan.sampling


def test_a_model_drafter_session_lives_only_while_a_plan_uses_it(tiny_dir, tmp_path):
    """Its memory is budgeted only while a request uses it: dropped by one that does not, reopened (and still
    lossless) by the next that does."""
    e = edge.load(tiny_dir, context=256, calibration=calibration(tmp_path, 0.95), budget_mb=1e5, drafter="model")
    ref = edge.load(tiny_dir, context=256).generate("the quick brown fox", max_tokens=24, drafter="none").token_ids
    assert e.plan.drafter == "model"
    assert e.generate("the quick brown fox", max_tokens=24).token_ids == ref and e._drafter_sess is not None
    assert e.generate("the quick brown fox", max_tokens=24, drafter="none").token_ids == ref
    assert e._drafter_sess is None
    r = e.generate("the quick brown fox", max_tokens=24)
    assert r.stats.drafter == "model" and r.stats.drafted > 0 and r.token_ids == ref and e._drafter_sess is not None


def test_a_model_drafter_session_is_dropped_when_the_budget_stops_fitting_it(tiny_dir, tmp_path):
    """A chat that grows past what the budget allows the model drafter falls back to plain decoding, and its
    session goes with it (it stayed open, unbudgeted, when the fallback came from the budget)."""
    from edge.planning import fitting_nodes

    cal = calibration(tmp_path, 0.95)
    probe = edge.load(tiny_dir, context=256, calibration=cal, drafter="model")
    fits = lambda budget, ctx: fitting_nodes(probe.manifest, probe.profile, ctx, budget, "model",  # noqa: E731
                                             min_call=probe.target.min_call, capacity=256)
    lo, hi = 1.0, 1e4  # the smallest budget (to 0.01 MB) that fits the model drafter at context 220
    while hi - lo > 0.01:
        lo, hi = (lo, (lo + hi) / 2) if fits((lo + hi) / 2, 220) else ((lo + hi) / 2, hi)
    budget = lo
    assert fits(budget, 20) and not fits(budget, 220)
    e = edge.load(tiny_dir, context=256, calibration=cal, budget_mb=budget, drafter="model")
    r = e.generate("the quick brown fox", max_tokens=8)
    assert r.stats.drafter == "model" and e._drafter_sess is not None
    r = e.generate("the quick brown fox", max_tokens=200)  # planned for prompt + 200 tokens: no room for it
    assert r.stats.drafter == "none" and e._drafter_sess is None


def test_a_plan_for_plain_decoding_still_probes_and_can_recover(tiny_dir, tmp_path):
    """A plan made from a poor turn predicts plain decoding fastest; the engine's own drafter still runs within
    the budget with its adaptive length, whose probes keep measuring, so drafting comes back when it pays."""
    e = edge.load(tiny_dir, context=256, calibration=calibration(tmp_path, 0.0), budget_mb=1e5)
    assert e.plan.drafter == "none"
    text = "the quick brown fox jumps over the lazy dog " * 4
    ref = edge.load(tiny_dir, context=256).generate(text, max_tokens=60, drafter="none", raw=True).token_ids
    r = e.generate(text, max_tokens=60, raw=True)
    assert r.stats.drafter == e._own != "none" and r.stats.drafted > 0 and r.token_ids == ref


def test_a_drafter_asked_by_name_is_capped_at_what_fits(tiny_dir, tmp_path):
    """The cap is the largest chain whose predicted peak fits the budget (one more would not), and the request
    drafts no more than that per step even when it asks for more."""
    from edge.planning import fitting_nodes
    from memory import Speculation

    cal = calibration(tmp_path, 0.9)
    probe = edge.load(tiny_dir, context=256, calibration=cal, budget_mb=1e5, drafter="lookup")
    # a budget between hybrid K=3 and K=4 at this context
    kw = dict(min_call=probe.target.min_call, capacity=256)
    ctx = 200
    peaks = [predict_peak(probe.manifest, Speculation("hybrid", n), ctx, **kw).total_mb for n in (3, 4)]
    e = edge.load(tiny_dir, context=256, calibration=cal, budget_mb=sum(peaks) / 2, drafter="lookup")
    assert fitting_nodes(e.manifest, e.profile, ctx, e.plan.budget_mb, "hybrid", **kw) == 3
    text = "the quick brown fox jumps over the lazy dog " * 3
    r = e.generate(text, max_tokens=200 - len(e.encode(text, raw=True)), drafter="hybrid", draft_len=16, raw=True)
    assert r.stats.drafter == "hybrid" and r.stats.drafted > r.stats.steps  # it drafted chains ...
    assert r.stats.drafted <= 3 * r.stats.steps  # ... of at most 3


def test_prefill_runs_in_the_device_profiles_chunks(tiny_dir, tmp_path):
    """The plan counts the profile's prefill chunk (its activation arena); the engine prefills in that chunk."""
    prof = json.loads((Path(edge.__file__).parents[1] / "devices/profiles/android-phone-8gb.json").read_text())
    (tmp_path / "phone.json").write_text(json.dumps({**prof, "name": "phone-chunk-16", "prefill_chunk": 16}))
    e = edge.load(tiny_dir, context=256, device=str(tmp_path / "phone.json"), simulate=True)
    widths, forward = [], e.target.forward
    e.target.forward = lambda tokens, *a, **k: widths.append(len(tokens)) or forward(tokens, *a, **k)
    r = e.generate("the quick brown fox jumps over the lazy dog " * 6, max_tokens=2, drafter="none", raw=True)
    assert r.stats.prompt_tokens > 40 and widths[:3] == [16, 16, 16] and max(widths) == 16


def test_static_shape_buckets_plan_to_the_end_of_the_context(tiny_dir, tmp_path):
    """With shape buckets a plain call is padded to the smallest bucket that holds it (4 here for a 2-row call):
    the engine plans where such a call still fits, so a request to the end of the context is answered."""
    from edge.planning import plan_report

    prof = json.loads((Path(edge.__file__).parents[1] / "devices/profiles/android-phone-8gb.json").read_text())
    prof.update(name="bucketed", shape_buckets=[1, 4, 8, 16], prefill_chunk=16)
    (tmp_path / "b.json").write_text(json.dumps(prof))
    e = edge.load(tiny_dir, context=64, device=str(tmp_path / "b.json"), simulate=True)
    e.target.min_call = 2  # as for a graph whose 1-row calls are padded
    r = e.generate("the quick brown fox", max_tokens=200, drafter="none")
    assert r.finish_reason == "length" and e.plan.context == 64 - 4
    rep = plan_report(e.manifest, e.profile, 64, None, min_call=2)  # edge-chat --plan: the same end
    assert rep["fits"] and rep["plan"]["context"] == 60, rep


def test_plan_report_is_the_plan_the_engine_runs_and_its_lower_bounds_fit(tiny_dir, tmp_path):
    """`edge-chat --plan` plans without loading the target: it takes the narrowest call the engine's probe finds
    (it assumed 2 rows, pricing plain decoding as a 2-row call and planning one token short), and its printed
    lower bounds are budgets that fit (rounded to the nearest 0.1 MB, half of them were refused)."""
    from edge.planning import plan_report
    from memory.planner import fullest, plain_call_rows

    cal = calibration(tmp_path, 0.3)
    e = edge.load(tiny_dir, context=256, calibration=cal, budget_mb=1e4)
    rep = plan_report(e.manifest, e.profile, 256, 1e4)
    assert rep["min_call"] == e.target.min_call
    assert rep["plan"] == e._replan(fullest(256, plain_call_rows(e.profile, e.target.min_call))).to_dict()
    for ctx in range(100, 140):
        rep = plan_report(e.manifest, e.profile, ctx, 1e4)
        assert plan_report(e.manifest, e.profile, ctx, rep["min_budget_plain_mb"])["fits"], (ctx, rep)
        at = plan_report(e.manifest, e.profile, ctx, rep["min_budget_speculative_mb"])
        assert at["fits"] and at["plan"]["drafter"] != "none", (ctx, rep, at)  # the bound buys a drafter


def test_plan_report_takes_the_min_call_the_export_probed(tiny_llama_dir, tmp_path, monkeypatch):
    """The export records its target's load-time probe (parity min_call), so `edge-chat --plan`, which plans without
    loading, prices the calls the engine on that host makes: 2 rows where a lone row computes another way
    (MatMulNBits' 4-bit kernel on x86 without VNNI), not the 1 our graphs' layout implies; unusable or missing
    records fall back to the layout's (1; 2 for an optimum graph)."""
    from dataclasses import replace

    import edge.runner
    from conftest import tiny_export_options
    from devices import load_profile
    from edge.planning import expected_min_call, plan_report
    from export.pipeline import export_model

    monkeypatch.setattr(edge.runner, "probe_min_call", lambda session: 2)
    m = export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(max_len=300, drafters=(), distill=False,
                                                                         parity=False), progress=False)
    assert m.parity["min_call"] == 2
    profile = load_profile("laptop-cpu-16gb")
    assert plan_report(m, profile, 256, None)["min_call"] == 2
    assert edge.load(tmp_path / "m", context=256).target.min_call == 2  # what the loaded engine runs (same probe)
    optimum = replace(m.target, io="optimum")
    for v, ours, theirs in ((1, 1, 1), (2, 2, 2), (None, 1, 2), (3, 1, 2), (True, 1, 2), ("2", 1, 2), (2.0, 1, 2)):
        mv = replace(m, parity={**m.parity, "min_call": v})
        assert expected_min_call(mv) == ours, v
        assert expected_min_call(replace(mv, graphs=(optimum,) + mv.graphs[1:])) == theirs, v


def test_the_model_drafter_prefills_in_the_profiles_chunks_too(tiny_dir, tmp_path):
    """A device profile's prefill_chunk (what its memory plan prices, and on a static-shape NPU the compiled
    buckets) bounded the target's prefill calls but not the model drafter's, which always took 512 rows."""
    from edge.runner import GraphSession

    prof = json.loads((Path(edge.__file__).parents[1] / "devices/profiles/android-phone-8gb.json").read_text())
    prof.update(name="chunked", prefill_chunk=16)
    (tmp_path / "c.json").write_text(json.dumps(prof))
    e = edge.load(tiny_dir, context=256, device=str(tmp_path / "c.json"), simulate=True, drafter="model")
    e.generate("hi", max_tokens=2, drafter="model")  # opens the drafter's session (its load probes are not prefill)
    widest, real = {}, GraphSession.forward

    def forward(self, tokens, *a, **k):
        who = "target" if self is e.target else "drafter"
        widest[who] = max(widest.get(who, 0), len(tokens))
        return real(self, tokens, *a, **k)
    GraphSession.forward = forward
    try:
        r = e.generate("the quick brown fox jumps over the lazy dog " * 5, max_tokens=8, drafter="model")
    finally:
        GraphSession.forward = real
    assert r.stats.prompt_tokens > 40 and widest == {"target": 16, "drafter": 16}, widest


def test_a_budget_refusal_caused_by_max_tokens_names_max_tokens(tiny_dir):
    """A short question refused because prompt + max_tokens does not fit told the user to lower --context."""
    from edge.planning import plan_report

    probe = edge.load(tiny_dir, context=256)
    budget = plan_report(probe.manifest, profile_for(None), 256, None, at=160)["min_budget_plain_mb"]
    e = edge.load(tiny_dir, context=256, budget_mb=budget)
    with pytest.raises(EngineError, match=r"max_tokens 200: max_tokens up to (\d+) fits") as err:
        e.generate("the quick brown fox", max_tokens=200)
    most = int(re.search(r"max_tokens up to (\d+) fits", str(err.value)).group(1))
    assert e.generate("the quick brown fox", max_tokens=most).stats.generated > 0
    with pytest.raises(EngineError, match="max_tokens up to"):
        e.generate("the quick brown fox", max_tokens=most + 1)


def test_a_context_too_small_for_one_call_says_to_load_a_larger_one(tiny_dir):
    with pytest.raises(EngineError, match=r"do not fit 1 KV positions .*: load with a larger context"):
        edge.load(tiny_dir, context=1, budget_mb=4096)


def test_predicted_kv_bytes_are_the_allocated_buffers(tiny_dir):
    from memory import Speculation

    e = edge.load(tiny_dir, context=200, drafter="model")
    e.generate("the quick brown fox", max_tokens=4)  # opens the drafter session
    fp = predict_peak(e.manifest, Speculation("model", 4, e._drafter_graph), 150, min_call=e.target.min_call,
                      capacity=e.context)
    assert fp["target.kv"] == e.target.cache.buf.nbytes
    assert fp["drafter.kv"] == e._drafter_sess.cache.buf.nbytes


def test_plan_report_refuses_a_context_beyond_the_export_and_plans_its_maximum(tiny_dir):
    r = run_module(["edge.chat", "--model", str(tiny_dir), "--plan", "--context", "300", "--budget-mb", "4096"])
    assert r.returncode == 2 and "--context 300 is more than the 256 tokens" in r.stderr, r.stderr
    r = run_module(["edge.chat", "--model", str(tiny_dir), "--plan", "--json", "--context", "256",
                    "--budget-mb", "4096"])
    assert r.returncode == 0 and json.loads(r.stdout)["fits"], r.stdout + r.stderr  # the export's own maximum


def test_stats_shows_plan_predicted_and_measured_memory(tiny_dir):
    r = run_module(["edge.chat", "--model", str(tiny_dir), "--max-tokens", "6", "--context", "256",
                    "--budget-mb", "4096"], stdin="hello there\n/stats json\n/quit\n")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stderr[r.stderr.index("{"): r.stderr.rindex("}") + 1])
    mem = info["memory_mb"]
    assert mem["budget"] == 4096 and 0 < mem["predicted_plain_peak"] <= mem["predicted_peak"]
    assert mem["measured_peak_rss"] >= mem["measured_rss_now"] > 10
    assert info["plan"]["drafter"] and info["context_tokens"] > 0


# ------------------------------------------------------------------------------------------- the PNG writer
def _decode_png(data: bytes) -> np.ndarray:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos: pos + 8])
        body = data[pos + 8: pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n: pos + 12 + n])[0] == zlib.crc32(kind + body)
        chunks[kind] = body
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)
    assert not raw[:, 0].any()  # filter 0 on every row
    return raw[:, 1:].reshape(h, w, 3)


def test_png_plot_is_a_valid_image_with_the_series_drawn(tmp_path):
    p = plot_png(tmp_path / "x.png", {"a": [(1, 1.0), (64, 3.0)], "~b": [(8, 2.0)]}, title="T", xlabel="K",
                 ylabel="MB", size=(200, 120), logx=True)
    img = _decode_png(p.read_bytes())
    assert img.shape == (120, 200, 3)
    colours = {tuple(c) for c in img.reshape(-1, 3)}
    assert (31, 119, 180) in colours and (214, 39, 40) in colours  # both series' palette colours appear
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_png(tmp_path / "y.png", {})


def test_call_latency_takes_turns_so_a_slow_spell_lands_on_every_width(monkeypatch):
    """A host that is slow for a while (another process, here the first 9 timed calls cost 50 ms more): each round
    times every width once, so the spell reaches them alike and no width looks cheaper than a narrower one. Timing
    each width's repeats in a block priced S = 1 (timed first) above S = 4."""
    import edge.tools.profile as prof

    clock = [0.0]
    calls = []

    class Cache:
        length, capacity = 0, 64

        def trim(self, n):
            self.length -= n

        def room(self):
            return self.capacity - self.length

    class Session:
        cache = Cache()

        def prefill(self, ids):
            self.cache.length += len(ids)

        def forward(self, toks):
            calls.append(len(toks))
            clock[0] += (10.0 + len(toks) + (50.0 if 4 <= len(calls) < 13 else 0.0)) / 1000  # 3 warm-ups first

    monkeypatch.setattr(prof.time, "perf_counter", lambda: clock[0])
    out = prof.call_latency(Session(), [1, 2, 4, 64], context=8, reps=7)
    assert [s for s, _ in out] == [1, 2, 4]  # 64 rows do not fit beside 8 cached tokens
    assert calls == [1, 2, 4] + [1, 2, 4] * 7  # warm-ups, then the widths in turn
    assert [ms for _, ms in out] == pytest.approx([11.0, 12.0, 14.0])  # 3 of each width's 7 calls were slow
    assert Session.cache.length == 0  # nothing committed
