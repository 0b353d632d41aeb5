"""edge-chat and edge-bench as a user runs them (subprocesses on the tiny exported model)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge.tools.bench import loops, versus_peer

# a stand-in for onnxruntime_genai's API: the peer worker imports it through PYTHONPATH, the tests read its answers
FAKE_GENAI = str(Path(__file__).with_name("fake_genai"))
_spec = importlib.util.spec_from_file_location("fake_genai", Path(FAKE_GENAI) / "onnxruntime_genai" / "__init__.py")
fake_genai = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_genai)


def _run(args, stdin=None, timeout=240, env=None):
    return subprocess.run([sys.executable, "-m", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.fixture(scope="module")
def model(exported_llama):
    return str(exported_llama[0])


def test_chat_prompt_json(model):
    r = _run(["edge.chat", "--model", model, "--prompt", "the quick brown fox", "--json", "--max-tokens", "12",
              "--drafter", "lookup", "--context", "256"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("text", "token_ids", "prefill_ms", "decode_tok_s", "drafted", "accepted", "mean_accepted_len",
                "peak_rss_mb"):
        assert key in out
    assert 0 < len(out["token_ids"]) <= 12 and out["peak_rss_mb"] > 10
    assert out["python_ms_per_step"] > 0  # a share of decoding (Stats.python_ms_per_step)


def test_chat_repl_commands(model):
    r = _run(["edge.chat", "--model", model, "--max-tokens", "8", "--context", "256"],
             stdin="hello there\n/stats json\n/reset\nagain\n/quit\n")
    assert r.returncode == 0, r.stderr
    assert "conversation cleared" in r.stderr and '"generated"' in r.stderr
    assert r.stderr.count("tok/s decode") == 2  # one stats line per answer


def test_chat_repl_survives_refusals_and_unknown_commands(model):
    """A first question that does not fit the context is refused with what to do in the REPL (no traceback, no
    stats line for it), a mistyped /command is not sent to the model, and the session goes on."""
    long_q = "tell me a long story about rivers and mountains " * 12
    r = _run(["edge.chat", "--model", model, "--max-tokens", "4", "--context", "40"],
             stdin=f"{long_q}\n/qiut\nhi\n/quit\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "shorten it, or restart edge-chat with a larger --context (this export holds up to 256)" in r.stderr
    err = next(ln for ln in r.stderr.splitlines() if ln.startswith("error:"))
    assert "Chat(overflow" not in err and "/reset" not in err  # neither helps a question that is too long
    assert "unknown command /qiut" in r.stderr
    assert r.stderr.count("tok/s decode") == 1  # only the answered turn has a stats line
    # after some turns a question that would fit alone: /reset or --overflow drop_oldest help
    r = _run(["edge.chat", "--model", model, "--max-tokens", "8", "--context", "64"],
             stdin="".join(f"tell me about rivers number {i}\n" for i in range(8)) + "/quit\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "/reset to start over, or restart edge-chat with --overflow drop_oldest" in r.stderr, r.stderr


@pytest.mark.parametrize("flags,needle", [
    (["--context", "-5"], "--context"), (["--context", "0"], "--context"), (["--threads", "0"], "--threads"),
    (["--budget-mb", "-5", "--plan"], "--budget-mb"), (["--context", "100000"], "exported for"),
    (["--context", "5"], "--context 5 cannot hold a chat"),
])
def test_chat_bad_engine_flags(model, flags, needle):
    r = _run(["edge.chat", "--model", model, "--prompt", "hi", "--max-tokens", "2", *flags])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr, r.stderr


def test_chat_prompt_uses_the_system_prompt_and_counts_it(model):
    """--system applies to --prompt as well as to the REPL (it was ignored there), and the start-up context check
    counts it: a context that holds an empty question alone but not with the system prompt is refused."""
    import edge

    e = edge.load(model, drafter="none", context=256)
    system = "you answer in rhymes about rivers and mountains " * 3
    want = e.generate([{"role": "system", "content": system}, {"role": "user", "content": "hi"}], max_tokens=8)
    assert want.token_ids != e.generate("hi", max_tokens=8).token_ids  # the system prompt changes the answer
    r = _run(["edge.chat", "--model", model, "--prompt", "hi", "--system", system, "--json", "--max-tokens", "8",
              "--drafter", "none", "--context", "256"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == want.token_ids
    alone = len(e.encode([{"role": "user", "content": ""}]))
    r = _run(["edge.chat", "--model", model, "--prompt", "hi", "--system", system, "--context", str(alone + 2)])
    assert r.returncode == 2 and "with the chat template and the system prompt" in r.stderr, r.stderr


def test_chat_on_a_checkpoint_dir_says_export_it_elsewhere(tiny_llama_dir):
    """Pointing --model at a checkpoint suggests exporting it into a new directory, never into itself (an export
    replaces its output directory)."""
    r = _run(["edge.chat", "--model", str(tiny_llama_dir), "--prompt", "hi"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "holds a model checkpoint" in r.stderr and f"-o {tiny_llama_dir}-edgespec" in r.stderr


def test_chat_bad_model_dir_is_one_clear_line(tmp_path):
    r = _run(["edge.chat", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("edge-chat: error:") and "edge-export" in r.stderr


@pytest.mark.parametrize("flags,needle", [
    (["--temp", "-1"], "--temp"), (["--temp", "inf"], "--temp"), (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"), (["--top-k", "-2"], "--top-k"), (["--seed", "-1"], "--seed"),
    (["--max-tokens", "0"], "--max-tokens"), (["--stop", ""], "--stop"), (["--json"], "--json needs --prompt"),
    (["--simulate"], "--simulate runs a --device profile"), (["--prompt", "  "], "--prompt is empty"),
])
def test_chat_bad_generation_flags_fail_before_loading(tmp_path, flags, needle):
    """Each is refused by the flag's name before the model loads (a first run's export takes minutes; the REPL
    used to start and then refuse every question): the model directory given does not even exist."""
    args = ["edge.chat", "--model", str(tmp_path / "absent"), *flags]
    if "--prompt" not in flags and "--json" not in flags:
        args += ["--prompt", "hi"]
    r = _run(args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr and "no such model directory" not in r.stderr, r.stderr


def test_chat_output_closed_early_is_quiet(model):
    """`edge-chat --prompt ... | head -c 5`: the closed pipe ends the answer without a traceback."""
    p = subprocess.Popen([sys.executable, "-m", "edge.chat", "--model", model, "--prompt", "the quick brown fox",
                          "--max-tokens", "200", "--drafter", "none", "--context", "256"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**__import__("os").environ,
                                                                             "HF_HUB_OFFLINE": "1"})
    p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "Exception ignored" not in err, err


def test_chat_json_interrupted_still_prints_what_ran(monkeypatch, capsys):
    """--prompt --json after Ctrl-C: one JSON object with the text so far and finish_reason "interrupted", exit
    130 (it printed nothing before)."""
    import argparse

    from edge import args, chat as cli
    from edge.engine import Chunk, Stats

    class Engine:
        last_stats = None

        def stream(self, *a, **kw):
            self.last_stats = Stats(generated=2, steps=1, drafter="none")
            yield Chunk("Hello", [5, 6], 0)
            raise KeyboardInterrupt

    a = argparse.Namespace(prompt="hi", system=None, drafter="none", max_tokens=8, temp=0.0, top_p=1.0, top_k=0,
                           seed=None, stop=[])
    assert cli._answer_json(Engine(), a, 0.5) == 130
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "Hello" and out["token_ids"] == [5, 6] and out["finish_reason"] == "interrupted"


def test_bench_writes_json_and_markdown(model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"x{i}", "category": c, "turns": [t]}) for i, (c, t) in enumerate(
        [("qa", "the quick brown fox"), ("code", "def add(a, b):")])) + "\n")
    out = tmp_path / "b.json"
    r = _run(["edge.tools.bench", str(prompts), "--model", model, "--reps", "1", "--max-tokens", "10", "--modes",
              "none,lookup,recycling", "--second-turn", "again", "--out", str(out), "--quiet"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {"qa", "code", "qa+turn2", "code+turn2"}
    for cat in doc["summary"].values():
        assert cat["none"]["ratio_vs_none"] == 1.0
        assert cat["lookup"]["identical_to_none"] == "1/1" and cat["recycling"]["identical_to_none"] == "1/1"
    for run in doc["runs"]:  # Python per step: at least the loop's own bookkeeping, less than the whole step
        assert run["overhead_ms_per_step"] <= run["python_ms_per_step"] < 1000 * run["decode_s"] / run["steps"]
    assert "Python ms/step" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".md").read_text().startswith("| category |")


def test_bench_sampling_runs_every_mode_with_the_same_seeds(model, tmp_path):
    """--temp: modes sample, repeat r with seed + r in every mode, and a seeded chain drafter's answer is plain
    sampling's with that seed, so outputs are compared (they were not: a free lossless check thrown away); on this
    tree-verifying fp32 export recycling drafts trees, whose sampled draws may move: not compared. The JSON records
    the settings and the share of rows the on-graph head served."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "qa", "turns": ["the quick brown fox"]}) + "\n")
    out = tmp_path / "b.json"
    r = _run(["edge.tools.bench", str(prompts), "--model", model, "--reps", "2", "--max-tokens", "12", "--modes",
              "none,lookup,recycling", "--temp", "0.8", "--top-k", "20", "--seed", "7", "--out", str(out), "--quiet"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["sampling"]["temperature"] == 0.8 and doc["sampling"]["top_k"] == 20
    assert doc["sampling"]["rows_from_head"] == 1.0  # a top-k cut inside the head's k: never the logits
    assert doc["summary"]["qa"]["lookup"]["identical_to_none"] == "1/1"
    assert doc["summary"]["qa"]["recycling"]["identical_to_none"] is None
    assert "temperature 0.8, top-p 1.0, top-k 20" in out.with_suffix(".md").read_text()
    import edge

    e = edge.load(model, drafter="none", context=256)
    none = [x["tokens"] for x in doc["runs"] if x["mode"] == "none"]
    assert none == [e.generate("the quick brown fox", max_tokens=12, temperature=0.8, top_k=20, seed=7 + rep,
                               drafter="none").token_ids for rep in range(2)]


@pytest.mark.parametrize("lines,needle", [
    (['{"id": "a", "category": "qa"}'], "p.jsonl:1: expected"),  # no turns (was a KeyError traceback)
    (['{"category": "qa", "turns": ["hi"]}'], "p.jsonl:1: expected"),  # no id
    (["[1, 2]"], "p.jsonl:1: expected"),  # JSON, not an object
    (['{"id": "a", "turns": "Hello"}'], "p.jsonl:1: expected"),  # a string (was run as 5 one-letter turns)
    (['{"id": "a", "turns": []}'], "p.jsonl:1: expected"),  # nothing to ask (was an empty table)
    (['{"id": "a", "turns": [5]}'], "p.jsonl:1: expected"),
    (['{"id": "a", "turns": ["hi"]}', "not json"], "p.jsonl:2: not JSON"),  # the file's line, not the JSON's
])
def test_bench_bad_workload_lines_are_one_clear_error(model, tmp_path, lines, needle):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    r = _run(["edge.tools.bench", str(prompts), "--model", model, "--reps", "1", "--out", str(tmp_path / "o.json")])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr, r.stderr


@pytest.mark.parametrize("flags,needle", [
    (["--reps", "0"], "--reps"), (["--max-tokens", "0"], "--max-tokens"), (["--limit", "-1"], "--limit"),
    (["--draft-len", "-1"], "--draft-len"), (["--draft-len", "65"], "--draft-len"), (["--modes", "bogus"], "bogus"),
    (["--modes", "model"], "no drafter graph"), (["--temp", "-1"], "temperature"), (["--top-p", "0"], "top_p"),
    (["--top-k", "-2"], "--top-k"), (["--seed", "-1"], "--seed"),
])
def test_bench_bad_flags_fail_before_running(tmp_path, exported_llama, tiny_llama_dir, flags, needle):
    from export.pipeline import export_model

    from conftest import tiny_export_options

    model = tmp_path / "nodrafter"  # for --modes model: an export without a drafter graph
    export_model(tiny_llama_dir, model, tiny_export_options(drafters=(), parity=False), progress=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "qa", "turns": ["hi"]}) + "\n")
    r = _run(["edge.tools.bench", str(prompts), "--model", str(model), "--out", str(tmp_path / "o.json"), *flags])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr, r.stderr
    assert not (tmp_path / "o.json").exists()


