"""edge-bench's bookkeeping on fake inputs (edge/tools/bench.py): medians and repeat-paired ratios, the looping count,
the peer comparison and the markdown table; the rotation of modes, the drafter state every run starts from, the
skipped prompts and the peak RSS of edge-bench's loop over a fake engine."""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from edge.tools import bench
from edge.tools.bench import loops, versus_peer


@pytest.mark.parametrize("tokens,looping", [
    ([], False), (list(range(7)) * 5, True), (list(range(8)) * 3, True), (list(range(8)) * 2 + list(range(7)), False),
    ([5, 6] * 12, True), (list(range(100)), False), (list(range(9)) * 2, False),
])
def test_bench_counts_looping_answers(tokens, looping):
    """An answer loops when some 8-token sequence occurs 3 times (overlaps count: a 2-token cycle loops)."""
    assert loops(tokens) is looping


def test_versus_peer_divides_by_the_peers_fastest_mode_per_category():
    def run(pid, cat, mode, tok_s):
        return {"id": pid, "turn": 0, "category": cat, "mode": mode, "decode_tok_s": tok_s, "mean_accepted": None,
                "overhead_ms_per_step": None, "target_s": None, "draft_s": None, "steps": None, "tokens": [1]}

    runs = [run("a", "qa", "none", 100), run("a", "qa", "hybrid", 150), run("a", "qa", "genai", 200),
            run("a", "qa", "genai-ngram", 120), run("b", "qa", "none", 50), run("b", "qa", "hybrid", 60),
            run("b", "qa", "genai", 100), run("b", "qa", "genai-ngram", 80),
            run("c", "rag", "none", 60), run("c", "rag", "genai", 80), run("c", "rag", "genai-ngram", 240)]
    vs = versus_peer(runs, ["none", "hybrid", "genai", "genai-ngram"])
    assert vs["qa"] == {"peer_best": "genai", "none": 0.5, "hybrid": pytest.approx(0.675)}  # median(0.75, 0.6)
    assert vs["rag"] == {"peer_best": "genai-ngram", "none": 0.25, "hybrid": None}  # hybrid did not run there


# ------------------------------------------------------------------------------------------- summaries and ratios
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


# ------------------------------------------------------------------------------------------- runs over a fake engine
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
    """Drafter state: the prompts the drafters learnt from; every ask is recorded with the state it started from.
    `chat_template=None`: a base model, whose raw prompts are [0] (its BOS) and one id per character."""
    context = 64

    def __init__(self, too_long=(), tree_exact=False, generated=None, chat_template="T"):
        self.learned, self.tested, self.calls = (), {}, []
        self.too_long, self.generated = set(too_long), generated or {}
        self.target = SimpleNamespace(tree_exact=tree_exact, min_call=1)
        self.manifest = SimpleNamespace(name="fake", target=SimpleNamespace(precision="fp32"),
                                        chat_template=chat_template)
        self.head_hits = self.head_misses = 0
        self.token_acceptance = SimpleNamespace(tested=lambda: dict(self.tested))
        self.policy = self  # what edge-bench reads of the draft-length policy

    def drafter_state(self):
        return self.learned

    def set_drafter_state(self, s):
        self.learned = s

    def reset(self, keep_drafter_state):
        assert keep_drafter_state

    def chat(self):
        assert self.manifest.chat_template is not None, "a chat on a model without a chat template"
        return _Chat(self)

    def generate(self, text, raw=False, **kw):
        assert raw and self.manifest.chat_template is None, "a raw prompt on a chat model"
        self.raw_calls = getattr(self, "raw_calls", 0) + 1
        return _Chat(self).ask(text, **kw)

    def _resolve(self, m):
        return m

    def encode(self, prompt, raw=False):
        # as Engine.encode: a string is raw text on a base model, one user turn on a chat model
        return [0] + [1] * len(prompt) if raw or self.manifest.chat_template is None else [1, 2, 3]


def _args(**kw):
    return argparse.Namespace(**{**dict(reps=2, cold=False, quiet=True, max_tokens=4, second_turn=None,
                                        draft_len=None, temp=0.0, top_p=1.0, top_k=0, seed=0, prompts="p.jsonl",
                                        threads=2, peer_model=None, rss_own_process=False, limit=0,
                                        categories=None), **kw})


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


