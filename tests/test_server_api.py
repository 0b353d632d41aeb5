"""edge-serve's OpenAI-compatible API in process (edge/server/app.py): request fields at their documented bounds,
the worker's outcomes and queue, the response and stream shapes a client reads, failures and disconnects, and the
CLI's checks before loading. The server runs in-process (uvicorn in a thread) over a scripted stand-in engine, so
every answer and counter is known in advance."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import serving
from edge.engine import MAX_DRAFT_LEN, BadMessage, Chunk, EngineError, Stats
from edge.manifest import ModelDirError
from edge.server.app import MAX_BODY, MAX_STOP, ApiError, Job, Request, Worker, parse_chat_request
from helpers import http_call, http_send, sse_events


MSGS = [{"role": "user", "content": "hi"}]


def _parse(**fields) -> Request:
    return parse_chat_request(json.dumps({"messages": MSGS, **fields}).encode(), 16)


# ------------------------------------------------------------------------------ request parsing

def test_range_limits_are_inclusive():
    """The documented bounds are accepted: temperature 2, top_p 1, max_tokens 1, MAX_STOP stop strings (more than
    OpenAI's 4: editors' completion templates send 5-10, as llama-server takes), draft_len 0 and its maximum."""
    stops = tuple(f"s{i}" for i in range(MAX_STOP))
    assert MAX_STOP > 4
    p = _parse(temperature=2, top_p=1, max_tokens=1, stop=list(stops)).params
    assert (p["temperature"], p["top_p"], p["max_tokens"], p["stop"]) == (2.0, 1.0, 1, stops)
    assert _parse(max_completion_tokens=1).params["max_tokens"] == 1
    for k in (0, MAX_DRAFT_LEN):
        assert _parse(edgespec={"draft_len": k}).params["draft_len"] == k


BAD = [
    ("temperature bool", {"temperature": True}, "temperature"),
    ("max_tokens bool", {"max_tokens": True}, "max_tokens"),
    ("max_completion_tokens bool", {"max_completion_tokens": True}, "max_completion_tokens"),
    ("empty stop", {"stop": ""}, "stop"),
    ("empty stop in a list", {"stop": ["a", ""]}, "stop"),
    ("draft_len past its maximum", {"edgespec": {"draft_len": MAX_DRAFT_LEN + 1}}, "edgespec.draft_len"),
    ("n zero", {"n": 0}, "n"),
    ("seed bool", {"seed": True}, "seed"),
    ("top_k bool", {"top_k": True}, "top_k"),
    ("stream_options not an object", {"stream": True, "stream_options": "include_usage"}, "stream_options"),
    ("json schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
]


@pytest.mark.parametrize("name,fields,param", BAD, ids=[b[0] for b in BAD])
def test_bad_field_values_are_refused_by_name(name, fields, param):
    with pytest.raises(ApiError) as e:
        _parse(**fields)
    assert e.value.status == 400 and e.value.param == param and e.value.type == "invalid_request_error"


def test_neutral_values_of_refused_fields_are_accepted():
    """Values that ask for nothing special: no log-probabilities (top_logprobs 0), no tool call (tool_choice none)."""
    req = _parse(logprobs=False, top_logprobs=0, tool_choice="none", n=1, response_format={"type": "text"})
    assert req.params["max_tokens"] == 16 and not req.stream
    assert "drafter" not in _parse(edgespec={"drafter": None}).params  # null: the server's default drafter


def test_max_completion_tokens_wins_over_the_deprecated_max_tokens():
    assert _parse(max_tokens=50, max_completion_tokens=7).params["max_tokens"] == 7


def test_defaults_are_openais():
    """No temperature is 1 (OpenAI's default; the README says so), no top_p is 1; include_usage only when true."""
    p = _parse().params
    assert (p["temperature"], p["top_p"], p["seed"], p["stop"]) == (1.0, 1.0, None, ())
    assert not _parse(stream=True, stream_options={}).include_usage
    assert not _parse(stream=True, stream_options={"include_usage": False}).include_usage


def test_stream_null_means_no_stream():
    assert _parse(stream=None).stream is False


def test_a_body_of_exactly_the_limit_is_read():
    import asyncio

    from edge.server.app import _read_body

    class Exact:
        headers = {"content-length": str(MAX_BODY)}

        async def stream(self):
            yield b"x" * MAX_BODY

    assert len(asyncio.run(_read_body(Exact()))) == MAX_BODY


# ------------------------------------------------------------------------------ the worker

STATS = Stats(prompt_tokens=7, reused_tokens=3, generated=5, steps=2, drafted=4, accepted=2, prefill_s=0.0123,
              decode_s=0.5, drafter="lookup")


class ScriptEngine:
    """A stand-in engine answering `pieces` (the last one with `finish`); `fail`: raised before piece `fail_at`;
    `hold`: each piece waits for a `go.release()`."""
    context = 1000
    default_drafter, has_chat_template = "none", True

    def __init__(self, pieces=("Hel", "lo", "!"), finish="stop", fail=None, fail_at=1, hold=False, prompt_len=7):
        self.manifest = SimpleNamespace(name="fake-model")
        self.pieces, self.finish, self.fail, self.fail_at, self.hold = pieces, finish, fail, fail_at, hold
        self.prompt_len, self.last_stats, self.resets, self.emitted = prompt_len, None, [], 0
        self.go, self.running, self.closed = threading.Semaphore(0), threading.Event(), threading.Event()

    def encode(self, messages, raw=False):
        return list(range(self.prompt_len))

    def reset(self, keep_drafter_state=False):
        self.resets.append(keep_drafter_state)

    def stream(self, messages, **kw):
        self.last_stats = STATS
        self.running.set()
        try:
            for i, piece in enumerate(self.pieces):
                if self.hold:
                    assert self.go.acquire(timeout=30), "the test never let the generation go on"
                if self.fail is not None and i == self.fail_at:
                    raise self.fail
                self.emitted += 1
                yield Chunk(piece, [i], 0, self.finish if i == len(self.pieces) - 1 else None)
        finally:
            self.closed.set()


def _job(on_chunk=None):
    """A Job whose results arrive synchronously in the worker's thread (`on_chunk(job, chunk)` after each chunk)."""
    items, done = [], threading.Event()

    class Loop:
        def call_soon_threadsafe(self, fn, item):
            items.append(item)
            if item[0] == "chunk" and on_chunk:
                on_chunk(job, item[1])
            if item[0] != "chunk":
                done.set()

    job = Job(Request(MSGS, dict(max_tokens=16, temperature=0.0)), Loop())
    job.items, job.done = items, done
    return job


def test_the_running_request_counts_against_the_queue():
    """--max-queue N: N may wait while one generates; the next is a 503."""
    engine = ScriptEngine(hold=True)
    worker = Worker(engine, max_queue=1)
    worker.start()
    try:
        worker.submit(_job())
        assert engine.running.wait(10)
        worker.submit(_job())  # waits
        with pytest.raises(ApiError) as e:
            worker.submit(_job())
        assert e.value.status == 503 and e.value.code == "server_busy" and worker.status()["rejected"] == 1
    finally:
        for _ in range(10):
            engine.go.release()
        worker.stop()


@pytest.mark.parametrize("engine,outcome", [(ScriptEngine(), "completed"),
                                            (ScriptEngine(prompt_len=ScriptEngine.context), "invalid"),
                                            (ScriptEngine(fail=RuntimeError("boom")), "failed")])
def test_an_outcome_is_counted_before_its_client_hears_the_end(engine, outcome):
    """/health read the moment an answer ends (done or error) already counts it."""
    worker = Worker(engine)
    job = _job()
    seen = {}
    emit = job.emit

    def recording(kind, value=None):
        if kind != "chunk":
            seen[kind] = worker.status()[outcome]
        emit(kind, value)

    job.emit = recording
    assert worker._serve(job) == outcome
    assert list(seen.values()) == [1]


def test_a_prompt_that_fills_the_context_is_refused_as_too_long():
    """A client error, counted as invalid: "rejected" is the full queue's 503."""
    engine = ScriptEngine(prompt_len=ScriptEngine.context)
    job = _job()
    assert Worker(engine)._serve(job) == "invalid"
    err = job.items[-1][1]
    assert err.status == 400 and err.code == "context_length_exceeded" and not engine.running.is_set()


def test_a_client_leaving_on_the_last_chunk_got_a_complete_answer():
    job = _job(on_chunk=lambda j, ch: ch.finish_reason and j.cancel.set())
    assert Worker(ScriptEngine())._serve(job) == "completed"
    assert [k for k, _ in job.items] == ["chunk"] * 3 + ["done"]


def test_a_shutdown_during_the_last_chunk_still_delivers_the_answer():
    """Only an answer the shutdown cut short is a 503; one that ended anyway is delivered."""
    worker = Worker(ScriptEngine())
    job = _job(on_chunk=lambda j, ch: ch.finish_reason and worker.drain())
    assert worker._serve(job) == "completed" and job.items[-1][0] == "done"


@pytest.mark.parametrize("fail,status,code,param,outcome", [
    (ModelDirError("this export has no drafter model"), 400, "unsupported_drafter", "edgespec.drafter", "invalid"),
    (EngineError("no such thing"), 400, "invalid_request", None, "invalid"),
    (BadMessage("empty prompt: nothing to continue from", "prompt"), 400, "invalid_request", "prompt", "invalid"),
    (RuntimeError("boom"), 500, None, None, "failed")])
def test_engine_errors_are_answered_and_counted(fail, status, code, param, outcome):
    engine = ScriptEngine(fail=fail, fail_at=0)
    worker = Worker(engine)
    job = _job()
    worker.start()
    try:
        worker.submit(job)
        assert job.done.wait(10)
    finally:
        worker.stop()
    err = job.items[-1][1]
    assert isinstance(err, ApiError) and (err.status, err.code, err.param) == (status, code, param)
    assert err.type == ("server_error" if status == 500 else "invalid_request_error") and str(fail) in err.message
    assert worker.status()[outcome] == 1
    assert sum(worker.status()[k] for k in ("completed", "rejected", "invalid", "failed")) == 1


# ------------------------------------------------------------------------------ the HTTP server, in-process

@contextlib.contextmanager
def _serving(engine, **kw):
    """The server on a free loopback port (conftest.serving) → (port, worker)."""
    with serving(engine, **kw) as (port, app):
        yield port, app.state.worker


def _health(port) -> dict:
    return json.loads(http_call(port, None, "GET", "/health")[2])


def _wait_health(port, pred, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = _health(port)
        if pred(h) or time.monotonic() > deadline:
            return h
        time.sleep(0.02)


USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 3}}


