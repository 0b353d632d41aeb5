"""The load tool (edge/tools/serve_load.py): nearest-rank percentiles, loopback targets, and its accounting of every
request sent (answered, refused, lost, malformed) against a scripted `_post` and a fake clock or a misbehaving socket;
the conversation mode's resent history and prefill figures; the CLI's defaults and exit status."""
from __future__ import annotations

import json
import random
import socket
import threading
from types import SimpleNamespace

import pytest

from edge.tools import serve_load


def _nearest_rank(xs, q):
    """The smallest value with at least q% of the values at or below it (the minimum for q = 0)."""
    s = sorted(xs)
    return next(x for x in s if sum(y <= x for y in s) * 100 >= q * len(s))


def test_percentile_is_nearest_rank():
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 10, 20, 101):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 1, 10, 25, 50, 90, 95, 99, 99.9, 100):
            assert serve_load.percentile(xs, q) == _nearest_rank(xs, q), (n, q)
    assert serve_load.percentile([], 50) is None


def test_target_takes_loopback_names_and_http_default_port():
    assert serve_load._target("http://localhost") == ("localhost", 80)
    assert serve_load._target("http://[::1]:9000/") == ("::1", 9000)
    with pytest.raises(ValueError):
        serve_load._target("http://example.com:8080")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now


def _scripted(monkeypatch, script):
    """serve_load's _post answers from `script` in order: (status, body, seconds) or an exception to raise; the
    clock advances by those seconds. Returns the request bodies sent."""
    clock, sent, it = Clock(), [], iter(script)
    monkeypatch.setattr(serve_load, "time", SimpleNamespace(perf_counter=clock.perf_counter))

    def post(host, port, body, timeout):
        sent.append(json.loads(json.dumps(body)))  # as sent: the caller may change its lists later
        step = next(it)
        if isinstance(step, Exception):
            raise step
        status, obj, seconds = step
        clock.now += seconds
        return status, obj

    monkeypatch.setattr(serve_load, "_post", post)
    return sent


OK = {"choices": [{"message": {"content": "x"}}]}


ERR = {"error": {"message": "busy"}}


def test_load_summary_counts_and_percentiles(monkeypatch):
    ok_s = [0.4, 0.1, 0.9, 0.3, 1.0, 0.2, 0.8, 0.5, 0.7, 0.6]  # ten answers: p90 and p99 differ
    busy_s = [0.02, 0.005, 0.015, 0.01]
    script = [(200, OK, s) for s in ok_s[:5]] + [(503, ERR, s) for s in busy_s]
    script += [ConnectionRefusedError("refused"), (200, {"unexpected": 1}, 0.05), (500, None, 0.03)]
    script += [(200, OK, s) for s in ok_s[5:]]
    _scripted(monkeypatch, script)
    out = serve_load.run_load("http://127.0.0.1:1", concurrency=1, requests=len(script), timeout=5)
    ok_all = ok_s + [0.05]  # the malformed 200 is still a 200
    assert out["sent"] == len(script) == 17 and out["lost"] == 1 and out["malformed_bodies"] == 2
    assert out["status"] == {"200": 11, "500": 1, "503": 4} and (out["answered_200"], out["rejected_503"]) == (11, 4)

    def ms(xs, q):
        return round(1000 * _nearest_rank(xs, q), 1)

    assert out["latency_ms_200"] == {"p50": ms(ok_all, 50), "p90": ms(ok_all, 90), "p99": ms(ok_all, 99),
                                     "max": 1000.0}
    assert out["latency_ms_503"] == {"p50": ms(busy_s, 50), "p99": ms(busy_s, 99)}


def test_load_max_is_the_slowest_answer_past_a_hundred(monkeypatch):
    seconds = [0.001 * k for k in range(1, 151)]
    random.Random(1).shuffle(seconds)
    _scripted(monkeypatch, [(200, OK, s) for s in seconds])
    out = serve_load.run_load("http://127.0.0.1:1", concurrency=1, requests=150, timeout=5)
    assert (out["latency_ms_200"]["p99"], out["latency_ms_200"]["max"]) == (149.0, 150.0)  # rank ceil(148.5), 150


