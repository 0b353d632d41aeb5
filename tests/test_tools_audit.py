"""The measuring tools around the runtime, unit by unit with fakes: edge.tools.memprobe's peak RSS (VmHWM, KiB, whose
peak), its filler text and one measurement; edge.tools.peer's side of the peer protocol against scripted workers;
edge.tools.peer_genai's worker against the fake onnxruntime_genai; edge.tools.soak's loop against a scripted engine."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from edge import measure
from edge.tools import memprobe, peer, peer_genai, soak

FAKE_GENAI = str(Path(__file__).with_name("fake_genai"))
_spec = importlib.util.spec_from_file_location("fake_genai", Path(FAKE_GENAI) / "onnxruntime_genai" / "__init__.py")
fake_og = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_og)

# ----------------------------------------------------------------------------- edge.tools.memprobe


def _fake_proc(monkeypatch, status: str | None, self_kib: int, children_kib: int, platform: str = "linux"):
    """/proc/self/status reads `status` (None: no such file); getrusage reports the given ru_maxrss values."""
    writes = []

    def fake_open(path, mode="r"):
        if path == "/proc/self/status" and status is not None and mode == "r":
            return io.StringIO(status)
        if path == "/proc/self/clear_refs" and status is not None and mode == "w":
            buf = io.StringIO()
            buf.close = lambda: writes.append(buf.getvalue())
            return buf
        raise FileNotFoundError(path)

    usage = {0: self_kib, -1: children_kib}
    fake_resource = SimpleNamespace(RUSAGE_SELF=0, RUSAGE_CHILDREN=-1,
                                    getrusage=lambda who: SimpleNamespace(ru_maxrss=usage[who]))
    monkeypatch.setattr(measure, "open", fake_open, raising=False)
    monkeypatch.setattr(measure, "resource", fake_resource)
    monkeypatch.setattr(sys, "platform", platform)
    return writes


STATUS = "Name:\tpython\nVmPeak:\t 900000 kB\nVmHWM:\t   5000 kB\nVmRSS:\t   3000 kB\n"


def test_peak_rss_is_vmhwm_in_kib_not_the_current_rss_or_ru_maxrss(monkeypatch):
    _fake_proc(monkeypatch, STATUS, self_kib=9000, children_kib=1)
    assert measure.peak_rss_bytes() == 5000 * 1024


def test_peak_rss_falls_back_to_ru_maxrss_in_kib_on_linux_and_bytes_on_macos(monkeypatch):
    _fake_proc(monkeypatch, None, self_kib=7000, children_kib=1)
    assert measure.peak_rss_bytes() == 7000 * 1024
    _fake_proc(monkeypatch, "Name:\tpython\nVmRSS:\t 3000 kB\n", self_kib=7000, children_kib=1)  # no VmHWM line
    assert measure.peak_rss_bytes() == 7000 * 1024
    _fake_proc(monkeypatch, None, self_kib=7000, children_kib=1, platform="darwin")
    assert measure.peak_rss_bytes() == 7000


def test_peak_rss_counts_the_largest_child_only_when_asked(monkeypatch):
    _fake_proc(monkeypatch, STATUS, self_kib=9000, children_kib=8000)
    assert measure.peak_rss_bytes() == 5000 * 1024
    assert measure.peak_rss_bytes(children=True) == 8000 * 1024
    _fake_proc(monkeypatch, STATUS, self_kib=9000, children_kib=10)
    assert measure.peak_rss_bytes(children=True) == 5000 * 1024


def test_reset_peak_rss_writes_5_to_clear_refs_and_says_when_it_cannot(monkeypatch):
    writes = _fake_proc(monkeypatch, STATUS, 1, 1)
    assert measure.reset_peak_rss() is True and writes == ["5"]
    _fake_proc(monkeypatch, None, 1, 1)  # no /proc (macOS) or not writable
    assert measure.reset_peak_rss() is False


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

# ----------------------------------------------------------------------------- edge.tools.peer


def _worker(tmp_path, body: str) -> str:
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
    p = peer.Peer(_worker(tmp_path, 'print(json.dumps({"ready": "1"}), flush=True)\ntime.sleep(60)\n'), "m", 1)
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
        peer.Peer(_worker(tmp_path, body), "m", 1)
    assert needle in str(e.value), e.value
    if "exited" in needle:
        assert str(e.value).endswith("the last words") and len(str(e.value)) < 900  # the tail of its stderr


def test_peer_ready_with_any_version_is_ready(tmp_path):
    p = peer.Peer(_worker(tmp_path, 'print(json.dumps({"ready": ""}), flush=True)\nsys.stdin.read()\n'), "m", 1)
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
        peer.Peer(_worker(tmp_path, "sys.stdin.read()\n"), "m", 1)
    assert started and started[0].returncode is not None and started[0].stdout.closed


def test_peer_worker_gone_or_failing_a_request_is_a_peer_error(tmp_path):
    p = peer.Peer(_worker(tmp_path, 'print(json.dumps({"ready": "1"}), flush=True)\nsys.exit(5)\n'), "m", 1)
    p._p.wait()
    with pytest.raises(peer.PeerError, match="exited with code 5"):
        p.run([1, 2], 4, "genai")  # writing to it breaks the pipe: reported as its exit
    p.close()
    body = 'print(json.dumps({"ready": "1"}), flush=True)\nsys.stdin.readline()\n' \
           'print(json.dumps({"error": "onnxruntime-genai failed: boom"}), flush=True)\nsys.stdin.read()\n'
    p = peer.Peer(_worker(tmp_path, body), "m", 1)
    with pytest.raises(peer.PeerError, match="^onnxruntime-genai failed: boom$"):
        p.run([1, 2], 4, "genai")
    p.close()

# ----------------------------------------------------------------------------- edge.tools.peer_genai (the worker)


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

# ----------------------------------------------------------------------------- edge.tools.soak


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
