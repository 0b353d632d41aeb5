"""edge-serve as a client sees it: a real server process on loopback, the official `openai` client and raw HTTP,
against the session's tiny exported llama. Outputs are compared with a fresh in-process engine (plain decoding)."""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import edge
from edge.engine import Chunk
from helpers import start_edge_serve
from edge.server.app import MAX_STOP, ApiError, Request, Job, Worker, parse_chat_request
from edge.tools.serve_load import run_conversation, run_load

MAX_QUEUE = 1  # small, so the load test meets the bounded queue


def _start_server(model_dir, *args, timeout=120.0):
    """`edge-serve --model-dir DIR --port P ARGS` → (process, port) once /health answers."""
    return start_edge_serve(model_dir, *args, timeout=timeout)


def _stop_server(proc) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def _request(port, method, path, body=None, raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _get(port, path):
    return _request(port, "GET", path)


def _post(port, body=None, raw=None):
    return _request(port, "POST", "/v1/chat/completions", body, raw)


def _idle(port, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = _get(port, "/health")[1]
        if not h["busy"] and not h["waiting"]:
            return h
        time.sleep(0.05)
    raise AssertionError(f"server still busy: {h}")


@pytest.fixture(scope="module")
def server(tiny_dir):
    proc, port = _start_server(tiny_dir, "--max-queue", MAX_QUEUE)
    yield port
    out = _stop_server(proc)
    assert "Traceback" not in out, out


@pytest.fixture
def client(server):
    import openai  # in the [test] extra: a broken install fails, never skips
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused", max_retries=0)


CONV = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "the quick brown fox"}]


# ------------------------------------------------------------------------------ the openai client

def test_openai_client_non_streaming_equals_engine(client, plain_reference):
    ref = plain_reference(CONV, max_tokens=24)
    r = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(plain_reference.engine.encode(CONV))
    ext = r.model_extra["edgespec"]
    assert {"drafter", "drafted", "accepted", "steps", "mean_accepted_len", "prompt_tokens_reused"} <= set(ext)
    assert 0 <= ext["accepted"] <= ext["drafted"] and ext["steps"] >= 1


def test_openai_client_streaming_equals_engine(client, plain_reference):
    ref = plain_reference(CONV, max_tokens=30)
    chunks = list(client.chat.completions.create(model="tiny", messages=CONV, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].model_extra["edgespec"]["steps"] >= 1


@pytest.mark.parametrize("drafter", ["none", "lookup", "model"])
def test_per_request_drafter_is_lossless(client, plain_reference, drafter):
    ref = plain_reference(CONV, max_tokens=20)
    r = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=20, temperature=0,
                                       extra_body={"edgespec": {"drafter": drafter, "draft_len": 3}})
    assert r.choices[0].message.content == ref.text
    ext = r.model_extra["edgespec"]
    assert ext["drafter"] == drafter and (ext["drafted"] == 0) == (drafter == "none")


@pytest.mark.parametrize("top_k", [None, 5])
def test_seeded_sampling_follows_the_request(client, plain_reference, top_k):
    kw = dict(max_tokens=20, temperature=0.9, top_p=0.8, seed=7)
    ref = plain_reference(CONV, **kw, **({} if top_k is None else {"top_k": top_k}))
    extra = {"edgespec": {"drafter": "none"}, **({} if top_k is None else {"top_k": top_k})}
    got = [client.chat.completions.create(model="tiny", messages=CONV, extra_body=extra, **kw).choices[0].message.content
           for _ in range(2)]
    assert got == [ref.text, ref.text]


def test_stop_string(client, plain_reference):
    full = plain_reference(CONV, max_tokens=24).text
    stop = next(full[i : i + 3] for i in range(4, len(full) - 3) if full[i : i + 3].strip())
    r = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].message.content == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_models_and_health(client, server, tiny_dir):
    name = edge.load(tiny_dir).manifest.name
    assert [m.id for m in client.models.list().data] == [name]
    assert _get(server, f"/v1/models/{name}")[0] == 200
    h = _get(server, "/health")
    assert h[0] == 200 and h[1]["status"] == "ok" and h[1]["model"] == name and h[1]["max_queue"] == MAX_QUEUE


# ------------------------------------------------------------------------------ conversation reuse