def test_a_request_without_an_answer_in_time_is_lost():
    with socket.socket() as mute:  # accepts connections (backlog), never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        res = {}
        th = threading.Thread(target=lambda: res.update(serve_load.run_load(
            f"http://127.0.0.1:{mute.getsockname()[1]}", concurrency=1, requests=1, timeout=0.3)), daemon=True)
        th.start()
        th.join(15)
        assert not th.is_alive(), "the load tool waited past its timeout"
    assert res["lost"] == 1 and res["sent"] == 1 and res["status"] == {}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_every_request_sent_is_accounted_for():
    """A server that closes mid-answer: each request is an HTTP status or lost, and the run is not a success."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def answer_half():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c, c.makefile("rb") as f:  # read the whole request, so closing sends no reset
                length = 0
                while (line := f.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                f.read(length)
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"ch")
                c.shutdown(socket.SHUT_WR)  # the answer ends 96 bytes short
                f.read()  # until the client closes

    threading.Thread(target=answer_half, daemon=True).start()
    try:
        out = serve_load.run_load(f"http://127.0.0.1:{srv.getsockname()[1]}", concurrency=1, requests=2, timeout=5)
    finally:
        srv.close()
    assert sum(out["status"].values()) + out["lost"] == out["sent"] == 2
    assert out["lost"] + out["malformed_bodies"] > 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_answer_that_is_not_an_object_is_malformed(monkeypatch):
    _scripted(monkeypatch, [(200, 5, 0.01), (503, ["busy"], 0.01), (200, OK, 0.01)])
    out = serve_load.run_load("http://127.0.0.1:1", concurrency=1, requests=3, timeout=5)
    assert out["status"] == {"200": 2, "503": 1} and out["malformed_bodies"] == 2


def test_conversation_without_a_server_is_one_error_line(capsys):
    with socket.socket() as s:  # bound, not listening: connections are refused
        s.bind(("127.0.0.1", 0))
        assert serve_load.main(["--turns", "1", "--url", f"http://127.0.0.1:{s.getsockname()[1]}"]) == 2
    assert "serve_load: error:" in capsys.readouterr().err


def test_conversation_resends_the_answers_and_reports_prefill(monkeypatch):
    usage = [(20, 0), (45, 18), (70, 43)]  # (prompt tokens, cached) per turn
    script = [(200, {"choices": [{"message": {"content": f"answer {i}"}}],
                     "usage": {"prompt_tokens": p, "prompt_tokens_details": {"cached_tokens": c}},
                     "edgespec": {"prefill_ms": 1.5}}, 0.1) for i, (p, c) in enumerate(usage)]
    sent = _scripted(monkeypatch, script)
    out = serve_load.run_conversation("http://127.0.0.1:1", turns=3, max_tokens=8)
    assert [t["prefilled"] for t in out["turns"]] == [20, 27, 27] and out["prefilled_total"] == 74
    assert out["prompt_tokens_total"] == 135 and out["prefill_ms_total"] == 4.5
    msgs = sent[2]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in msgs if m["role"] == "assistant"] == ["answer 0", "answer 1"]


def test_load_cli_defaults_limits_and_exit_status(monkeypatch, capsys):
    reply = {"choices": [{"message": {"content": "a"}}], "usage": {"prompt_tokens": 5, "prompt_tokens_details":
             {"cached_tokens": 0}}, "edgespec": {"prefill_ms": 1.0}}
    sent = _scripted(monkeypatch, [(200, reply, 0.01)] * 2)
    assert serve_load.main(["--turns", "2"]) == 0
    assert [(b["max_tokens"], b["temperature"]) for b in sent] == [(48, 0), (48, 0)]  # greedy: comparable runs
    sent = _scripted(monkeypatch, [(200, OK, 0.01)])
    assert serve_load.main(["--concurrency", "1", "--requests", "1"]) == 0
    assert (sent[0]["max_tokens"], sent[0]["temperature"]) == (16, 0)
    _scripted(monkeypatch, [(200, reply, 0.01), (503, ERR, 0.01)])
    assert serve_load.main(["--turns", "2"]) == 2  # a turn refused: one error line, not a traceback
    assert "turn 2: HTTP 503" in capsys.readouterr().err
    _scripted(monkeypatch, [(200, {"no": "choices"}, 0.01)])
    assert serve_load.main(["--concurrency", "1", "--requests", "1"]) == 1  # a malformed body fails the run
    assert serve_load.main(["--requests", "1001"]) == 2
    capsys.readouterr()
