"""edge-bench's and edge-profile's bookkeeping on fake inputs: medians and repeat-paired ratios, the looping count,
the peer comparison and the markdown table; the rotation of modes, the drafter state every run starts from, the
skipped prompts and the peak RSS of edge-bench's loop (a fake engine); edge-profile's latency widths and contexts,
its prompt selection, speed sweep and acceptance counters, and the calibration values the planner reads."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from edge.tools import bench, profile


# ------------------------------------------------------------------------------------------- edge-bench: pure
def _rec(pid, mode, rep, tok_s, tokens, cat="qa", **kw):
    return {"id": pid, "turn": 0, "category": cat, "mode": mode, "rep": rep, "decode_tok_s": tok_s,
            "mean_accepted": None, "overhead_ms_per_step": None, "target_s": None, "draft_s": None, "steps": None,
            "tokens": tokens, **kw}


def test_loops_counts_an_8_token_sequence_seen_3_times_up_to_the_last_position():
    eight = list(range(8))
    assert bench.loops(eight * 3)  # the third occurrence is the answer's last 8 tokens
    assert not bench.loops(eight * 2 + [99] * 7)  # twice is not a loop
    assert not bench.loops([1, 2, 3, 4] * 3)  # shorter sequences do not count
    assert bench.loops([1, 2, 3, 4] * 3, n=4) and not bench.loops(eight * 3, times=4)


def test_summary_is_the_median_over_prompts_of_each_prompts_median_over_repeats():
    runs = []
    # prompts a, b, c: hybrid / none within each repeat 1, 2, 6 (a: every repeat; b and c: one each)
    for rep, (n, h) in enumerate([(10.0, 10.0), (10.0, 20.0), (10.0, 60.0)]):
        runs += [_rec("a", "none", rep, n, [1]), _rec("a", "hybrid", rep, h, [1])]
    runs += [_rec("b", "none", 0, 50.0, [1]), _rec("b", "hybrid", 0, 100.0, [1]),
             _rec("c", "none", 0, 5.0, [1]), _rec("c", "hybrid", 0, 30.0, [1])]
    row = bench.summarize(runs, ["none", "hybrid"])["qa"]
    rows = {(r["id"], r["mode"]): r for r in bench.per_prompt(runs)}
    assert rows[("a", "hybrid")]["ratio_vs_none"] == 2.0  # median(1, 2, 6), not the mean 3
    assert rows[("a", "hybrid")]["decode_tok_s"] == 20.0
    assert row["hybrid"]["ratio_vs_none"] == 2.0  # median over prompts (2, 2, 6)
    assert row["hybrid"]["decode_tok_s"] == 30.0  # median of the prompts' medians 20, 100, 30
    assert row["none"]["decode_tok_s"] == 10.0  # (10, 50, 5): not the first prompt's, not the mean
    assert row["hybrid"]["identical_to_none"] == "3/3"


def test_per_step_figures_are_milliseconds_and_looping_looks_at_the_first_repeat():
    loop = list(range(8)) * 3
    runs = [_rec("a", "none", 0, 10.0, loop, target_s=0.5, draft_s=0.1, steps=10),
            _rec("a", "none", 1, 10.0, [1, 2], target_s=0.5, draft_s=0.1, steps=10),
            _rec("a", "lookup", 0, 20.0, loop, target_s=0.3, draft_s=None, steps=20),
            _rec("a", "lookup", 1, 20.0, [1, 2], target_s=0.3, draft_s=None, steps=20)]
    row = bench.summarize(runs, ["none", "lookup", "hybrid"])["qa"]
    assert row["none"]["target_ms_per_step"] == 50.0 and row["none"]["draft_ms_per_step"] == 10.0
    assert row["lookup"]["target_ms_per_step"] == 15.0 and row["lookup"]["draft_ms_per_step"] is None
    assert row["none"]["looping"] == row["lookup"]["looping"] == "1/1"  # one prompt, its first repeat loops
    assert "hybrid" not in row  # a mode that did not run in this category has no row
    md = bench.markdown({"qa": row}, ["none", "lookup", "hybrid"]).splitlines()[2]
    assert md.endswith(", 1/1) | — |"), md


def test_a_repeat_without_a_speed_is_left_out_of_the_ratio():
    runs = [_rec("a", "none", 0, None, [1]), _rec("a", "hybrid", 0, 30.0, [1]),  # none's one-token answer
            _rec("a", "none", 1, 10.0, [1]), _rec("a", "hybrid", 1, 20.0, [1]),
            _rec("a", "none", 2, 10.0, [1]), _rec("a", "hybrid", 2, None, [1]),  # hybrid's
            _rec("a", "none", 3, 0.0, [1]), _rec("a", "hybrid", 3, 20.0, [1])]
    assert bench.summarize(runs, ["none", "hybrid"])["qa"]["hybrid"]["ratio_vs_none"] == 2.0


def test_uncompared_modes_and_the_peers_own_reference():
    same, other = [1, 2, 3], [1, 2, 4]
    runs = [_rec("a", "none", 0, 10.0, same), _rec("a", "hybrid", 0, 20.0, same),
            _rec("a", "genai", 0, 12.0, other), _rec("a", "genai-ngram", 0, 24.0, other)]
    modes = ["none", "hybrid", "genai", "genai-ngram"]
    row = bench.summarize(runs, modes)["qa"]
    assert row["hybrid"]["identical_to_none"] == "1/1"
    assert row["genai-ngram"]["identical_to_own_greedy"] == "1/1"  # its greedy text, not ours
    assert bench.summarize(runs, modes, ("hybrid",))["qa"]["hybrid"]["identical_to_none"] is None
    rows = {r["mode"]: r for r in bench.per_prompt(runs)}
    assert rows["genai-ngram"]["identical"] is True and rows["hybrid"]["identical"] is True
    assert {r["mode"]: r for r in bench.per_prompt(runs, ("hybrid",))}["hybrid"]["identical"] is None
    md = bench.markdown(bench.summarize(runs, modes, ("hybrid",)), modes).splitlines()
    cells = md[2].split(" | ")[1:]
    assert cells[1] == "20.0 (×2.0, —, —, not compared, 0/1)", cells  # asked not to compare
    assert cells[2] == "12.0 (×1.2, —, —, —, 0/1)", cells  # the peer's greedy has no reference
    assert cells[3].startswith("24.0 (×2.4, —, —, 1/1, 0/1)"), cells


def test_versus_peer_is_each_mode_over_the_peers_fastest_mode_paired_by_repeat():
    runs = []
    for p, (g, gn, n, lk) in {"a": (10, 20, 10, 20), "b": (10, 20, 10, 40), "c": (10, 20, 10, 120)}.items():
        runs += [_rec(p, "genai", 0, float(g), [1]), _rec(p, "genai-ngram", 0, float(gn), [1]),
                 _rec(p, "none", 0, float(n), [1]), _rec(p, "lookup", 0, float(lk), [1])]
    runs += [_rec("d", "genai", 0, None, [1], cat="code"), _rec("d", "genai-ngram", 0, 8.0, [1], cat="code"),
             _rec("d", "none", 0, 4.0, [1], cat="code")]
    modes = ["none", "lookup", "genai", "genai-ngram"]
    vs = bench.versus_peer(runs, modes)
    assert vs["qa"] == {"peer_best": "genai-ngram", "none": 0.5, "lookup": 2.0}  # median(1, 2, 6), peer below
    assert vs["code"] == {"peer_best": "genai-ngram", "none": 0.5, "lookup": None}  # genai had no speed there
    md = bench.markdown(bench.summarize(runs, modes), modes, vs)
    assert "| code | genai-ngram | 0.5 | — |" in md and "| qa | genai-ngram | 0.5 | 2.0 |" in md


def test_select_items_takes_limit_per_category_grouped_in_sorted_order():
    items = [{"id": i, "category": c, "turns": ["x"]} for i, c in enumerate(["qa", "code", "qa", "code", "qa"])]
    assert [it["id"] for it in bench._select_items(items, "p", 1, None)] == [1, 0]
    assert [it["id"] for it in bench._select_items(items, "p", 2, None)] == [1, 3, 0, 2]
    assert [it["id"] for it in bench._select_items(items, "p", 0, "qa")] == [0, 2, 4]


def test_learned_adds_each_runs_share_and_outputs_never_collide(tmp_path):
    total = {"lookup": (1.0, 2.0)}
    bench._add_learned(total, {"lookup": (5.0, 10.0), "hybrid": (1.0, 1.0)},
                       {"lookup": (8.0, 14.0), "hybrid": (1.0, 1.0), "recycling": (2.0, 3.0)})
    assert total == {"lookup": (4.0, 6.0), "recycling": (2.0, 3.0)}
    assert bench._outputs(str(tmp_path / "r.md")) == (tmp_path / "r.json", tmp_path / "r.md")
    assert bench._outputs(str(tmp_path / "r.json")) == (tmp_path / "r.json", tmp_path / "r.md")


# ------------------------------------------------------------------------------------------- edge-bench: runs
class _Chat:
    def __init__(self, engine):
        self.e = engine

    def ask(self, text, max_tokens, drafter, draft_len, temperature, top_p, top_k, seed):
        e = self.e
        e.calls.append((text, drafter, seed, e.learned))
        if text in e.too_long and drafter == "hybrid":
            raise bench.ContextFull(f"{text} does not fit", 999, e.context)
        if drafter != "none":  # speculative runs teach the drafters this prompt, and count acceptance
            e.learned = e.learned + (text,)
            h, n = e.tested.get(drafter, (0.0, 0.0))
            e.tested[drafter] = (h + 1.0, n + 2.0)
        gen = e.generated.get(text, 4)
        st = SimpleNamespace(generated=gen, prompt_tokens=3, reused_tokens=0, prefill_s=0.01, decode_s=0.1,
                             decode_tok_s=10.0 if drafter == "none" else 20.0, steps=2, drafted=2, accepted=1,
                             mean_accepted=0.5, target_s=0.05, draft_s=0.01, overhead_ms_per_step=0.1,
                             python_ms_per_step=0.2)
        return SimpleNamespace(token_ids=[len(text), 1, 2][:gen], stats=st)


class _Engine:
    """Drafter state: the prompts the drafters learnt from; every ask is recorded with the state it started from."""
    context = 64

    def __init__(self, too_long=(), tree_exact=False, generated=None):
        self.learned, self.tested, self.calls = (), {}, []
        self.too_long, self.generated = set(too_long), generated or {}
        self.target = SimpleNamespace(tree_exact=tree_exact, min_call=1)
        self.manifest = SimpleNamespace(name="fake", target=SimpleNamespace(precision="fp32"))
        self.head_hits = self.head_misses = 0
        self.token_acceptance = SimpleNamespace(tested=lambda: dict(self.tested))

    def drafter_state(self):
        return self.learned

    def set_drafter_state(self, s):
        self.learned = s

    def reset(self, keep_drafter_state):
        assert keep_drafter_state

    def chat(self):
        return _Chat(self)

    def _resolve(self, m):
        return m

    def encode(self, messages):
        return [1, 2, 3]


def _args(**kw):
    return argparse.Namespace(**{**dict(reps=2, cold=False, quiet=True, max_tokens=4, second_turn=None,
                                        draft_len=None, temp=0.0, top_p=1.0, top_k=0, seed=0, prompts="p.jsonl",
                                        threads=2, peer_model=None), **kw})


def _items(*ids):
    return [{"id": i, "category": "qa", "turns": [i]} for i in ids]


def _bench(tmp_path, engine, items, modes, **kw):
    out = tmp_path / "b.json"
    rc = bench._bench(_args(**kw), engine, items, modes, None, out, out.with_suffix(".md"))
    return rc, json.loads(out.read_text())


@pytest.fixture
def quiet_rss(monkeypatch):
    monkeypatch.setattr(bench, "reset_peak_rss", lambda: True)
    monkeypatch.setattr(bench, "peak_rss_mb", lambda: 100.0)


@pytest.mark.parametrize("cold", [False, True])
def test_modes_rotate_and_every_run_drafts_from_what_the_earlier_prompts_taught(tmp_path, quiet_rss, cold):
    e, modes = _Engine(), ["none", "lookup", "hybrid"]
    rc, doc = _bench(tmp_path, e, _items("p0", "p1", "p2"), modes, cold=cold)
    assert rc == 0 and doc["runs_done"] == doc["runs_planned"] == 18
    calls = e.calls[1:]  # after the warm-up
    for i in range(3):
        for rep in range(2):
            k = (i + rep) % 3
            block = calls[(2 * i + rep) * 3:(2 * i + rep + 1) * 3]
            assert [m for _, m, _, _ in block] == modes[k:] + modes[:k], (i, rep, block)  # no mode always first
            assert {t for t, _, _, _ in block} == {f"p{i}"} and {s for _, _, s, _ in block} == {rep}
            # never its own earlier answers; warm (the default): what the earlier prompts taught
            assert {st for _, _, _, st in block} == {() if cold else tuple(f"p{j}" for j in range(i))}, block


def test_a_prompt_that_does_not_fit_is_rolled_back_in_every_mode(tmp_path, quiet_rss, capsys):
    e, modes = _Engine(too_long={"L"}), ["none", "lookup", "hybrid"]
    rc, doc = _bench(tmp_path, e, _items("p0", "L", "p2"), modes, reps=1)
    assert rc == 0 and "skipped prompt 'L'" in capsys.readouterr().err
    assert [s["id"] for s in doc["skipped"]] == ["L"] and {r["id"] for r in doc["runs"]} == {"p0", "p2"}
    assert [m for t, m, _, _ in e.calls if t == "L"] == ["lookup", "hybrid"]  # lookup ran, then hybrid refused
    assert doc["runs_done"] == doc["runs_planned"] == 6
    assert doc["token_acceptance"]["lookup"] == {"lifetime": 0.5, "n": 4}  # p0 and p2's runs only, not L's
    assert {st for t, _, _, st in e.calls if t == "p2"} == {("p0",)}  # L taught the drafters nothing


def test_the_peak_is_the_largest_of_loading_and_every_runs_own(tmp_path, monkeypatch):
    peaks = iter([500.0] + [100.0] * 100)  # loading peaked at 500 MB, before the runs
    monkeypatch.setattr(bench, "peak_rss_mb", lambda: next(peaks))
    monkeypatch.setattr(bench, "reset_peak_rss", lambda: True)
    rc, doc = _bench(tmp_path, _Engine(), _items("p0"), ["none", "lookup"], reps=1)
    assert rc == 0 and doc["peak_rss_mb"] == 500.0 and {r["peak_rss_mb"] for r in doc["runs"]} == {100.0}


@pytest.mark.parametrize("tree_exact", [False, True])
def test_sampled_outputs_are_compared_unless_tree_calls_may_move_a_draw(tmp_path, quiet_rss, tree_exact):
    rc, doc = _bench(tmp_path, _Engine(tree_exact=tree_exact), _items("p0"), ["none", "lookup", "hybrid"], reps=1,
                     temp=0.7)
    row = doc["summary"]["qa"]
    assert row["lookup"]["identical_to_none"] == "1/1"
    assert row["hybrid"]["identical_to_none"] == (None if tree_exact else "1/1")


def test_run_one_turns_seeds_one_token_answers_and_a_peak_that_cannot_be_reset(monkeypatch):
    monkeypatch.setattr(bench, "reset_peak_rss", lambda: False)  # not Linux: a peak would be the process's
    monkeypatch.setattr(bench, "peak_rss_mb", lambda: 100.0)
    e = _Engine(generated={"second": 1})
    recs = bench._run_one(e, {"id": "x", "category": "chat", "turns": ["first", "second"]}, "lookup",
                          _args(seed=5), rep=2)
    assert [s for _, _, s, _ in e.calls] == [7, 1007]  # seed + repeat, + 1000 per turn
    assert [r["category"] for r in recs] == ["chat", "chat+turn2"]
    assert [r["decode_tok_s"] for r in recs] == [20.0, None]  # one token: nothing decoded
    assert {r["peak_rss_mb"] for r in recs} == {None}


def test_run_peer_counts_the_end_token_and_times_from_the_second():
    class Peer:
        def run(self, ids, max_new, mode, stop=None):
            return {"tokens": [5, 6, 7, 8], "n_gen": 5, "decode_s": 2.0, "prefill_s": 0.1}

    (r,) = bench._run_peer(Peer(), _Engine(), {"id": "x", "turns": ["hi"]}, "genai", _args())
    assert r["n_gen"] == 5 and r["decode_tok_s"] == 2.0 and r["prompt_tokens"] == 3


def test_main_puts_none_first_adds_the_peers_reference_and_refuses_auto(tmp_path, capsys, monkeypatch):
    import edge

    monkeypatch.setattr(edge, "load", lambda *a, **k: _Engine())
    monkeypatch.setattr(bench, "peak_rss_mb", lambda: 100.0)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "a", "category": "qa", "turns": ["hi"]}) + "\n")
    out = tmp_path / "b.json"
    base = [str(f), "--model", "m", "--reps", "1", "--max-tokens", "4", "--out", str(out), "--quiet"]
    assert bench.main(base + ["--modes", "lookup"]) == 0
    assert json.loads(out.read_text())["modes"] == ["none", "lookup"]
    assert bench.main(base + ["--modes", "none,auto"]) == 2 and "--modes auto: choose from" in capsys.readouterr().err

    class Peer:
        version = "0"

        load_peak_rss_mb = None

        def __init__(self, *a, **k):
            pass

        def run(self, ids, max_new, mode, stop=None):
            return {"tokens": [1, 2], "decode_s": 1.0, "prefill_s": 0.1}

        def close(self):
            pass

    monkeypatch.setattr(bench, "model_dir_problem", lambda d: None)
    monkeypatch.setattr(bench, "Peer", Peer)
    assert bench.main(base + ["--modes", "none,genai-ngram", "--peer-model", str(tmp_path)]) == 0, \
        capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["modes"] == ["none", "genai-ngram", "genai"]
    assert doc["summary"]["qa"]["genai-ngram"]["identical_to_own_greedy"] == "1/1"


# ------------------------------------------------------------------------------------------- edge-profile
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