def test_conversation_reuse_prefills_only_new_tokens(client, plain_reference):
    first = client.chat.completions.create(model="tiny", messages=CONV, max_tokens=16, temperature=0)
    conv = CONV + [{"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "def add(a, b):"}]
    r = client.chat.completions.create(model="tiny", messages=conv, max_tokens=16, temperature=0)
    reused = r.usage.prompt_tokens_details.cached_tokens
    assert reused == r.model_extra["edgespec"]["prompt_tokens_reused"]
    assert reused >= len(plain_reference.engine.encode(CONV)) - 1  # at least the first request's prompt
    assert r.usage.prompt_tokens == len(plain_reference.engine.encode(conv)) > reused
    assert r.choices[0].message.content == plain_reference(conv, max_tokens=16).text


def test_conversation_command_reports_reuse_per_turn(server):
    out = run_conversation(f"http://127.0.0.1:{server}", turns=3, max_tokens=8)
    later = out["turns"][1:]
    assert len(out["turns"]) == 3 and all(0 < t["reused"] and t["prefilled"] < t["prompt_tokens"] for t in later)
    assert out["prefilled_total"] == sum(t["prompt_tokens"] - t["reused"] for t in out["turns"])


def _job(messages, max_tokens=16, on_chunk=None):
    """A Job whose results arrive synchronously in the worker thread (a stand-in for the event loop)."""
    done = threading.Event()
    items = []

    class Loop:
        def call_soon_threadsafe(self, fn, item):
            items.append(item)
            if on_chunk and item[0] == "chunk":
                on_chunk(job)
            if item[0] != "chunk":
                done.set()

    job = Job(Request(messages, dict(max_tokens=max_tokens, temperature=0.0)), Loop())
    job.items, job.done = items, done
    return job


def _run_jobs(worker, *jobs):
    worker.start()
    try:
        for j in jobs:
            worker.submit(j)
            assert j.done.wait(60)
    finally:
        worker.stop()


@pytest.mark.parametrize("reuse", [True, False])
def test_reuse_can_be_switched_off(tiny_dir, reuse):
    engine = edge.load(tiny_dir, drafter="lookup")
    second = CONV + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    a, b = _job(CONV), _job(second)
    _run_jobs(Worker(engine, reuse=reuse), a, b)
    kind, st = b.items[-1]
    assert kind == "done" and (st.reused_tokens > 0) == reuse


# ------------------------------------------------------------------------------ disconnects and the queue

def test_worker_stops_a_cancelled_generation_and_rolls_back(tiny_dir, plain_reference):
    engine = edge.load(tiny_dir, drafter="lookup")
    job = _job(CONV, max_tokens=100, on_chunk=lambda j: j.cancel.set())  # the client leaves after one chunk
    worker = Worker(engine)
    _run_jobs(worker, job)
    kinds = [k for k, _ in job.items]
    assert kinds == ["chunk", "done"] and worker.counts["cancelled"] == 1
    assert job.items[-1][1].generated < 100
    assert engine.target.cache.length == len(engine.cached)
    nxt = _job(CONV, max_tokens=20)
    _run_jobs(Worker(engine), nxt)
    text = "".join(ch.text for k, ch in nxt.items if k == "chunk")
    assert text == plain_reference(CONV, max_tokens=20).text


def test_a_client_that_leaves_during_prefill_stops_it_at_the_next_chunk(tiny_dir, monkeypatch):
    """A long prompt's prefill (seconds on a real model) is not finished for a client that left: the worker
    cancels the engine, which stops between prefill chunks, and the next request is served."""
    engine = edge.load(tiny_dir, drafter="none", context=256)
    monkeypatch.setattr(engine, "_prefill_chunk", lambda: 4)
    worker = Worker(engine)
    chunks_done, in_prefill, withdrawn = [], threading.Event(), threading.Event()
    prefill = engine.target.prefill

    def slow(tokens, chunk, stop=None):
        def ask():  # before each chunk; the second waits until the client has left
            chunks_done.append(1)
            if len(chunks_done) == 2:
                in_prefill.set()
                assert withdrawn.wait(30)
            return stop()
        return prefill(tokens, chunk, ask)

    monkeypatch.setattr(engine.target, "prefill", slow)
    long = [{"role": "user", "content": "word " * 50}]
    job = _job(long, max_tokens=8)
    worker.start()
    try:
        worker.submit(job)
        assert in_prefill.wait(30), job.items
        job.cancel.set()
        worker.withdraw(job)  # what the disconnect watcher does
        withdrawn.set()
        assert job.done.wait(30)
        assert [k for k, _ in job.items] == ["done"] and worker.counts["cancelled"] == 1
        assert len(chunks_done) == 2  # of 40-odd chunks: stopped before the second
        nxt = _job(CONV, max_tokens=4)
        worker.submit(nxt)
        assert nxt.done.wait(30) and nxt.items[-1][0] == "done"
    finally:
        worker.stop()


def test_full_queue_is_a_503():
    worker = Worker(engine=None, max_queue=1)  # not started: nothing leaves the queue
    worker.submit(_job(CONV))
    worker.submit(_job(CONV))  # one would be running, one waiting
    with pytest.raises(ApiError) as e:
        worker.submit(_job(CONV))
    assert e.value.status == 503 and e.value.body()["error"]["code"] == "server_busy"
    assert worker.status()["rejected"] == 1


class HeldEngine:
    """A stand-in engine whose answer advances one chunk per `go.release()`: a generation stays running for as
    long as a test needs it to (a real model may finish before the test acts)."""
    context = 1000

    def __init__(self):
        self.go, self.running, self.last_stats = threading.Semaphore(0), threading.Event(), None

    def encode(self, messages, raw=False):
        return [1, 2, 3]

    def stream(self, messages, **kw):
        self.running.set()
        for i in range(10_000):
            assert self.go.acquire(timeout=30), "the test never let the generation go on"
            yield Chunk(f"t{i} ", [i], 0)


def test_a_client_that_leaves_while_queued_frees_its_slot_and_its_handler():
    """Its handler waits on the job's results: withdrawing must answer it (the server's shutdown used to wait for
    that handler forever), and the queue slot is free again at once."""
    worker = Worker(engine=None, max_queue=1)  # not started: nothing leaves the queue by itself
    running, queued = _job(CONV), _job(CONV)
    worker.submit(running)
    worker.submit(queued)
    queued.cancel.set()
    worker.withdraw(queued)
    assert queued.done.is_set() and queued.items[-1][0] == "error" and queued.items[-1][1].status == 499
    assert worker.status()["waiting"] == 1 and worker.status()["cancelled"] == 1
    worker.submit(_job(CONV))  # the slot it held is free
    worker.withdraw(queued)  # twice, or after the worker took it: nothing more happens
    assert worker.status()["cancelled"] == 1


def test_a_job_whose_client_left_before_it_ran_is_still_answered():
    worker = Worker(engine=None)
    job = _job(CONV)
    job.cancel.set()
    assert worker._serve(job) == "cancelled"
    assert job.done.is_set() and job.items == [("error", job.items[0][1])] and job.items[0][1].status == 499


def test_a_shutdown_that_lands_inside_submit_still_answers_the_request():
    """The Ctrl-C / SIGTERM handler (drain) runs on the event-loop thread, between any two bytecodes, and the queue's
    lock is re-entrant: landing between submit's check and its append, it used to leave the request queued on a
    worker that had stopped, unanswered until uvicorn's grace period cut the connection."""
    import collections

    worker = Worker(engine=None)

    class Interrupted(collections.deque):
        def append(self, job):
            worker.drain()  # as if the signal arrived here
            super().append(job)

    worker.waiting = Interrupted()
    with pytest.raises(ApiError) as e:
        worker.submit(_job(CONV))
    assert e.value.status == 503 and e.value.code == "shutting_down" and worker.status()["waiting"] == 0
    job = _job(CONV)  # a job the worker took just as the shutdown began: 503, not "client closed"
    job.cancel.set()
    assert worker._serve(job) == "cancelled" and job.items[0][1].status == 503


def test_shutdown_stops_the_running_generation_and_answers_the_queue():
    """Ctrl-C / SIGTERM (uvicorn's handle_exit) drains the worker first: the running answer ends within a chunk
    with a 503 shutting_down, queued requests get the same, new ones are refused. Before, uvicorn's graceful
    shutdown waited for every running and queued generation to finish."""
    import signal

    import uvicorn

    from edge.server.app import uvicorn_server

    engine = HeldEngine()
    worker = Worker(engine, max_queue=2)
    running, queued = _job(CONV), _job(CONV)
    worker.start()
    try:
        worker.submit(running)
        worker.submit(queued)
        assert engine.running.wait(10)
        engine.go.release()
        server = uvicorn_server(uvicorn.Config(app=None), worker)
        server.handle_exit(signal.SIGTERM, None)
        assert server.should_exit
        assert queued.done.wait(10) and queued.items[-1][1].status == 503
        engine.go.release()  # the step in flight finishes; the worker sees the stop and ends the answer
        assert running.done.wait(10)
        kind, err = running.items[-1]
        assert kind == "error" and err.status == 503 and err.code == "shutting_down"
        chunks = [k for k, _ in running.items[:-1]]
        assert set(chunks) == {"chunk"} and len(chunks) <= 2  # the chunk before the signal, and the one in flight
        with pytest.raises(ApiError) as e:
            worker.submit(_job(CONV))
        assert e.value.status == 503
    finally:
        for _ in range(4):
            engine.go.release()
        worker.stop()


def test_web_pages_of_other_sites_are_refused_before_any_work(server):
    """A browser sends a page's cross-site POST without asking first; CORS would only hide the answer. Pages of
    this machine (and --allow-origin ones) may call the API and get CORS headers; clients without Origin too."""
    before = _idle(server)
    body = json.dumps({"messages": CONV, "max_tokens": 4, "temperature": 0})
    for origin, status in (("https://evil.example", 403), ("null", 403), ("http://localhost:5173", 200),
                           ("http://127.0.0.1:3000", 200), ("app://desktop", 200)):
        conn = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "text/plain", "Origin": origin})
            r = conn.getresponse()
            obj = json.loads(r.read())
            assert r.status == status, (origin, obj)
            if status == 403:
                assert obj["error"]["code"] == "origin_not_allowed" and "--allow-origin" in obj["error"]["message"]
            else:
                assert r.getheader("access-control-allow-origin") in ("*", origin)
        finally:
            conn.close()
    after = _idle(server)
    assert after["completed"] - before["completed"] == 3  # the refused ones never reached the engine
    # a browser's pre-check of an allowed page, and Chromium's Private Network Access check
    status, headers = _preflight(server, {"Access-Control-Request-Headers": "content-type, authorization"})
    assert status == 200 and "POST" in headers["access-control-allow-methods"]
    status, headers = _preflight(server, {"Access-Control-Request-Private-Network": "true"})
    assert status == 200 and headers["access-control-allow-private-network"] == "true"


