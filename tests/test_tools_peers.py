"""edge-bench's peer runtimes beside edgespec (edge/tools/peer*.py): several onnxruntime-genai folders and llama.cpp
(faked: tests/fake_genai, tests/fake_llama), each in its own worker process on the same token ids; transformers' fp32
greedy reference on a tiny checkpoint (tokens before divergence), prefill speed and each runtime's own peak RSS; the
peer protocol against scripted workers, and the onnxruntime-genai worker against the fake library."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from edge.tools import bench, peer, peer_genai, peer_llama
from helpers import run_module

HERE = Path(__file__).parent
FAKE_GENAI, FAKE_LLAMA = str(HERE / "fake_genai"), str(HERE / "fake_llama")


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fake_og = _load("fake_og", HERE / "fake_genai" / "onnxruntime_genai" / "__init__.py")
fake_llama = _load("fake_llama", HERE / "fake_llama" / "llama_cpp" / "__init__.py")


def _gguf(path: Path) -> str:
    path.write_bytes(b"GGUF" + bytes(12))
    return str(path)


# ----------------------------------------------------------------------------- mode names


@pytest.mark.parametrize("runtime, values, want", [
    ("genai", ["{d}/int4"], {"genai": "greedy", "genai-ngram": "ngram"}),  # one folder: the short names, as before
    ("genai", ["{d}/int4", "{d}/int8"], {"genai-int4": "greedy", "genai-int4-ngram": "ngram",
                                          "genai-int8": "greedy", "genai-int8-ngram": "ngram"}),
    ("genai", ["{d}/int4,{d}/int8"], {"genai-int4": "greedy", "genai-int4-ngram": "ngram",
                                       "genai-int8": "greedy", "genai-int8-ngram": "ngram"}),  # a comma list
    ("genai", ["q=/{d}/int4"], {"genai-q": "greedy", "genai-q-ngram": "ngram"}),  # a label: named even alone
    ("llama", ["{d}/model.Q4_1.gguf"], {"llama": "greedy"}),
    ("llama", ["{d}/a.gguf", "b={d}/x.gguf"], {"llama-a": "greedy", "llama-b": "greedy"}),
])
def test_peer_modes_are_named_by_runtime_and_label(tmp_path, runtime, values, want):
    for d in ("int4", "int8"):
        (tmp_path / d).mkdir()
    specs = peer.parse_peer_models(runtime, [v.format(d=tmp_path) for v in values], "py")
    assert {m: w for s in specs for m, w in s.modes.items()} == want
    assert all(s.python == "py" and s.runtime == runtime for s in specs)


@pytest.mark.parametrize("values, needle", [
    (["{d}/a/int4", "{d}/b/int4"], "would both be 'genai-int4'; give each its own label"),
    (["x={d}/a", "x={d}/b"], "would both be 'genai-x'"),
    (["ngram={d}/a"], "cannot name its modes 'genai-ngram'"),  # the n-gram mode of an unlabeled folder
    (["a-ngram={d}/a"], "not ending in '-ngram'"),
    (["a b={d}/a"], "give it a label of letters"),
    (["={d}/a"], "empty label before '='"),
])
def test_peer_labels_that_would_clash_are_refused_with_the_fix(tmp_path, values, needle):
    with pytest.raises(ValueError) as e:
        peer.parse_peer_models("genai", [v.format(d=tmp_path) for v in values], "py")
    assert needle in str(e.value), e.value


def test_a_path_containing_a_comma_or_an_equals_sign_is_taken_whole(tmp_path):
    d = tmp_path / "a=b,c"
    d.mkdir()
    (s,) = peer.parse_peer_models("genai", [str(d)], "py")
    assert s.path == str(d) and s.name == "genai"


@pytest.mark.parametrize("mode, is_peer, ref", [
    ("genai", True, None), ("genai-ngram", True, "genai"), ("genai-int8-ngram", True, "genai-int8"),
    ("llama", True, None), ("llama-q4", True, None), ("none", False, None), ("lookup", False, None),
    ("genaix", False, None),
])
def test_peer_modes_and_the_greedy_answers_their_ngram_mode_must_keep(mode, is_peer, ref):
    assert peer.is_peer_mode(mode) is is_peer and peer.peer_reference(mode) == ref


def test_gguf_file_problem_names_a_missing_or_foreign_file(tmp_path):
    assert "no such file" in peer.gguf_file_problem(str(tmp_path / "x.gguf"))
    (tmp_path / "w.safetensors").write_bytes(b"\x00" * 16)
    assert "not a GGUF file" in peer.gguf_file_problem(str(tmp_path / "w.safetensors"))
    assert peer.gguf_file_problem(_gguf(tmp_path / "m.gguf")) is None


# ----------------------------------------------------------------------------- the llama.cpp worker


class _Clock:
    def __init__(self, *times):
        self.times = iter(times)

    def __call__(self):
        return next(self.times)


def test_llama_generate_stops_at_the_end_token_counting_it_and_splits_prefill_from_decode(monkeypatch):
    llm = fake_llama.Llama(__file__, n_ctx=64)
    ids = [3, 4, 5]
    monkeypatch.setattr(peer_llama.time, "perf_counter", _Clock(1.0, 3.0, 10.0))  # start, first token, end
    monkeypatch.setenv("FAKE_LLAMA_EOS_AFTER", "4")
    out = peer_llama.generate(llm, ids, 9, {fake_llama.EOS})
    assert out["tokens"] == fake_llama.answer(ids, 4) and out["n_gen"] == 5  # the end token left out, counted
    assert (out["prefill_s"], out["decode_s"]) == (2.0, 7.0)
    monkeypatch.delenv("FAKE_LLAMA_EOS_AFTER")
    monkeypatch.setattr(peer_llama.time, "perf_counter", lambda: 0.0)
    out = peer_llama.generate(llm, ids, 6, {fake_llama.EOS})  # again: the cache is reset first (the fake insists)
    assert out["tokens"] == fake_llama.answer(ids, 6) and out["n_gen"] == 6  # the whole budget, no end token
    stop = fake_llama.answer(ids, 3)[2]  # edgespec's end tokens stop it too
    out = peer_llama.generate(llm, ids, 9, {fake_llama.EOS, stop})
    assert out["tokens"] == fake_llama.answer(ids, 2) and out["n_gen"] == 3


def _worker(script: str, model_arg: str, reqs: list[dict], env: dict, *args: str):
    r = subprocess.run([sys.executable, script, model_arg, *args], input="".join(json.dumps(q) + "\n" for q in reqs),
                       capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    return r, [json.loads(line) for line in r.stdout.splitlines()]


def test_llama_worker_protocol_context_threads_and_its_own_peak(tmp_path):
    log = tmp_path / "log"
    reqs = [{"ids": [1, 2], "max_new": 3, "mode": "greedy"}, {"ids": [1, 2], "max_new": 5, "mode": "greedy"}]
    r, lines = _worker(peer.LLAMA_WORKER, _gguf(tmp_path / "m.gguf"), reqs,
                       {"PYTHONPATH": FAKE_LLAMA, "FAKE_LLAMA_LOG": str(log), "FAKE_LLAMA_FAIL_AFTER": "1"},
                       "--threads", "3", "--context", "64")
    assert r.returncode == 0, r.stderr
    assert lines[0]["ready"] == "0.0-fake-llama" and lines[0]["peak_rss_mb"] > 1  # no library chatter on stdout
    assert lines[1]["tokens"] == fake_llama.answer([1, 2], 3) and lines[1]["peak_rss_mb"] > 1
    assert lines[2] == {"error": "llama.cpp failed: fake llama failure"} and len(lines) == 3
    assert json.loads(log.read_text()) == {"n_ctx": 64, "n_threads": 3, "n_threads_batch": 3, "verbose": False}


@pytest.mark.parametrize("env, needle", [
    ({"PYTHONPATH": "{tmp}/broken"}, "cannot import llama_cpp (no native library); install llama-cpp-python"),
    ({"PYTHONPATH": FAKE_LLAMA}, "llama.cpp cannot load {tmp}/missing.gguf: Model path does not exist"),
])
def test_llama_worker_that_cannot_start_says_why_in_one_line(tmp_path, env, needle):
    (tmp_path / "broken" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "broken" / "llama_cpp" / "__init__.py").write_text("raise ImportError('no native library')")
    r, lines = _worker(peer.LLAMA_WORKER, str(tmp_path / "missing.gguf"), [],
                       {k: v.format(tmp=tmp_path) for k, v in env.items()})
    assert r.returncode == 1 and len(lines) == 1 and needle.format(tmp=tmp_path) in lines[0]["error"], lines


# ----------------------------------------------------------------------------- the onnxruntime-genai worker


def test_genai_at_a_context_allocates_it_and_still_stops_after_max_new():
    """With --context its max_length is the context (the fake would then answer up to it); answers still stop
    after max_new tokens, and an end token before that is counted as before."""
    ids = [3, 4]
    made = []
    real = fake_og.GeneratorParams

    class Params(real):
        def __init__(self, model):
            super().__init__(model)
            made.append(self)

    og = SimpleNamespace(**{**vars(fake_og), "GeneratorParams": Params})
    out = peer_genai.generate(og, None, ids, 5, None, set(), context=64)
    assert made[-1].max_length == 64 and out["tokens"] == fake_og.answer(ids, 5) and out["n_gen"] == 5
    out = peer_genai.generate(og, None, ids, 5, {"ngram_size": 3}, set(), context=64)
    assert out["tokens"] == fake_og.answer(ids, 5, ngram=True)
    out = peer_genai.generate(og, None, ids, 5, None, set())  # no context: the prompt plus max_new, as before
    assert made[-1].max_length == 7 and out["n_gen"] == 5


@pytest.mark.parametrize("config, want", [
    ({"model": {"eos_token_id": 2}}, {2}), ({"model": {"eos_token_id": [2, 7]}}, {2, 7}),
    ({"model": {}}, set()), ([1, 2], set()), ("not json", set()), (None, set()),
])
def test_eos_ids_from_genai_config(tmp_path, config, want):
    if config is not None:
        (tmp_path / "genai_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    assert peer_genai.eos_ids(str(tmp_path)) == want


def test_eos_ids_of_an_unusable_value_are_none_not_a_crash(tmp_path):
    """A config naming no usable end token (null, text) is a peer without end tokens, not a worker traceback."""
    for value, want in ((None, set()), ("eos", set()), (True, set()), ([2, None, "x"], {2})):
        (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"eos_token_id": value}}))
        assert peer_genai.eos_ids(str(tmp_path)) == want, value


def test_generate_counts_an_end_token_left_out_of_the_sequence_once(monkeypatch):
    ids = [3, 4]
    monkeypatch.setenv("FAKE_GENAI_EOS_AFTER", "3")
    out = peer_genai.generate(fake_og, None, ids, 9, None, set())  # ended early: its end token is not in tokens
    assert out["tokens"] == fake_og.answer(ids, 3) and out["n_gen"] == 4
    last = out["tokens"][-1]
    out = peer_genai.generate(fake_og, None, ids, 9, None, {last})  # the sequence's own end token: counted once
    assert out["n_gen"] == 3
    monkeypatch.delenv("FAKE_GENAI_EOS_AFTER")
    out = peer_genai.generate(fake_og, None, ids, 9, None, set())  # the whole budget: no end token at all
    assert out["tokens"] == fake_og.answer(ids, 9) and out["n_gen"] == 9


def test_generate_splits_prefill_and_decode_time(monkeypatch):
    clock = iter([1.0, 3.0, 10.0])
    monkeypatch.setattr(peer_genai.time, "perf_counter", lambda: next(clock))
    out = peer_genai.generate(fake_og, None, [1], 2, None, set())
    assert (out["prefill_s"], out["decode_s"]) == (2.0, 7.0)


DRIVER = """
import json, sys
import onnxruntime_genai as og
from edge.tools import peer_genai