def test_each_edgespec_mode_can_be_measured_in_a_process_of_its_own(tmp_path, quiet_rss, monkeypatch):
    """--rss-own-process replays the same prompts per edgespec mode in a fresh process (memprobe.replay) and
    reports that process's peak; without it, or where a replay fails, the row says it is the bench process's."""
    from edge.tools import memprobe

    asked = []

    def fresh(args, timeout=600):
        asked.append(args)
        if args["drafter"] == "lookup":
            raise RuntimeError("EngineError: no room")
        if args["drafter"] == "recycling":
            return {}  # a probe that printed no peak
        return {"peak_rss_mb": {"none": 301.04, "hybrid": 333.0}[args["drafter"]]}

    monkeypatch.setattr(memprobe, "in_fresh_process", fresh)
    e = _Engine()
    e.model_dir = tmp_path / "model"
    modes = ["none", "lookup", "recycling", "hybrid"]
    rc, doc = _bench(tmp_path, e, _items("p0"), modes, reps=1, rss_own_process=True, limit=2, categories="qa")
    rows = doc["runtimes"]
    assert rc == 0 and [a["drafter"] for a in asked] == modes
    assert asked[0] == dict(model_dir=str(tmp_path / "model"), prompts="p.jsonl", context=64, reps=1, max_tokens=4,
                            drafter="none", threads=2, limit=2, categories="qa", draft_len=None)
    assert rows["recycling"]["peak_rss_process"] == "bench"
    assert (rows["none"]["peak_rss_mb"], rows["none"]["peak_rss_process"]) == (301.0, "own")
    assert (rows["hybrid"]["peak_rss_mb"], rows["hybrid"]["peak_rss_process"]) == (333.0, "own")
    assert (rows["lookup"]["peak_rss_mb"], rows["lookup"]["peak_rss_process"]) == (100.0, "bench")
    md = (tmp_path / "b.md").read_text()
    assert "Peak RSS of lookup, recycling: this bench process" in md and "none," not in md.split("Peak RSS of")[-1]

    def interrupted(args, timeout=600):
        asked.append(args)
        raise KeyboardInterrupt

    monkeypatch.setattr(memprobe, "in_fresh_process", interrupted)
    asked.clear()
    rc, doc = _bench(tmp_path, e, _items("p0"), modes, reps=1, rss_own_process=True)
    assert rc == 130 and doc["interrupted"] and len(asked) == 1  # Ctrl-C: the results are still written
    assert {r["peak_rss_process"] for r in doc["runtimes"].values()} == {"bench"}
    asked.clear()
    rc, doc = _bench(tmp_path, e, _items("p0"), modes, reps=1)
    assert not asked and {r["peak_rss_process"] for r in doc["runtimes"].values()} == {"bench"}


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


def test_a_model_without_a_chat_template_completes_raw_prompts_in_every_mode(tmp_path, quiet_rss):
    e = _Engine(chat_template=None)
    rc, doc = _bench(tmp_path, e, _items("p0", "p1"), ["none", "lookup"], reps=1)
    assert rc == 0 and doc["prompt_format"] == "raw" and e.raw_calls == len(e.calls) == 5  # with the warm-up
    assert "Prompts completed as raw text" in (tmp_path / "b.md").read_text()
    _, chat = _bench(tmp_path, _Engine(), _items("p0"), ["none"], reps=1)
    assert chat["prompt_format"] == "chat"


def test_a_raw_prompt_that_does_not_fit_is_skipped_in_every_mode(tmp_path, quiet_rss, capsys):
    e, long = _Engine(chat_template=None), "x" * 70  # 71 ids with its BOS, the context holds 64
    rc, doc = _bench(tmp_path, e, _items("p0", long), ["none", "lookup"], reps=1)
    assert rc == 0 and [s["id"] for s in doc["skipped"]] == [long] and "prompt is 71 tokens" in capsys.readouterr().err
    assert long not in [t for t, _, _, _ in e.calls]  # refused before the engine was asked


def test_peers_get_the_raw_prompts_ids_on_a_model_without_a_chat_template():
    class Peer:
        def run(self, ids, max_new, mode, stop=None):
            self.ids = ids
            return {"tokens": [5], "n_gen": 1, "decode_s": 0.0, "prefill_s": 0.1}

    p = Peer()
    (r,) = bench._run_peer(p, _Engine(chat_template=None), {"id": "x", "turns": ["hi"]}, "llama", _args())
    assert p.ids == [0, 1, 1] and r["prompt_tokens"] == 3