def test_bench_output_problems_found_before_running_and_md_never_overwrites_json(model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "qa", "turns": ["hi"]}) + "\n")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bad in (tmp_path, a_file / "o.json"):  # a directory; a path under a file
        r = _run(["edge.tools.bench", str(prompts), "--model", model, "--reps", "1", "--max-tokens", "4", "--out", str(bad)])
        assert r.returncode == 2 and "Traceback" not in r.stderr and "--out" in r.stderr, r.stderr
        assert "decode" not in r.stdout  # refused before any run
    r = _run(["edge.tools.bench", str(prompts), "--model", model, "--reps", "1", "--max-tokens", "4", "--modes", "none",
              "--out", str(tmp_path / "r.md"), "--quiet"])
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "r.json").read_text())["summary"]
    assert (tmp_path / "r.md").read_text().startswith("| category |")


def test_output_checks_probe_the_file_system(tmp_path, monkeypatch):
    """edge.files: a directory that refuses new files (a read-only mount; root passes permission checks, so the
    refusal is simulated) is named with the file system's reason, for an output file and for a directory."""
    import errno
    import tempfile

    from edge.files import unwritable, unwritable_dir

    assert unwritable(tmp_path / "new" / "o.json") is None and (tmp_path / "new").is_dir()
    assert "is a directory" in unwritable(tmp_path)

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    assert unwritable(tmp_path / "o.json") == f"cannot write in {tmp_path} (Read-only file system)"
    assert unwritable_dir(tmp_path / "d") == f"cannot write in {tmp_path / 'd'} (Read-only file system)"