class Model:
    def __init__(self, cfg):
        print("a library's chatter", flush=True)  # on stdout: must not reach the protocol
        sys.stderr.write("OVERLAY " + json.dumps(cfg.overlays) + "\\n")

og.Model = Model
sys.argv = ["peer_genai.py", sys.argv[1], "--threads", "3"]
sys.exit(peer_genai.main())
"""


def test_worker_protocol_keeps_library_output_off_stdout_and_reports_failures_per_request(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([FAKE_GENAI, str(Path(peer.__file__).parents[1])]),
           "FAKE_GENAI_FAIL_AFTER": "1"}
    reqs = [{"ids": [1, 2], "max_new": 3, "mode": "greedy"}, {"ids": [1, 2], "max_new": 3, "mode": "ngram"}]
    r = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path)], input="".join(json.dumps(q) + "\n" for q in reqs),
                       capture_output=True, text=True, timeout=60, env=env)
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0, r.stderr
    assert lines[0]["ready"] == "0.0-fake" and lines[1]["tokens"] == fake_og.answer([1, 2], 3)
    assert lines[0]["peak_rss_mb"] > 1 and lines[1]["peak_rss_mb"] > 1  # the worker's own, loaded and per run
    assert lines[2] == {"error": "onnxruntime-genai failed: fake failure"} and len(lines) == 3
    overlay = json.loads(r.stderr.split("OVERLAY ")[1].splitlines()[0])
    assert overlay[0]["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 3


# ----------------------------------------------------------------------------- the fp32 reference worker


def _torch_greedy(hf_dir, ids, n, stop=()):
    """The slow reference: a full forward per token, no cache; stops before a `stop` token."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    seq = list(ids)
    with torch.no_grad():
        while len(seq) < len(ids) + n:
            t = int(m(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            if t in stop:
                break
            seq.append(t)
    return seq[len(ids):]


def test_reference_worker_is_fp32_greedy_with_the_cache_and_stops_at_end_tokens(tiny_llama_dir):
    ids = [1, 40, 41, 42, 43, 2]
    want = _torch_greedy(tiny_llama_dir, ids, 8)
    ref = peer.Peer(sys.executable, str(tiny_llama_dir), 1, worker=peer.HF_WORKER, modes={"fp32": "greedy"})
    try:
        assert ref.version.startswith("transformers ")
        assert ref.run(ids, 8, "fp32")["tokens"] == want
        stop = [t for t in want if t != want[0]][:1]  # an end token edgespec names cuts the answer there
        cut = want.index(stop[0]) if stop else len(want)
        assert ref.run(ids, 8, "fp32", stop=stop)["tokens"] == want[:cut]
    finally:
        ref.close()


def test_reference_worker_without_torch_or_a_checkpoint_is_one_peer_error(tmp_path):
    with pytest.raises(peer.PeerError, match="transformers cannot load"):
        peer.Peer(sys.executable, str(tmp_path), 1, worker=peer.HF_WORKER, modes={"fp32": "greedy"})


# ----------------------------------------------------------------------------- bookkeeping (pure)


@pytest.mark.parametrize("tokens, ref, want", [
    ([1, 2, 3], [1, 2, 3], (3, True)),
    ([1, 2, 3, 9], [1, 2, 3], (3, True)),  # edgespec keeps its end token (9) in the ids
    ([1, 2, 3], [1, 2, 3, 9], (3, True)),
    ([1, 5, 3], [1, 2, 3], (1, False)),
    ([1, 2], [1, 2, 3], (2, False)),  # stopped early: agrees as far as it goes, not the same answer
    ([], [], (0, True)),
    ([7], [1], (0, False)),
])
def test_agreement_counts_tokens_before_divergence_leaving_end_tokens_out(tokens, ref, want):
    assert bench.agreement(tokens, ref, {9}) == want


def _rec(pid, mode, rep, tok_s, tokens, turn=0, **kw):
    return {"id": pid, "turn": turn, "category": "qa", "mode": mode, "rep": rep, "decode_tok_s": tok_s,
            "mean_accepted": None, "overhead_ms_per_step": None, "target_s": None, "draft_s": None, "steps": None,
            "tokens": tokens, **kw}


def test_runtimes_are_first_turn_medians_with_fidelity_and_each_process_peak():
    runs = [_rec("a", "none", 0, 10.0, [1], prefill_tok_s=100.0, fp32_agreed=4, fp32_identical=True,
                 peak_rss_mb=300.0),
            _rec("a", "none", 1, 20.0, [1], prefill_tok_s=300.0, fp32_agreed=4, fp32_identical=True,
                 peak_rss_mb=310.0),
            _rec("b", "none", 0, 40.0, [1], prefill_tok_s=500.0, fp32_agreed=10, fp32_identical=False,
                 peak_rss_mb=305.0),
            _rec("b", "none", 0, 1000.0, [1], turn=1, prefill_tok_s=9e9, peak_rss_mb=320.0),  # a second turn
            _rec("a", "llama", 0, 30.0, [1], prefill_tok_s=50.0, fp32_agreed=2, fp32_identical=False,
                 peak_rss_mb=150.0),
            _rec("b", "llama", 0, 50.0, [1], prefill_tok_s=70.0, fp32_agreed=0, fp32_identical=False,
                 peak_rss_mb=None)]
    rows = bench.runtimes(runs, ["none", "lookup", "llama"], {"none": 400.0, "llama": 120.0},
                          {"none": "edgespec fp32 · none", "llama": "llama.cpp · greedy"})
    assert set(rows) == {"none", "llama"}  # lookup did not run
    none = rows["none"]
    assert none["decode_tok_s"] == 27.5 and none["prefill_tok_s"] == 350.0  # medians of (15, 40) and (200, 500)
    assert none["tokens_before_divergence"] == 7.0 and none["identical_to_fp32"] == "1/2" and none["prompts"] == 2
    assert none["peak_rss_mb"] == 400.0  # loading peaked above every run
    assert rows["llama"]["peak_rss_mb"] == 150.0 and rows["llama"]["tokens_before_divergence"] == 1.0
    md = bench.runtimes_markdown(rows, 4096)
    assert "peak RSS MB (context 4096)" in md and "| llama.cpp · greedy | 2 | 40.0 | 60.0 | 1.0 | 0/2 | 150.0 |" in md
    assert bench.runtimes([_rec("a", "none", 0, 10.0, [1])], ["none"])["none"]["tokens_before_divergence"] is None


class _Engine:
    context = 8
    eos = {2}
    manifest = SimpleNamespace(chat_template="T")

    def encode(self, prompt):  # a turn's text: one id a character
        return [1] * len(prompt)


def test_a_peer_prompt_that_does_not_fit_the_context_is_skipped_like_edgespecs():
    class Peer:
        def run(self, ids, max_new, mode, stop=None):
            self.asked = (max_new, stop)
            return {"tokens": [5, 2], "n_gen": 2, "decode_s": 1.0, "prefill_s": 0.5, "peak_rss_mb": 77.0}

    a, p = SimpleNamespace(max_tokens=100), Peer()
    (r,) = bench._run_peer(p, _Engine(), {"id": "x", "turns": ["abcde"]}, "llama", a, {"x": [5]})
    assert p.asked == (3, [2])  # what is left of the context; edgespec's end tokens
    assert r["peak_rss_mb"] == 77.0 and r["prefill_tok_s"] == 10.0 and r["fp32_agreed"] == 1 and r["fp32_identical"]
    with pytest.raises(bench.ContextFull):
        bench._run_peer(p, _Engine(), {"id": "x", "turns": ["abcdefgh"]}, "llama", a)


# ----------------------------------------------------------------------------- end to end (tiny model, fakes)


def _prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"id": f"x{i}", "category": c, "turns": t}) for i, (c, t) in enumerate(
        [("qa", ["the quick brown fox"]), ("code", ["def add(a, b):", "now subtract"])])) + "\n")
    return f


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    """Peer workers started by edge.tools.bench.main find the fake runtimes; the fp32 cache lives in tmp_path."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([FAKE_GENAI, FAKE_LLAMA]))
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    for v in ("FAKE_GENAI_FAIL_AFTER", "FAKE_GENAI_EOS_AFTER", "FAKE_LLAMA_EOS_AFTER", "FAKE_LLAMA_FAIL_AFTER"):
        monkeypatch.delenv(v, raising=False)
    for d in ("int4", "int8"):
        (tmp_path / "genai" / d).mkdir(parents=True)
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "llama.log"))
    return tmp_path


def test_bench_runs_every_peer_with_fidelity_prefill_and_each_runtimes_peak(model, tiny_llama_dir, fakes, capsys):
    out = fakes / "b.json"
    args = [str(_prompts(fakes)), "--model", model, "--reps", "2", "--max-tokens", "9", "--llama-model",
            f"q4={_gguf(fakes / 'm.gguf')}", "--llama-python", sys.executable, "--reference-hf", str(tiny_llama_dir),
            "--out", str(out), "--quiet"]
    genai = ["--modes", "none,lookup", "--peer-model", f"{fakes}/genai/int4,{fakes}/genai/int8"]
    assert bench.main(args + genai) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    peers = ["genai-int4", "genai-int4-ngram", "genai-int8", "genai-int8-ngram", "llama-q4"]
    assert doc["modes"] == ["none", "lookup"] + peers and doc["context"] == 256
    assert [p["name"] for p in doc["peers"]] == ["genai-int4", "genai-int8", "llama-q4"] and doc["peer"] is None
    assert [p["version"] for p in doc["peers"]] == ["0.0-fake", "0.0-fake", "0.0-fake-llama"]
    assert json.loads((fakes / "llama.log").read_text().splitlines()[0])["n_ctx"] == 256  # the engine's context
    import edge

    engine = edge.load(model, drafter="none")
    runs = doc["runs"]
    for pid, first in (("x0", "the quick brown fox"), ("x1", "def add(a, b):")):
        ids = engine.encode([{"role": "user", "content": first}])
        ref = _torch_greedy(tiny_llama_dir, ids, 9, engine.eos)
        for r in (r for r in runs if r["id"] == pid and r["turn"] == 0):
            want = {"genai-int4": fake_og.answer(ids, 9), "genai-int8": fake_og.answer(ids, 9),
                    "genai-int4-ngram": fake_og.answer(ids, 9, True), "genai-int8-ngram": fake_og.answer(ids, 9, True),
                    "llama-q4": fake_llama.answer(ids, 9)}.get(r["mode"], r["tokens"])
            assert r["tokens"] == want, r["mode"]
            assert r["fp32_agreed"] == bench.agreement(want, ref, engine.eos)[0], r["mode"]
            assert r["prefill_tok_s"] > 0 and r["peak_rss_mb"] > 1, r
        none = next(r for r in runs if r["id"] == pid and r["mode"] == "none")
        assert none["fp32_identical"] is True  # the fp32 export answers as transformers does
    assert not [r for r in runs if r["mode"] in peers and r["turn"] > 0]
    rt = doc["runtimes"]
    assert list(rt) == doc["modes"]
    assert rt["none"]["runtime"] == "edgespec fp32 · none" and rt["genai-int8-ngram"]["runtime"] == \
        "onnxruntime-genai int8 · n-gram" and rt["llama-q4"]["runtime"] == "llama.cpp q4 · greedy"
    assert rt["none"]["identical_to_fp32"] == "2/2"
    ours = [r["peak_rss_mb"] for r in runs if r["mode"] in ("none", "lookup")]
    assert doc["peak_rss_mb"] >= round(max(ours), 1) and rt["none"]["peak_rss_mb"] <= doc["peak_rss_mb"]
    theirs = [r["peak_rss_mb"] for r in runs if r["mode"] == "llama-q4"] + [doc["peers"][2]["load_peak_rss_mb"]]
    assert rt["llama-q4"]["peak_rss_mb"] == max(theirs)  # the worker's own peak, not edge-bench's
    assert doc["summary"]["code"]["genai-int8-ngram"]["identical_to_own_greedy"] == "0/1"  # vs genai-int8's
    assert doc["summary"]["qa"]["llama-q4"]["prefill_tok_s"] > 0
    assert doc["reference"]["computed"] == 2 and doc["reference"]["cached"] == 0
    md = out.with_suffix(".md").read_text()
    assert "| edgespec fp32 · none | 2 | " in md and "| llama.cpp q4 · greedy | 2 |" in md
    # again: the fp32 answers come from the cache, so no reference worker is started at all
    assert bench.main(args + ["--reference-python", "/nonexistent/python", "--modes", "none"]) == 0
    doc2 = json.loads(out.read_text())
    assert doc2["reference"]["computed"] == 0 and doc2["reference"]["cached"] == 2
    assert doc2["modes"] == ["none", "llama-q4"] and [p["name"] for p in doc2["peers"]] == ["llama-q4"]
    assert doc2["runtimes"]["llama-q4"]["tokens_before_divergence"] == rt["llama-q4"]["tokens_before_divergence"]


def _without_chat_template(model_dir: Path) -> str:
    """The export as a base model's: no chat template in its manifest."""
    f = model_dir / "edge_model.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "chat_template": None}))
    return str(model_dir)