def _preflight(port, extra: dict) -> tuple[int, dict]:
    """A browser's CORS preflight of a POST from a page on localhost → (status, lower-cased headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST", **extra})
        r = conn.getresponse()
        r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


@pytest.mark.parametrize("origin,allowed,ok", [
    ("https://chat.example.org", (), False), ("https://chat.example.org", ("https://chat.example.org",), True),
    ("https://other.example.org", ("https://chat.example.org",), False), ("https://any.example", ("*",), True),
    ("http://localhost.evil.com", (), False), ("http://[::1]:8080", (), True), ("file://", (), True),
    ("http://[bad", (), False)])
def test_origin_policy(origin, allowed, ok):
    from edge.server.app import origin_allowed

    assert origin_allowed(origin, allowed) is ok


def test_disconnect_mid_stream_then_fresh_output(server, plain_reference):
    before = _idle(server)
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
    conn.request("POST", "/v1/chat/completions",
                 json.dumps({"messages": CONV, "max_tokens": 200, "temperature": 0, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = 0
    while events < 3:
        line = r.fp.readline()
        assert line, "stream ended before the disconnect"
        events += line.startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    after = _idle(server)
    assert after["cancelled"] + after["completed"] == before["cancelled"] + before["completed"] + 1
    conv = CONV + [{"role": "user", "content": "café 😀"}]
    status, body = _post(server, {"messages": conv, "max_tokens": 24, "temperature": 0})
    assert status == 200 and body["choices"][0]["message"]["content"] == plain_reference(conv, max_tokens=24).text


def test_load_every_request_answered_or_rejected(server, plain_reference):
    before = _idle(server)
    out = run_load(f"http://127.0.0.1:{server}", concurrency=4, requests=6, max_tokens=8, timeout=60)
    assert out["lost"] == 0 and out["malformed_bodies"] == 0, out
    assert out["answered_200"] + out["rejected_503"] == out["sent"] == 24, out
    assert out["answered_200"] > 0 and out["rejected_503"] > 0, out  # 4 clients start together; 2 fit
    after = _idle(server)
    assert after["rejected"] - before["rejected"] == out["rejected_503"]
    assert after["completed"] - before["completed"] == out["answered_200"]
    assert out["latency_ms_200"]["p50"] <= out["latency_ms_200"]["p99"]
    status, body = _post(server, {"messages": CONV, "max_tokens": 24, "temperature": 0})
    assert status == 200 and body["choices"][0]["message"]["content"] == plain_reference(CONV, max_tokens=24).text


def test_load_refuses_remote_targets():
    with pytest.raises(ValueError, match="loopback"):
        run_load("http://192.0.2.1:8080", requests=1)


# ------------------------------------------------------------------------------ bad requests

def _msgs(*roles):
    return [{"role": r, "content": "hi"} for r in roles]


BAD = [
    ("malformed json", b'{"messages": [', None, "invalid_json"),
    ("not an object", b"[1, 2]", None, "invalid_json"),
    ("missing messages", {"max_tokens": 4}, "messages", "missing_required_parameter"),
    ("empty messages", {"messages": []}, "messages", "invalid_value"),
    ("unknown role", {"messages": _msgs("wizard")}, "messages[0].role", "invalid_value"),
    ("content not text", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "invalid_value"),
    ("temperature too high", {"messages": _msgs("user"), "temperature": 3}, "temperature", "invalid_value"),
    ("temperature not a number", {"messages": _msgs("user"), "temperature": "hot"}, "temperature", "invalid_value"),
    ("top_p zero", {"messages": _msgs("user"), "top_p": 0}, "top_p", "invalid_value"),
    ("max_tokens zero", {"messages": _msgs("user"), "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("max_tokens float", {"messages": _msgs("user"), "max_tokens": 2.5}, "max_tokens", "invalid_value"),
    ("seed string", {"messages": _msgs("user"), "seed": "x"}, "seed", "invalid_value"),
    ("too many stops", {"messages": _msgs("user"), "stop": [f"s{i}" for i in range(MAX_STOP + 1)]}, "stop",
     "invalid_value"),
    ("n > 1", {"messages": _msgs("user"), "n": 2}, "n", "invalid_value"),
    ("stream not bool", {"messages": _msgs("user"), "stream": "yes"}, "stream", "invalid_value"),
    ("stream_options without stream", {"messages": _msgs("user"), "stream_options": {"include_usage": True}},
     "stream_options", "invalid_value"),
    ("unknown drafter", {"messages": _msgs("user"), "edgespec": {"drafter": "oracle"}}, "edgespec.drafter",
     "invalid_value"),
    ("unknown extension", {"messages": _msgs("user"), "edgespec": {"turbo": True}}, "edgespec", "invalid_value"),
    ("model not a string", {"messages": _msgs("user"), "model": 123}, "model", "invalid_value"),
    ("n is a bool", {"messages": _msgs("user"), "n": True}, "n", "invalid_value"),
    ("top_k below -1", {"messages": _msgs("user"), "top_k": -2}, "top_k", "invalid_value"),
    ("top_k float", {"messages": _msgs("user"), "top_k": 2.5}, "top_k", "invalid_value"),
    ("logprobs", {"messages": _msgs("user"), "logprobs": True}, "logprobs", "unsupported_parameter"),
    ("top_logprobs", {"messages": _msgs("user"), "top_logprobs": 3}, "top_logprobs", "unsupported_parameter"),
    ("json mode", {"messages": _msgs("user"), "response_format": {"type": "json_object"}}, "response_format",
     "unsupported_parameter"),
    ("forced tool call", {"messages": _msgs("user"), "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "unsupported_parameter"),
    ("tool call required", {"messages": _msgs("user"), "tool_choice": "required"}, "tool_choice",
     "unsupported_parameter"),
    ("nested too deeply", b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", None, "invalid_json"),
]


@pytest.mark.parametrize("name,body,param,code", BAD, ids=[b[0] for b in BAD])
def test_parse_refuses_bad_requests(name, body, param, code):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as e:
        parse_chat_request(raw, 16)
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["param"] == param and err["code"] == code and err["message"]


def test_parse_accepts_openai_shapes():
    req = parse_chat_request(json.dumps({
        "model": "anything", "user": "ignored", "max_completion_tokens": 9, "temperature": 0, "seed": 3,
        "stop": "\n\n", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "edgespec": {"drafter": "lookup"}, "logprobs": False, "response_format": {"type": "text"},
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}).encode(), 16)
    assert req.prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    assert req.params == dict(max_tokens=9, temperature=0.0, top_p=1.0, seed=3, stop=("\n\n",), drafter="lookup")
    assert req.stream and req.include_usage
    assert parse_chat_request(b'{"messages": [{"role": "user", "content": "x"}]}', 16).params["max_tokens"] == 16
    assert parse_chat_request(b'{"messages": [{"role": "user", "content": "x"}], "seed": -1}', 16).params["seed"] \
        == 2**64 - 1
    # top_k as vLLM's and llama.cpp's servers take it: a cut, or -1 / 0 for none
    top = [parse_chat_request(json.dumps({"messages": _msgs("user"), "top_k": k}).encode(), 16).params.get("top_k")
           for k in (40, 0, -1)]
    assert top == [40, None, None]


@pytest.mark.parametrize("name,body,param,code", [BAD[0], BAD[4], BAD[7], BAD[17]], ids=lambda v: str(v)[:20])
def test_server_answers_bad_requests_with_error_objects(server, name, body, param, code):
    status, obj = _post(server, raw=body if isinstance(body, bytes) else json.dumps(body).encode())
    assert status == 400 and obj["error"]["param"] == param and obj["error"]["code"] == code
    assert set(obj["error"]) == {"message", "type", "param", "code"}


def test_body_is_refused_before_it_is_held_whole():
    """The 4 MB limit is applied from Content-Length before reading, and to a chunked body while it is read: at
    most one chunk past the limit is ever held."""
    import asyncio

    from edge.server.app import MAX_BODY, _read_body

    consumed = []

    class Chunked:
        headers: dict = {}

        async def stream(self):
            for i in range(64):
                consumed.append(i)
                yield b"x" * (1 << 20)

    class Declared(Chunked):
        headers = {"content-length": str(600 << 20)}

    for req, read in ((Chunked(), MAX_BODY // (1 << 20) + 1), (Declared(), 0)):
        consumed.clear()
        with pytest.raises(ApiError) as e:
            asyncio.run(_read_body(req))
        assert e.value.status == 413 and len(consumed) == read, (type(req).__name__, len(consumed))

    class Small(Chunked):
        async def stream(self):
            yield b'{"messages": '
            yield b"[]}"

    assert asyncio.run(_read_body(Small())) == b'{"messages": []}'


def test_server_refuses_oversized_prompt_and_body_then_keeps_serving(server, plain_reference):
    long = [{"role": "user", "content": "the quick brown fox " * 200}]  # far past the tiny export's 256 tokens
    before = _get(server, "/health")[1]
    status, obj = _post(server, {"messages": long, "max_tokens": 4})
    assert status == 400 and obj["error"]["code"] == "context_length_exceeded" and obj["error"]["param"] == "messages"
    after = _idle(server)  # a refused request counts as invalid: neither a full queue nor a server failure
    assert [after[k] - before[k] for k in ("invalid", "rejected", "failed")] == [1, 0, 0], (before, after)
    status, obj = _post(server, {"messages": long, "max_tokens": 4, "stream": True})
    assert status == 400 and obj["error"]["code"] == "context_length_exceeded"
    status, obj = _post(server, raw=b'{"messages": "' + b"x" * (5 << 20) + b'"}')
    assert status == 413 and obj["error"]["code"] == "request_too_large"
    # without a Content-Length (chunked), the body is refused while it is read, not after holding all of it
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", (b"x" * (1 << 20) for _ in range(64)),
                     {"Content-Type": "application/json"}, encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may close the connection before the client has sent all 64 MB: refused either way
    finally:
        conn.close()
    for method, path, want in [("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405),
                               ("GET", "/v1/models/other", 404)]:
        status, obj = _request(server, method, path)
        assert status == want and set(obj["error"]) == {"message", "type", "param", "code"}
    status, body = _post(server, {"messages": CONV, "max_tokens": 12, "temperature": 0})
    assert status == 200 and body["choices"][0]["message"]["content"] == plain_reference(CONV, max_tokens=12).text


def test_cli_has_edge_chat_engine_flags_and_refuses_bad_ones(tiny_dir):
    r = subprocess.run([sys.executable, "-m", "edge.server.app", "--help"], capture_output=True, text=True, timeout=60)
    for flag in ("--drafter", "--device", "--budget-mb", "--context", "--threads", "--simulate", "--max-queue",
                 "--host", "--port", "--model-dir", "--no-reuse"):
        assert flag in r.stdout
    r = subprocess.run([sys.executable, "-m", "edge.server.app", "--model-dir", str(tiny_dir), "--max-queue", "-1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--max-queue" in r.stderr


# ------------------------------------------------------------------------------ the real model

@pytest.mark.slow
def test_real_model_openai_client_equals_engine():
    import openai  # in the [test] extra: a broken install fails, never skips
    model_dir = edge.resolve_model(progress=False)
    proc, port = _start_server(model_dir, "--max-queue", 2)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="x", messages=msgs, max_tokens=32, temperature=0)
        ref = edge.load(model_dir, drafter="none").generate(msgs, max_tokens=32)
        assert r.choices[0].message.content == ref.text
    finally:
        _stop_server(proc)


def test_busy_port_is_one_clear_line_before_loading(tiny_dir):
    """A port another server holds is refused before the model loads, and nothing claims to serve on it."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        script = Path(sys.executable).with_name("edge-serve")
        t = time.monotonic()
        r = subprocess.run([str(script), "--model-dir", str(tiny_dir), "--port", str(port)], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "another --port" in r.stderr, r.stderr
    assert " on http://" not in r.stderr and time.monotonic() - t < 30


def test_context_too_small_for_any_chat_is_refused_at_start(tiny_dir):
    """A --context shorter than an empty question with the chat template would start a server that refuses every
    request: it is refused at start, with the smallest context that works."""
    script = Path(sys.executable).with_name("edge-serve")
    r = subprocess.run([str(script), "--model-dir", str(tiny_dir), "--port", "0", "--context", "5"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--context 5 cannot hold a chat" in r.stderr and "short exchanges need" in r.stderr, r.stderr
    assert " on http://" not in r.stderr


def test_port_zero_announces_the_port_it_serves_on(tiny_dir):
    """--port 0 takes any free port; the start-up line names that port (it printed ":0") and /health answers there."""
    script = Path(sys.executable).with_name("edge-serve")
    proc = subprocess.Popen([str(script), "--model-dir", str(tiny_dir), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        line = proc.stdout.readline()
        m = re.search(r" on http://127\.0\.0\.1:(\d+)/v1", line)
        assert m and int(m.group(1)) > 0, line
        deadline = time.monotonic() + 60
        while True:
            try:
                assert _get(int(m.group(1)), "/health")[0] == 200
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "edge-serve did not answer /health"
                time.sleep(0.1)
    finally:
        _stop_server(proc)


def test_port_zero_on_an_address_this_machine_lacks_is_one_clear_line(tiny_dir):
    """--port 0 binds its socket before the model loads; an unknown host is refused there, as for any other port,
    not with a traceback."""
    script = Path(sys.executable).with_name("edge-serve")
    r = subprocess.run([str(script), "--model-dir", str(tiny_dir), "--port", "0", "--host", "nosuch.invalid"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "cannot resolve --host nosuch.invalid" in r.stderr and " on http://" not in r.stderr, r.stderr


def test_a_server_that_never_started_exits_non_zero(tiny_dir, monkeypatch, capsys):
    """uvicorn.run exits 3 when start-up fails; edge-serve runs uvicorn.Server itself (for --port 0's socket), so
    it checks the same: a server that never started is an error, not exit 0."""
    import uvicorn

    from edge.server import app as serve

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # start-up failed: never started
    assert serve.main(["--model-dir", str(tiny_dir), "--port", "0"]) == 3
    assert "the server did not start" in capsys.readouterr().err