# (generated - 1) / steps tokens per step, prefill in ms, (generated - 1) / decode_s
COUNTERS = {"drafter": "lookup", "drafted": 4, "accepted": 2, "steps": 2, "mean_accepted_len": 2.0,
            "prompt_tokens_reused": 3, "prefill_ms": 12.3, "decode_tok_s": 8.0}


def test_completion_body_has_openais_shape_and_the_counters():
    with _serving(ScriptEngine()) as (port, _):
        status, _, raw = http_call(port, {"messages": MSGS, "max_tokens": 5})
    r = json.loads(raw)
    assert status == 200 and r["object"] == "chat.completion" and r["model"] == "fake-model"
    assert r["id"].startswith("chatcmpl-")
    assert r["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "logprobs": None,
                             "finish_reason": "stop"}]
    assert r["usage"] == USAGE and r["edgespec"] == COUNTERS


@pytest.mark.parametrize("include_usage", [True, False])
def test_stream_events_have_openais_shape(include_usage):
    body = {"messages": MSGS, "stream": True, **({"stream_options": {"include_usage": True}} if include_usage else {})}
    with _serving(ScriptEngine()) as (port, _):
        status, headers, raw = http_call(port, body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    ev = sse_events(raw)
    assert ev[-1] == "[DONE]" and "[DONE]" not in ev[:-1]
    chunks = ev[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake-model" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    with_choice = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choice) == "Hello!"
    assert [c["choices"][0]["finish_reason"] for c in with_choice][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in with_choice[:-1])
    assert with_choice[-1]["edgespec"] == COUNTERS  # the finish chunk carries the counters, with or without usage
    if include_usage:  # every chunk has "usage": null, then one more chunk with no choices carries it
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE and chunks[-1]["edgespec"] == COUNTERS
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    else:
        assert chunks[-1] is with_choice[-1]


def test_a_failure_after_the_stream_began_is_its_last_event():
    engine = ScriptEngine(fail=RuntimeError("boom"), fail_at=1)
    with _serving(engine) as (port, _):
        status, _, raw = http_call(port, {"messages": MSGS, "stream": True})
        assert _wait_health(port, lambda h: h["failed"] == 1)["failed"] == 1
    ev = sse_events(raw)
    assert status == 200 and ev[-1] == "[DONE]"
    err = ev[-2]["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error" and "boom" in err["message"]
    assert all(c["choices"][0]["finish_reason"] is None for c in ev[:-2])  # no finish chunk: the answer failed


def test_a_failure_after_some_chunks_of_a_plain_answer_is_an_error_response():
    with _serving(ScriptEngine(fail=EngineError("cannot go on"), fail_at=1)) as (port, _):
        status, _, raw = http_call(port, {"messages": MSGS})
    err = json.loads(raw)["error"]
    assert status == 400 and err["code"] == "invalid_request" and "cannot go on" in err["message"]


def test_full_queue_503_says_when_to_retry():
    engine = ScriptEngine(hold=True)
    with _serving(engine, max_queue=0) as (port, _):
        first = http_send(port, {"messages": MSGS})
        try:
            assert engine.running.wait(10)
            status, headers, raw = http_call(port, {"messages": MSGS})
            assert status == 503 and headers.get("retry-after") == "1"
            assert json.loads(raw)["error"]["code"] == "server_busy"
            for _ in range(3):
                engine.go.release()
            r = first.getresponse()
            assert r.status == 200 and json.loads(r.read())["choices"][0]["message"]["content"] == "Hello!"
        finally:
            first.close()


def test_unknown_paths_health_and_no_reuse():
    """--no-reuse prefills every prompt in full but keeps what the drafters learned."""
    engine = ScriptEngine()
    with _serving(engine, reuse=False, max_queue=3) as (port, _):
        status, _, raw = http_call(port, None, "GET", "/v1/nothing")
        assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
        assert http_call(port, {"messages": MSGS})[0] == 200
        h = _health(port)
    assert h["reuse"] is False and h["max_queue"] == 3 and h["model"] == "fake-model" and h["context"] == 1000
    assert engine.resets == [True]


def test_routes_without_v1_and_the_allow_header_of_a_405():
    """Clients given the bare address (as for llama-server) reach the same routes without /v1; a method a route does
    not take is a 405 JSON error that says which ones it does (Allow)."""
    with _serving(ScriptEngine()) as (port, _):
        for path in ("/chat/completions", "/v1/chat/completions"):
            assert http_call(port, {"messages": MSGS}, "POST", path)[0] == 200, path
        for path in ("/models", "/v1/models", "/models/fake-model"):
            assert http_call(port, None, "GET", path)[0] == 200, path
        status, headers, raw = http_call(port, None, "GET", "/v1/chat/completions")
        assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"
        assert "POST" in {k.lower(): v for k, v in headers.items()}["allow"]


def test_a_client_that_leaves_while_queued_frees_its_slot_at_once():
    engine = ScriptEngine(hold=True)
    with _serving(engine, max_queue=1) as (port, _):
        running = http_send(port, {"messages": MSGS})
        assert engine.running.wait(10)
        queued = http_send(port, {"messages": MSGS})
        assert _wait_health(port, lambda h: h["waiting"] == 1)["waiting"] == 1
        queued.sock.shutdown(socket.SHUT_RDWR)
        queued.close()
        h = _wait_health(port, lambda h: h["waiting"] == 0)
        assert (h["waiting"], h["cancelled"], h["busy"]) == (0, 1, True)  # while the first one still runs
        for _ in range(3):
            engine.go.release()
        assert running.getresponse().status == 200
        running.close()


def test_a_client_that_leaves_mid_stream_stops_its_generation():
    engine = ScriptEngine(pieces=tuple(f"t{i} " for i in range(50)), hold=True)
    with _serving(engine) as (port, _):
        conn = http_send(port, {"messages": MSGS, "stream": True})
        engine.go.release()
        r = conn.getresponse()
        assert r.status == 200
        while not r.fp.readline().startswith(b'data: {"id"'):
            pass
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        h = {}
        for _ in range(20):  # a few more steps may run before the server notices
            engine.go.release()
            h = _wait_health(port, lambda h: not h["busy"], timeout=0.25)
            if not h["busy"]:
                break
        assert not h["busy"] and h["cancelled"] == 1 and h["completed"] == 0, h
        assert engine.closed.is_set() and engine.emitted < 50


# ------------------------------------------------------------------------------ the CLI

def test_cli_refuses_max_tokens_zero_before_loading(capsys):
    from edge.server import app as serve

    assert serve.main(["--model-dir", "/nonexistent", "--max-tokens", "0"]) == 2
    assert "--max-tokens >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("host,warned", [("0.0.0.0", True), ("192.0.2.7", True), ("127.0.0.1", False),
                                         ("::1", False), ("localhost", False)])
def test_cli_warns_only_when_binding_beyond_this_machine(monkeypatch, capsys, host, warned):
    from edge.server import app as serve

    monkeypatch.setattr(serve, "_listen_check", lambda host, port: (None, "stopped here by the test"))
    assert serve.main(["--host", host, "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "stopped here by the test" in err and ("no authentication" in err) == warned