def test_bench_feeds_every_runtime_the_raw_prompt_of_a_model_without_a_chat_template(model_copy, fakes, capsys):
    base = _without_chat_template(model_copy)
    prompts = fakes / "raw.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "category": "code", "turns": [t]}) + "\n"
                               for i, t in enumerate(["def add(a, b):", "the quick brown fox"])))
    out = fakes / "b.json"
    assert bench.main([str(prompts), "--model", base, "--reps", "1", "--max-tokens", "6", "--modes", "none",
                       "--llama-model", _gguf(fakes / "m.gguf"), "--peer-model", f"{fakes}/genai/int4",
                       "--out", str(out), "--quiet"]) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["prompt_format"] == "raw" and doc["modes"] == ["none", "genai", "genai-ngram", "llama"]
    import edge

    engine = edge.load(base, drafter="none")
    for pid, text in (("r0", "def add(a, b):"), ("r1", "the quick brown fox")):
        ids = engine.encode(text, raw=True)
        assert ids == engine.codec.prefix + engine.codec.encode(text)  # the text itself, after its BOS rule
        runs = {r["mode"]: r for r in doc["runs"] if r["id"] == pid}
        assert {r["prompt_tokens"] for r in runs.values()} == {len(ids)}
        assert runs["none"]["tokens"] == engine.generate(text, raw=True, max_tokens=6, drafter="none").token_ids
        assert runs["genai"]["tokens"] == fake_og.answer(ids, 6)
        assert runs["llama"]["tokens"] == fake_llama.answer(ids, 6)