def test_soak_bad_flags_fail_before_running(tmp_path):
    for flags, needle in ((["--turns", "0"], "--turns"), (["--every", "0"], "--every"), (["--group", "0"], "--group"),
                          (["--drafter", "bogus"], "--drafter"), (["--max-tokens", "0"], "--max-tokens"),
                          (["--model-dir", str(tmp_path / "nope")], "no such model directory")):
        r = _run(["edge.tools.soak", *flags], timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (flags, r.stderr)
        assert needle in r.stderr, (flags, r.stderr)


def test_engine_flags_shared_by_chat_and_serve():
    """Every engine drafter is selectable from edge-chat, and edge-serve takes exactly the engine flags that are
    edge.load keywords (one definition in edge.args.add_engine_args)."""
    import inspect

    import edge
    from edge.chat import _parser as chat_parser
    from edge.engine import DRAFTERS
    from edge.server.app import _parser as serve_parser

    for d in DRAFTERS:
        assert chat_parser().parse_args(["--drafter", d]).drafter == d
    load_kw = set(inspect.signature(edge.load).parameters) - {"model_dir"}  # edge-chat: --model
    chat = {a.dest for a in chat_parser()._actions} & load_kw
    serve = {a.dest for a in serve_parser()._actions} & load_kw
    assert chat == serve and {"drafter", "threads", "context", "budget_mb"} <= serve


def test_bench_repeats_never_draft_from_their_own_answers(model, tmp_path):
    """Every repeat of a prompt starts from the same drafter state (what earlier prompts taught): with a fixed draft
    length the recycling runs of one prompt draft and accept exactly alike. Without the reset, a repeat recalls the
    answer an earlier repeat (or the `none` run) fed into Token Recycling's tables."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"x{i}", "category": "qa", "turns": [t]})
                                 for i, t in enumerate(["the quick brown fox", "one two three four"])) + "\n")
    out = tmp_path / "b.json"
    r = _run(["edge.tools.bench", str(prompts), "--model", model, "--reps", "3", "--max-tokens", "24", "--modes",
              "none,recycling", "--draft-len", "4", "--out", str(out), "--quiet"])
    assert r.returncode == 0, r.stderr
    runs = json.loads(out.read_text())["runs"]
    for pid in ("x0", "x1"):
        rec = [(x["drafted"], x["accepted"], x["tokens"]) for x in runs if x["id"] == pid and x["mode"] == "recycling"]
        assert len(rec) == 3 and rec[0] == rec[1] == rec[2], rec


def test_bench_cold_prompts_draft_as_if_first(model, tmp_path):
    """--cold: every prompt starts from a fresh drafter state, so a prompt drafts and accepts exactly as it does when
    it is the only prompt; the JSON reports what each kind of drafted token earned."""
    texts = ["the quick brown fox jumps over the lazy dog"] * 2  # warm, the second would recall the first's answer
    prompts, alone = tmp_path / "p.jsonl", tmp_path / "alone.jsonl"
    items = [json.dumps({"id": f"x{i}", "category": "qa", "turns": [t]}) for i, t in enumerate(texts)]
    prompts.write_text("\n".join(items) + "\n")
    alone.write_text(items[1] + "\n")
    got = {}
    for name, f, flags in (("both", prompts, ["--cold"]), ("alone", alone, ["--cold"]), ("warm", prompts, [])):
        out = tmp_path / f"{name}.json"
        r = _run(["edge.tools.bench", str(f), "--model", model, "--reps", "1", "--max-tokens", "24", "--modes",
                  "none,recycling", "--draft-len", "4", "--out", str(out), "--quiet"] + flags)
        assert r.returncode == 0, r.stderr
        doc = json.loads(out.read_text())
        got[name] = [(x["drafted"], x["accepted"]) for x in doc["runs"] if x["id"] == "x1" and x["mode"] == "recycling"]
    assert got["both"] == got["alone"], got
    assert got["warm"] != got["alone"], got  # the control: without --cold the first prompt taught the second
    out = tmp_path / "adaptive.json"  # adaptive lengths: drafts priced (and counted) per kind of token
    r = _run(["edge.tools.bench", str(prompts), "--model", model, "--reps", "1", "--max-tokens", "24", "--modes",
              "none,lookup", "--cold", "--out", str(out), "--quiet"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    learned = doc["token_acceptance"]
    assert learned and all(0 <= v["lifetime"] <= 1 and v["n"] > 0 for v in learned.values()), learned
    # every accepted draft token is a hit; spans priced too low to verify are scored against the target too, so
    # there are hits even when the adaptive length (priced by this machine's measured call times) verified few
    # (25 runs of this command here: 1 to 18 accepted, 18 to 29 hits)
    hits = sum(round(v["lifetime"] * v["n"]) for v in learned.values())
    accepted = [(x["id"], x["drafted"], x["accepted"]) for x in doc["runs"] if x["mode"] == "lookup"]
    assert hits >= sum(a for _, _, a in accepted) and hits > 0, (hits, accepted, learned)


def test_drafter_state_round_trip(model):
    import numpy as np

    import edge

    e = edge.load(model, drafter="none", context=256)
    e.generate("the quick brown fox", max_tokens=8, drafter="recycling")
    state = e.drafter_state()
    adj = e.recycling.adj.copy()
    e.generate("one two three four five", max_tokens=8, drafter="recycling")
    assert not np.array_equal(e.recycling.adj, adj)  # the second answer taught it something
    e.set_drafter_state(state)
    assert np.array_equal(e.recycling.adj, adj)
    e.recycling.adj[:] = 0  # the snapshot is a copy, not the live tables
    e.set_drafter_state(state)
    assert np.array_equal(e.recycling.adj, adj)


def _peer_prompts(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"x{i}", "category": c, "turns": t}) for i, (c, t) in enumerate(
        [("qa", ["the quick brown fox"]), ("code", ["def add(a, b):", "now subtract"])])) + "\n")
    return prompts


def test_bench_peer_joins_the_rotation_on_the_same_ids(model, tmp_path):
    """--peer-model: the peer's greedy and n-gram modes run each first turn on the ids edgespec's template gives;
    its n-gram answers are compared with its own greedy ones, and every edgespec mode with its best mode."""
    out = tmp_path / "b.json"
    r = _run(["edge.tools.bench", str(_peer_prompts(tmp_path)), "--model", model, "--reps", "2", "--max-tokens", "9",
              "--modes", "none,lookup", "--peer-model", str(tmp_path), "--out", str(out), "--quiet"],
             env={"PYTHONPATH": FAKE_GENAI})
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["modes"] == ["none", "lookup", "genai", "genai-ngram"] and doc["peer"]["version"] == "0.0-fake"
    runs = doc["runs"]
    import edge

    engine = edge.load(model, drafter="none")
    for pid, first in (("x0", "the quick brown fox"), ("x1", "def add(a, b):")):
        ids = engine.encode([{"role": "user", "content": first}])  # what a chat's first turn sends
        assert {r["prompt_tokens"] for r in runs if r["id"] == pid and r["mode"] == "none" and r["turn"] == 0} \
            == {len(ids)}
        for mode, ngram in (("genai", False), ("genai-ngram", True)):
            theirs = [r for r in runs if r["id"] == pid and r["mode"] == mode]
            assert len(theirs) == 2 and all(r["tokens"] == fake_genai.answer(ids, 9, ngram) and r["n_gen"] == 9
                                            for r in theirs)
    assert not [r for r in runs if r["mode"].startswith("genai") and r["turn"] > 0]  # the peer runs first turns
    s = doc["summary"]
    assert set(s["code+turn2"]) == {"none", "lookup"}
    for c in ("qa", "code"):
        assert s[c]["genai-ngram"]["identical_to_own_greedy"] == "0/1"  # the fake's n-gram changes a token
        assert s[c]["genai"]["identical_to_own_greedy"] is None and "identical_to_none" not in s[c]["genai"]
        assert s[c]["lookup"]["identical_to_none"] == "1/1"
        first = next(r["tokens"] for r in runs if r["category"] == c and r["mode"] == "genai")
        assert s[c]["genai"]["looping"] == f"{int(loops(first))}/1"
        vs = doc["versus_peer"][c]
        assert vs["peer_best"] in ("genai", "genai-ngram") and set(vs) == {"peer_best", "none", "lookup"}
        best = [r["decode_tok_s"] for r in runs if r["category"] == c and r["mode"] == vs["peer_best"]]
        none = [r["decode_tok_s"] for r in runs if r["category"] == c and r["mode"] == "none"]
        assert len(none) == len(best) == 2  # one prompt per category: the median of 2 repeats is their mean
        assert vs["none"] == pytest.approx(sum(none) / sum(best), abs=1e-3)
    md = out.with_suffix(".md").read_text()
    assert "same as genai" in md and "| category | peer's best mode | none × peer best | lookup × peer best |" in md


@pytest.mark.parametrize("flags,env,needle", [
    (["--peer-model", "{tmp}"], {"PYTHONPATH": "{tmp}/broken"}, "cannot import onnxruntime_genai"),
    (["--peer-model", "{tmp}"], {"PYTHONPATH": FAKE_GENAI, "FAKE_GENAI_FAIL_AFTER": "0"}, "fake failure"),  # warm-up
    (["--peer-python", "/usr/bin/python3"], {}, "--peer-python needs --peer-model"),
    (["--peer-model", "{tmp}", "--peer-python", "/bin/echo"], {}, "not edge/tools/peer_genai.py's protocol"),
    (["--peer-model", "{tmp}/missing"], {"PYTHONPATH": FAKE_GENAI}, "cannot load"),
    (["--peer-model", "{tmp}", "--peer-python", "/nonexistent/python"], {}, "cannot start /nonexistent/python"),
    (["--modes", "none,genai"], {}, "genai modes need --peer-model"),
    (["--peer-model", "{tmp}", "--temp", "0.7"], {"PYTHONPATH": FAKE_GENAI}, "greedy decoding only"),
])
def test_bench_peer_problems_are_one_line(model, tmp_path, flags, env, needle):
    (tmp_path / "broken" / "onnxruntime_genai").mkdir(parents=True)  # a Python whose onnxruntime_genai is broken
    (tmp_path / "broken" / "onnxruntime_genai" / "__init__.py").write_text("raise ImportError('no native library')")
    flags = [f.format(tmp=tmp_path) for f in flags]
    env = {k: v.format(tmp=tmp_path) for k, v in env.items()}
    r = _run(["edge.tools.bench", str(_peer_prompts(tmp_path)), "--model", model, "--reps", "1", "--max-tokens", "4",
              "--out", str(tmp_path / "b.json"), "--quiet", *flags], env=env)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "b.json").exists()


def test_bench_peer_failing_midway_keeps_what_ran(model, tmp_path):
    """A peer that dies after its warm-up and two answers: the runs so far are summarized and written, exit 1."""
    out = tmp_path / "b.json"
    r = _run(["edge.tools.bench", str(_peer_prompts(tmp_path)), "--model", model, "--reps", "2", "--max-tokens", "6",
              "--modes", "none", "--peer-model", str(tmp_path), "--out", str(out), "--quiet"],
             env={"PYTHONPATH": FAKE_GENAI, "FAKE_GENAI_FAIL_AFTER": "3"})
    assert r.returncode == 1 and "the peer failed (onnxruntime-genai failed: fake failure)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(out.read_text())
    assert sum(r["mode"].startswith("genai") for r in doc["runs"]) == 2 and doc["summary"]["code"]["none"]


@pytest.mark.parametrize("tokens,looping", [
    ([], False), (list(range(7)) * 5, True), (list(range(8)) * 3, True), (list(range(8)) * 2 + list(range(7)), False),
    ([5, 6] * 12, True), (list(range(100)), False), (list(range(9)) * 2, False),
])
def test_bench_counts_looping_answers(tokens, looping):
    """An answer loops when some 8-token sequence occurs 3 times (overlaps count: a 2-token cycle loops)."""
    assert loops(tokens) is looping


def test_bench_peer_answers_that_end_count_their_end_token(model, tmp_path):
    """onnxruntime-genai 0.18 leaves the end token out of its sequence; edgespec counts its own, so the peer's
    n_gen (and tok/s) must count it too: an answer of 4 tokens that ended is 5 generated."""
    out = tmp_path / "b.json"
    r = _run(["edge.tools.bench", str(_peer_prompts(tmp_path)), "--model", model, "--reps", "1", "--max-tokens", "9",
              "--modes", "none,genai", "--peer-model", str(tmp_path), "--out", str(out), "--quiet"],
             env={"PYTHONPATH": FAKE_GENAI, "FAKE_GENAI_EOS_AFTER": "4"})
    assert r.returncode == 0, r.stderr
    theirs = [r for r in json.loads(out.read_text())["runs"] if r["mode"] == "genai"]
    assert theirs and all(len(r["tokens"]) == 4 and r["n_gen"] == 5 and
                          r["decode_tok_s"] == pytest.approx(4 / r["decode_s"]) for r in theirs)


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


def test_bench_peer_changes_nothing_about_our_own_runs(model, tmp_path):
    """The peer joins the rotation but teaches edgespec's drafters nothing, and it must not stop a prompt from
    teaching them: with 5 modes, prompts whose rotation starts with a peer mode used to pass on the state from
    before the prompt. Every edgespec run drafts and accepts exactly as in the same bench without the peer."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "qa", "turns": [t]}) + "\n" for i, t in enumerate(
        ["the quick brown fox jumps over the lazy dog", "the quick brown fox jumps", "a lazy dog sleeps over the "
         "quick brown fox", "the lazy dog and the quick brown fox", "quick brown fox, lazy dog"])))
    counts = []
    for peer in ([], ["--peer-model", str(tmp_path)]):
        out = tmp_path / f"b{len(peer)}.json"
        r = _run(["edge.tools.bench", str(prompts), "--model", model, "--reps", "2", "--max-tokens", "24", "--modes",
                  "none,recycling,hybrid", *peer, "--out", str(out), "--quiet"], env={"PYTHONPATH": FAKE_GENAI})
        assert r.returncode == 0, r.stderr
        counts.append({(r["id"], r["mode"], r["rep"]): (r["drafted"], r["accepted"], r["steps"])
                       for r in json.loads(out.read_text())["runs"] if not r["mode"].startswith("genai")})
    assert len(counts[0]) == 30 and counts[0] == counts[1]