@pytest.mark.parametrize("extra, needle", [
    ([], "prompts x1 have several turns"),  # _prompts' code item is a chat of two turns
    (["--second-turn", "shorter"], "--second-turn adds a turn"),
])
def test_bench_refuses_chat_turns_for_a_model_without_a_chat_template(model_copy, fakes, capsys, extra, needle):
    prompts = _prompts(fakes)
    if extra:
        prompts.write_text(json.dumps({"id": "x0", "category": "qa", "turns": ["the quick brown fox"]}) + "\n")
    rc = bench.main([str(prompts), "--model", _without_chat_template(model_copy), "--reps", "1", "--max-tokens", "4",
                     "--out", str(fakes / "b.json"), "--quiet", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "has no chat template" in err and "Traceback" not in err, err
    assert not (fakes / "b.json").exists()


def test_bench_context_flag_sizes_every_runtime(model, fakes, capsys):
    out = fakes / "b.json"
    assert bench.main([str(_prompts(fakes)), "--model", model, "--reps", "1", "--max-tokens", "4", "--modes", "none",
                       "--llama-model", _gguf(fakes / "m.gguf"), "--context", "128", "--out", str(out),
                       "--quiet"]) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["context"] == 128 and doc["modes"] == ["none", "llama"]
    assert json.loads((fakes / "llama.log").read_text())["n_ctx"] == 128


def test_bench_llama_failing_midway_keeps_what_ran(model, fakes, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_FAIL_AFTER", "2")  # the warm-up and one answer
    out = fakes / "b.json"
    rc = bench.main([str(_prompts(fakes)), "--model", model, "--reps", "2", "--max-tokens", "4", "--modes",
                     "none,llama", "--llama-model", _gguf(fakes / "m.gguf"), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and "the peer failed (llama.cpp failed: fake llama failure)" in err, err
    assert sum(r["mode"] == "llama" for r in json.loads(out.read_text())["runs"]) == 1


@pytest.mark.parametrize("flags, needle", [
    (["--llama-python", "/usr/bin/python3"], "--llama-python needs --llama-model (a GGUF file)"),
    (["--reference-python", "/usr/bin/python3"], "--reference-python needs --reference-hf"),
    (["--reference-cache", "{tmp}/c.json"], "--reference-cache needs --reference-hf"),
    (["--llama-model", "{tmp}/none.gguf"], "--llama-model {tmp}/none.gguf: no such file"),
    (["--llama-model", "{tmp}/p.jsonl"], "--llama-model {tmp}/p.jsonl: not a GGUF file"),
    (["--peer-model", "{tmp}/g/a/int4", "--peer-model", "{tmp}/g/b/int4"], "would both be 'genai-int4'"),
    (["--modes", "none,llama"], "--modes llama: choose from"),
    (["--modes", "none,llama"], "llama modes need --llama-model"),
    (["--peer-model", "{tmp}/g/a/int4", "--peer-model", "{tmp}/g/b/int8", "--modes", "genai"],
     "choose from hybrid, recycling, model, lookup, none, genai-int4, genai-int4-ngram, genai-int8"),
    (["--llama-model", "{gguf}", "--temp", "0.5"], "--llama-model times greedy decoding only; drop --temp"),
    (["--reference-hf", "{tmp}"], "--reference-hf {tmp}: no config.json there"),
    (["--reference-hf", "{tmp}/g", "--temp", "0.5"], "--reference-hf compares greedy answers; drop --temp"),
])
def test_bad_peer_flags_are_refused_before_loading(tmp_path, capsys, monkeypatch, flags, needle):
    import edge

    def no_load(*a, **k):
        raise AssertionError("loaded the model before refusing the flags")

    monkeypatch.setattr(edge, "load", no_load)
    for d in ("a/int4", "b/int4", "b/int8"):
        (tmp_path / "g" / d).mkdir(parents=True)
    (tmp_path / "g" / "config.json").write_text("{}")
    prompts, gguf = _prompts(tmp_path), _gguf(tmp_path / "m.gguf")
    flags = [f.format(tmp=tmp_path, gguf=gguf) for f in flags]
    rc = bench.main([str(prompts), "--out", str(tmp_path / "b.json"), "--quiet", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and needle.format(tmp=tmp_path) in err and "Traceback" not in err, err
    assert not (tmp_path / "b.json").exists()


def test_the_fp32_cache_key_follows_the_weights_not_other_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 8)
    before = bench._reference_fingerprint(str(tmp_path))
    (tmp_path / "cache.json").write_text("{}")  # a --reference-cache kept in the folder itself
    (tmp_path / "tokenizer.json").write_text("{}")
    assert bench._reference_fingerprint(str(tmp_path)) == before
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)  # re-exported weights: computed again
    assert bench._reference_fingerprint(str(tmp_path)) != before


# ----------------------------------------------------------------------------- genai in edge-bench's rotation

def _peer_prompts(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"x{i}", "category": c, "turns": t}) for i, (c, t) in enumerate(
        [("qa", ["the quick brown fox"]), ("code", ["def add(a, b):", "now subtract"])])) + "\n")
    return prompts


def test_bench_peer_joins_the_rotation_on_the_same_ids(model, tmp_path):
    """--peer-model: the peer's greedy and n-gram modes run each first turn on the ids edgespec's template gives;
    its n-gram answers are compared with its own greedy ones, and every edgespec mode with its best mode."""
    out = tmp_path / "b.json"
    r = run_module(["edge.tools.bench", str(_peer_prompts(tmp_path)), "--model", model, "--reps", "2",
                    "--max-tokens", "9", "--modes", "none,lookup", "--peer-model", str(tmp_path), "--out", str(out),
                    "--quiet"],
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
            assert len(theirs) == 2 and all(r["tokens"] == fake_og.answer(ids, 9, ngram) and r["n_gen"] == 9
                                            for r in theirs)
    assert not [r for r in runs if r["mode"].startswith("genai") and r["turn"] > 0]  # the peer runs first turns
    s = doc["summary"]
    assert set(s["code+turn2"]) == {"none", "lookup"}
    for c in ("qa", "code"):
        assert s[c]["genai-ngram"]["identical_to_own_greedy"] == "0/1"  # the fake's n-gram changes a token
        assert s[c]["genai"]["identical_to_own_greedy"] is None and "identical_to_none" not in s[c]["genai"]
        assert s[c]["lookup"]["identical_to_none"] == "1/1"
        first = next(r["tokens"] for r in runs if r["category"] == c and r["mode"] == "genai")
        assert s[c]["genai"]["looping"] == f"{int(bench.loops(first))}/1"
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
    r = run_module(["edge.tools.bench", str(_peer_prompts(tmp_path)), "--model", model, "--reps", "1",
                    "--max-tokens", "4", "--out", str(tmp_path / "b.json"), "--quiet", *flags], env=env)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "b.json").exists()


def test_bench_peer_failing_midway_keeps_what_ran(model, tmp_path):
    """A peer that dies after its warm-up and two answers: the runs so far are summarized and written, exit 1."""
    out = tmp_path / "b.json"
    r = run_module(["edge.tools.bench", str(_peer_prompts(tmp_path)), "--model", model, "--reps", "2",
                    "--max-tokens", "6", "--modes", "none", "--peer-model", str(tmp_path), "--out", str(out),
                    "--quiet"],
                   env={"PYTHONPATH": FAKE_GENAI, "FAKE_GENAI_FAIL_AFTER": "3"})
    assert r.returncode == 1 and "the peer failed (onnxruntime-genai failed: fake failure)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    doc = json.loads(out.read_text())
    assert sum(r["mode"].startswith("genai") for r in doc["runs"]) == 2 and doc["summary"]["code"]["none"]


def test_bench_peer_answers_that_end_count_their_end_token(model, tmp_path):
    """onnxruntime-genai 0.18 leaves the end token out of its sequence; edgespec counts its own, so the peer's
    n_gen (and tok/s) must count it too: an answer of 4 tokens that ended is 5 generated."""
    out = tmp_path / "b.json"
    r = run_module(["edge.tools.bench", str(_peer_prompts(tmp_path)), "--model", model, "--reps", "1",
                    "--max-tokens", "9", "--modes", "none,genai", "--peer-model", str(tmp_path), "--out", str(out),
                    "--quiet"],
                   env={"PYTHONPATH": FAKE_GENAI, "FAKE_GENAI_EOS_AFTER": "4"})
    assert r.returncode == 0, r.stderr
    theirs = [r for r in json.loads(out.read_text())["runs"] if r["mode"] == "genai"]
    assert theirs and all(len(r["tokens"]) == 4 and r["n_gen"] == 5 and
                          r["decode_tok_s"] == pytest.approx(4 / r["decode_s"]) for r in theirs)


def test_bench_peer_changes_nothing_about_our_own_runs(model, tmp_path):
    """The peer joins the rotation but teaches edgespec's drafters nothing, and it must not stop a prompt from
    teaching them: with 5 modes, prompts whose rotation starts with a peer mode used to pass on the state from
    before the prompt. Every edgespec run drafts and accepts exactly as in the same bench without the peer."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "qa", "turns": [t]}) + "\n" for i, t in enumerate(
        ["the quick brown fox jumps over the lazy dog", "the quick brown fox jumps", "a lazy dog sleeps over the "
         "quick brown fox", "the lazy dog and the quick brown fox", "quick brown fox, lazy dog"])))
    counts = []
    for with_peer in ([], ["--peer-model", str(tmp_path)]):
        out = tmp_path / f"b{len(with_peer)}.json"
        r = run_module(["edge.tools.bench", str(prompts), "--model", model, "--reps", "2", "--max-tokens", "24",
                        "--modes", "none,recycling,hybrid", *with_peer, "--out", str(out), "--quiet"],
                       env={"PYTHONPATH": FAKE_GENAI})
        assert r.returncode == 0, r.stderr
        counts.append({(r["id"], r["mode"], r["rep"]): (r["drafted"], r["accepted"], r["steps"])
                       for r in json.loads(out.read_text())["runs"] if not r["mode"].startswith("genai")})
    assert len(counts[0]) == 30 and counts[0] == counts[1]


# ----------------------------------------------------------------------------- the protocol, scripted workers

def _fake_python(tmp_path, body: str) -> str:
    """A stand-in for the peer's Python: an executable that ignores its arguments and runs `body` (Python)."""
    script = tmp_path / "fakepython"
    script.write_text(f"#!{sys.executable}\nimport sys, json, time\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def genai_peer(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", FAKE_GENAI)
    monkeypatch.delenv("FAKE_GENAI_FAIL_AFTER", raising=False)
    monkeypatch.delenv("FAKE_GENAI_EOS_AFTER", raising=False)
    p = peer.Peer(sys.executable, str(tmp_path), 2)
    watchdog = threading.Timer(60, p._p.kill)  # a request that never reaches the worker fails, not hangs
    watchdog.start()
    yield p
    watchdog.cancel()
    p.close()


def test_peer_answers_each_mode_on_the_ids_sent(genai_peer):
    assert genai_peer.version == "0.0-fake"
    ids = [5, 6, 7]
    greedy = genai_peer.run(ids, 6, "genai")
    ngram = genai_peer.run(ids, 6, "genai-ngram")
    assert greedy["tokens"] == fake_og.answer(ids, 6) and greedy["n_gen"] == 6
    assert ngram["tokens"] == fake_og.answer(ids, 6, ngram=True) != greedy["tokens"]


def test_peer_close_kills_a_worker_that_does_not_exit_and_closes_its_files(tmp_path, monkeypatch):
    p = peer.Peer(_fake_python(tmp_path, 'print(json.dumps({"ready": "1"}), flush=True)\ntime.sleep(60)\n'), "m", 1)
    proc, wait = p._p, p._p.wait

    def impatient(timeout=None):
        if timeout is not None:
            raise subprocess.TimeoutExpired("fakepython", timeout)
        return wait()

    monkeypatch.setattr(proc, "wait", impatient)
    p.close()
    assert proc.returncode is not None and proc.stdout.closed and p._err.closed


@pytest.mark.parametrize("body, needle", [
    ('sys.stderr.write("x" * 2000 + " the last words")\nsys.exit(3)\n',
     "the peer worker exited with code 3: xxx"),
    ('print(json.dumps({"error": "cannot load it"}), flush=True)\n', "cannot load it"),
    ('print("[1, 2]", flush=True)\n', "printed '[1, 2]', not edge/tools/peer_genai.py's protocol"),
    ('print(json.dumps({"version": "1"}), flush=True)\n', "did not say it was ready"),
])
def test_peer_start_problems_are_one_peer_error(tmp_path, body, needle):
    with pytest.raises(peer.PeerError) as e:
        peer.Peer(_fake_python(tmp_path, body), "m", 1)
    assert needle in str(e.value), e.value
    if "exited" in needle:
        assert str(e.value).endswith("the last words") and len(str(e.value)) < 900  # the tail of its stderr


def test_peer_ready_with_any_version_is_ready(tmp_path):
    p = peer.Peer(_fake_python(tmp_path, 'print(json.dumps({"ready": ""}), flush=True)\nsys.stdin.read()\n'), "m", 1)
    assert p.version == ""
    p.close()


def test_peer_start_interrupted_leaves_no_worker(tmp_path, monkeypatch):
    started = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(peer.subprocess, "Popen", lambda *a, **k: started.append(real_popen(*a, **k)) or started[-1])

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(peer.Peer, "_read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        peer.Peer(_fake_python(tmp_path, "sys.stdin.read()\n"), "m", 1)
    assert started and started[0].returncode is not None and started[0].stdout.closed


def test_peer_worker_gone_or_failing_a_request_is_a_peer_error(tmp_path):
    p = peer.Peer(_fake_python(tmp_path, 'print(json.dumps({"ready": "1"}), flush=True)\nsys.exit(5)\n'), "m", 1)
    p._p.wait()
    with pytest.raises(peer.PeerError, match="exited with code 5"):
        p.run([1, 2], 4, "genai")  # writing to it breaks the pipe: reported as its exit
    p.close()
    body = 'print(json.dumps({"ready": "1"}), flush=True)\nsys.stdin.readline()\n' \
           'print(json.dumps({"error": "onnxruntime-genai failed: boom"}), flush=True)\nsys.stdin.read()\n'
    p = peer.Peer(_fake_python(tmp_path, body), "m", 1)
    with pytest.raises(peer.PeerError, match="^onnxruntime-genai failed: boom$"):
        p.run([1, 2], 4, "genai")
    p.close()
