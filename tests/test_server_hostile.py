"""edge-serve against hostile clients, all on loopback: floods of idle and slow connections, requests built to cost
memory before they are refused, Host names a DNS-rebinding page would send, malformed fields, clients that leave
mid-body. Every case is bounded in count and time and closes what it opens. Most run the app in-process (uvicorn in
a thread) over a stand-in engine; the descriptor-limit and memory cases run `edge-serve` on the session's tiny
export, with its open-file limit set for the child process only."""
from __future__ import annotations

import contextlib
import errno
import http.client
import random
import selectors
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import edge
from conftest import serving
from helpers import start_edge_serve
from edge.engine import Chunk, Stats
from edge.server import app as serve
from edge.server.app import (ACCEPT_ERROR, CUT_SLACK, MAX_BODY, PIECE_CHARS, ApiError, ConnectionLimits, Job,
                             PromptLimits, RateLimitFilter, Request, Worker, _normalizer_shrink, host_allowed,
                             parse_chat_request, parse_completion_request, prompt_limits, refuse_if_surely_too_long,
                             tokens_at_least)

MSGS = [{"role": "user", "content": "hi"}]
STATS = Stats(prompt_tokens=3, reused_tokens=0, generated=2, steps=1, drafted=0, accepted=0, prefill_s=0.001,
              decode_s=0.01, drafter="none")


class StandIn:
    """A stand-in engine answering "ok" (each chunk waits for `go.release()` when `hold`); counts `encode` calls,
    the tokenizer's work."""
    default_drafter, has_chat_template = "none", True

    def __init__(self, context=1000, hold=False):
        self.context, self.hold = context, hold
        self.manifest = SimpleNamespace(name="stand-in")
        self.go, self.running, self.encoded, self.last_stats = threading.Semaphore(0), threading.Event(), 0, None

    def encode(self, messages, raw=False):
        self.encoded += 1
        return [1] * (2 * len(messages) + 1)

    def stream(self, messages, **kw):
        self.last_stats = STATS
        self.running.set()
        for i, piece in enumerate(("o", "k")):
            if self.hold:
                assert self.go.acquire(timeout=30), "the test never let the generation go on"
            yield Chunk(piece, [i], 0, "stop" if i == 1 else None)


def _call(port, method="GET", path="/health", body=None, headers=None, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, None if body is None else json.dumps(body).encode(),
                     {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _health(port) -> dict:
    return _call(port)[1]


def _closed_by_peer(sock, timeout: float) -> bool:
    """Did the server close `sock` within `timeout` seconds (EOF or reset)? Reads and drops anything it sent."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _raw(port) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


# ------------------------------------------------------------------------------ idle and slow connections

def test_a_connection_that_never_sends_a_request_is_closed():
    with serving(StandIn(), ConnectionLimits(header_timeout=0.5)) as (port, _):
        with _raw(port) as idle:
            assert _closed_by_peer(idle, 15), "an idle connection was kept open past --header-timeout"
        assert _health(port)["connections"]["timed_out"] >= 1


def test_headers_sent_a_byte_at_a_time_are_cut_off():
    """Slowloris: the deadline is for the whole head, not renewed by each byte."""
    with serving(StandIn(), ConnectionLimits(header_timeout=0.5)) as (port, _):
        with _raw(port) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            closed = False
            for _ in range(150):  # 15 s at most
                try:
                    slow.sendall(b"X")
                except OSError:
                    closed = True
                    break
                if _closed_by_peer(slow, 0.1):
                    closed = True
                    break
            assert closed, "a trickled request head kept its connection"


def test_after_an_answer_the_next_head_has_the_same_deadline():
    with serving(StandIn(), ConnectionLimits(header_timeout=0.5)) as (port, _):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and r.read()
            conn.sock.sendall(b"GET /health HTTP/1.1\r\n")  # a second head, never finished
            assert _closed_by_peer(conn.sock, 15)
        finally:
            conn.close()


def test_a_body_that_never_arrives_is_a_408():
    engine = StandIn()
    with serving(engine, body_timeout=0.5) as (port, app):
        with _raw(port) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"messages\": [")
            s.settimeout(15)
            head = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(65536):  # the answer, then the close (the request was never complete)
                    head += chunk
        assert head.startswith(b"HTTP/1.1 408"), head[:200]
        assert b"request_timeout" in head and b"--body-timeout" in head
        h = _health(port)
        assert h["invalid"] == 1 and engine.encoded == 0


def test_over_the_cap_the_oldest_idle_connection_makes_room():
    """Four connections at most: a fifth closes the oldest idle one and is served; when all four are inside
    requests, a new one is answered 503 and closed."""
    engine = StandIn(hold=True)
    limits = ConnectionLimits(max_connections=4)
    with serving(engine, limits, max_queue=8) as (port, _):
        idle = [_raw(port) for _ in range(4)]
        try:
            status, h = _call(port)  # the fifth
            assert status == 200 and h["connections"]["closed_idle"] >= 1
            assert _closed_by_peer(idle[0], 10), "the oldest idle connection was not the one closed"
        finally:
            for s in idle:
                s.close()
        busy = []
        try:
            for _ in range(4):  # four requests in flight: one generating, three queued
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                c.request("POST", "/v1/chat/completions", json.dumps({"messages": MSGS}),
                          {"Content-Type": "application/json"})
                busy.append(c)
            deadline = time.monotonic() + 10
            while True:  # until the four hold the only slots, each inside its request
                with contextlib.suppress(RuntimeError):  # the server's thread changed the dict meanwhile
                    conns = list(limits.open)
                    if len(conns) == 4 and not any(c.waiting_for_head() for c in conns):
                        break
                assert time.monotonic() < deadline, limits.status()
                time.sleep(0.02)
            with _raw(port) as extra:
                extra.settimeout(10)
                answer = b""
                with contextlib.suppress(ConnectionResetError):
                    while chunk := extra.recv(4096):
                        answer += chunk
            assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections" in answer, answer[:300]
            assert limits.status()["refused"] == 1
            for _ in range(8):
                engine.go.release()
            for c in busy:
                assert c.getresponse().status == 200
        finally:
            for c in busy:
                c.close()


def test_accept_errors_are_logged_once_per_period_with_a_count():
    """asyncio logs every failed accept() at the descriptor limit with a traceback; one line per period gets
    through, saying how many were held back. Other lines pass untouched."""
    now = [0.0]
    f = RateLimitFilter(ACCEPT_ERROR, period=10, clock=lambda: now[0])
    err = OSError(errno.EMFILE, "Too many open files")

    def record(msg):
        r = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, (OSError, err, None))
        return f.filter(r), r

    passed = []
    for i in range(1000):
        now[0] = i / 100  # 1000 in 10 s
        ok, r = record(ACCEPT_ERROR + "\nexception: OSError(24)\nsocket: <socket>")
        passed += [r] if ok else []
    now[0] = 10.0
    ok, last = record(ACCEPT_ERROR + "\nexception: OSError(24)")
    assert ok and len(passed) == 1 and "\n" not in passed[0].getMessage() and passed[0].exc_info is None
    assert "Too many open files" in last.getMessage() and "999 more" in last.getMessage()
    assert record("something else")[0] and record("something else")[1].exc_info is not None


# ------------------------------------------------------------------------------ edge-serve at its descriptor limit

def _start(model_dir, log, *args, files=None):
    """`edge-serve` on a free port, its output to the file `log`; `files`: (soft, hard) open-file limit for the child
    only. → (process, port) once /health answers."""
    def limit():
        if files is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, files)

    return start_edge_serve(model_dir, *args, stdout=log, preexec_fn=limit)


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _soft_files(pid) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-file limit in /proc")


def _peak_rss_mb(pid) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc")


@contextlib.contextmanager
def _own_files(n: int):
    """This test process may open `n` descriptors (raised for the test, restored after), or the test is skipped."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"this machine allows {hard} open files; the test needs {n}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


needs_proc = pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc (Linux)")


@needs_proc
def test_the_descriptor_limit_is_raised_and_idle_connections_time_out(tiny_dir, tmp_path):
    """Started with a soft limit of 256 open files: edge-serve raises it to what its connection cap and a burst of
    accepts need (as far as the hard limit allows), and closes a connection that sends nothing after
    --header-timeout."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    with open(tmp_path / "serve.log", "wb") as log:
        proc, port = _start(tiny_dir, log, "--header-timeout", 1, "--max-connections", 300, files=(256, hard))
        try:
            want = 300 + serve.FD_RESERVE + 3 * serve.BACKLOG
            assert _soft_files(proc.pid) == (want if hard == resource.RLIM_INFINITY else min(want, hard))
            with _raw(port) as idle:
                assert _closed_by_peer(idle, 15)
            assert _health(port)["connections"] == {"open": 1, "max": 300, "closed_idle": 0, "refused": 0,
                                                    "timed_out": 1}  # open: the /health request's own
        finally:
            _stop(proc)


@needs_proc
def test_two_thousand_idle_connections_do_not_starve_a_request(tiny_dir, tmp_path):
    """At a hard limit of 1024 open files (so the limit cannot be raised), 2,000 connections that never send a
    request: a normal request is still answered, and the log stays a few lines. Before, the accept loop logged a
    traceback for every failed accept() (megabytes a second) and the request waited for idle sockets that never
    closed."""
    n, files = 2000, (1024, 1024)
    with _own_files(n + 200), open(tmp_path / "serve.log", "wb") as log:
        proc, port = _start(tiny_dir, log, files=files)
        idle = []
        try:
            for _ in range(n):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))  # in progress or done; never sends
                idle.append(s)
            pending, sel = set(idle), selectors.DefaultSelector()
            for s in idle:
                sel.register(s, selectors.EVENT_WRITE)
            deadline = time.monotonic() + 30
            while pending and time.monotonic() < deadline:  # until all 2,000 are open (the kernel completed them)
                for key, _ in sel.select(0.5):
                    sel.unregister(key.fileobj)
                    pending.discard(key.fileobj)
            sel.close()
            assert not pending, f"{len(pending)} connections did not open"
            t0 = time.monotonic()
            status, h = _call(port, timeout=10)
            took = time.monotonic() - t0
            print(f"\n/health answered in {1000 * took:.0f} ms with {n} idle connections open; {h['connections']}")
            assert status == 200
            assert h["connections"]["open"] <= h["connections"]["max"] <= files[0] - 256
        finally:
            for s in idle:
                s.close()
            _stop(proc)
    size = (tmp_path / "serve.log").stat().st_size
    assert size < 16_000, (tmp_path / "serve.log").read_text(errors="replace")[:3000]


# ------------------------------------------------------------------------------ memory: refused before tokenizing

def test_more_messages_than_the_context_are_refused_before_tokenizing():
    """Each message takes a token at least, so a list as long as the context never fits: refused by count, before
    the engine tokenizes anything, and counted as an invalid request."""
    engine = StandIn(context=1000)
    with serving(engine) as (port, _):
        status, body = _call(port, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": ""}] * 1000})
        h = _health(port)
    err = body["error"]
    assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "1000 messages" in err["message"] and "1000 tokens" in err["message"]
    assert engine.encoded == 0 and (h["invalid"], h["rejected"]) == (1, 0)
    assert PromptLimits(1000).check_count([{}] * 999) is None  # one fewer may fit


def _limits_and_codec(tiny_dir):
    engine = edge.load(tiny_dir, drafter="none")
    return engine, prompt_limits(engine)


def test_the_text_bound_comes_from_the_longest_token(tiny_dir):
    """The tiny byte-level tokenizer has no normalizer: the bound is in UTF-8 bytes, (context - 1) × the longest
    token's bytes. The densest text that fits (long tokens repeated) passes it; one byte past it cannot fit."""
    engine, lim = _limits_and_codec(tiny_dir)
    codec = engine.codec
    vocab = codec.tok.get_vocab(with_added_tokens=False)
    assert lim.unit == "bytes" and lim.span == max(map(len, vocab)) and lim.context == engine.context
    special = {t.content for t in codec.tok.get_added_tokens_decoder().values() if t.special}
    pieces = {codec.token_bytes(i).decode("utf-8", "replace") for i in vocab.values()} - special  # (text in a message)
    piece = max((p for p in pieces if p == p.strip() and "\ufffd" not in p), key=len)
    assert len(engine.encode(piece, raw=True)) == 1
    dense = [{"role": "user", "content": piece * (engine.context // 2)}]
    assert len(engine.encode(dense)) < engine.context  # fits ...
    lim.check_text(dense)  # ... and passes
    over = [{"role": "user", "content": "x" * ((lim.context - 1) * lim.span + 1)}]
    with pytest.raises(ApiError) as e:
        lim.check_text(over)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and f"{lim.span} bytes" in str(e.value)
    assert len(engine.encode(over)) >= engine.context  # it could not have fit
    # whitespace around a message is not counted (templates that trim it)
    lim.check_text([{"role": "user", "content": " " * (lim.context * lim.span) + "hi\n"}])


TEXTS = ["the quick brown fox jumps over the lazy dog. " * 40,
         "def add(a, b):\n    return a + b\n\n" * 30 + "x = [1, 2, 3]  # a list",
         " ".join(f"word{i}" for i in range(400)) + "  two  spaces   and\ttabs\n\nand newlines " * 5,
         "naïve café — “quotes” 東京 \U0001F600 " * 30]


@pytest.mark.parametrize("text", TEXTS, ids=["prose", "code", "spacing", "unicode"])
def test_piecewise_count_equals_the_whole_for_a_byte_level_tokenizer(tiny_dir, monkeypatch, text):
    """Cut only at a space between two non-spaces, the tiny byte-level BPE's pieces hold exactly the whole
    text's tokens; with a context that never fills, every piece is counted."""
    engine, _ = _limits_and_codec(tiny_dir)
    monkeypatch.setattr(serve, "PIECE_CHARS", 64)
    count, cuts = tokens_at_least(lambda t: engine.encode(t, raw=True), text, 10**9)
    assert count == len(engine.encode(text, raw=True)) and cuts > 3


def test_piecewise_count_stops_once_the_prompt_cannot_fit(tiny_dir, monkeypatch):
    engine, _ = _limits_and_codec(tiny_dir)
    monkeypatch.setattr(serve, "PIECE_CHARS", 64)
    seen = []

    def encode(t):
        seen.append(len(t))
        return engine.encode(t, raw=True)

    text = TEXTS[0] * 20
    count, cuts = tokens_at_least(encode, text, 100)
    assert count - CUT_SLACK * cuts >= 100 and sum(seen) < len(text) // 4 and max(seen) <= 64


def test_a_prompt_counted_piecewise_is_refused_only_when_it_cannot_fit(tiny_dir, monkeypatch):
    """Over WHOLE_PROMPT_BYTES (made small here), the rendered prompt is counted a piece at a time: refused when
    its count (less the cuts' slack) reaches the context, which a prompt that fits never does."""
    engine, _ = _limits_and_codec(tiny_dir)
    monkeypatch.setattr(serve, "WHOLE_PROMPT_BYTES", 256)
    monkeypatch.setattr(serve, "PIECE_CHARS", 128)
    words = TEXTS[0].split()
    for n in range(10, 400, 15):
        msgs = [{"role": "user", "content": " ".join(words[:n])}]
        fits = len(engine.encode(msgs)) < engine.context
        try:
            refuse_if_surely_too_long(engine, msgs)
            refused = False
        except ApiError as e:
            assert e.status == 400 and e.code == "context_length_exceeded"
            refused = True
        assert not (fits and refused), n
        if len(engine.encode(msgs)) > engine.context + 4 * CUT_SLACK * (1 + len(msgs[0]["content"]) // 64):
            assert refused, n  # well past the context: found by the count


def test_the_rendered_prompt_is_counted_not_the_messages():
    """A template that leaves part of a message out (an earlier turn's reasoning) can fit a conversation whose
    messages alone would not: the count is of what the template renders."""
    think = "<think>" + "pondering " * 20_000 + "</think>"

    class Codec:
        def render(self, msgs):  # keeps only what follows the reasoning, as reasoning models' templates do
            return "".join(m["role"] + ": " + m["content"].split("</think>")[-1] + "\n" for m in msgs)

    engine = SimpleNamespace(context=1000, codec=Codec(), encode=lambda t, raw=False: t.split())
    msgs = [{"role": "user", "content": "q " * 300}, {"role": "assistant", "content": think + "an answer"},
            {"role": "user", "content": "and? " * 300}]
    refuse_if_surely_too_long(engine, msgs)  # 600-odd words rendered: fits
    with pytest.raises(ApiError):
        refuse_if_surely_too_long(engine, msgs + [{"role": "user", "content": "more " * 20_000}])


def test_a_long_prompt_is_never_tokenized_whole(tiny_dir):
    """With a context far larger than the text bound lets through, 300,000 characters of random text pass the
    static bounds; they are refused by the piecewise count, the tokenizer never seeing more than a piece (before,
    the worker tokenized all of it: ~130 MB of memory for the embedded model's tokenizer at its bound)."""
    engine, _ = _limits_and_codec(tiny_dir)
    engine.context = 100_000  # what the text bound allows then: 99,999 × the longest token
    seen = []
    encode = engine.encode

    def recording(x, raw=False):
        seen.append(len(x) if isinstance(x, str) else sum(len(m["content"]) for m in x))
        return encode(x, raw=raw)

    engine.encode = recording
    r = random.Random(0)
    text = "".join(r.choice("abcdefghijklmnopqrstuvwxyz0123456789 .,;") for _ in range(300_000))
    with serving(engine) as (port, _):
        status, body = _call(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert seen and max(seen) <= PIECE_CHARS, max(seen)


def test_the_unit_and_span_follow_the_normalizer():
    from tokenizers import normalizers as n

    assert _normalizer_shrink(None) == 0
    assert _normalizer_shrink(n.Sequence([])) == 0
    assert _normalizer_shrink(n.NFC()) == _normalizer_shrink(n.NFKC()) == 4  # "Ω + 3 marks" → one character
    assert _normalizer_shrink(n.Sequence([n.Prepend("▁"), n.Replace(" ", "▁")])) == 1  # SentencePiece's
    assert _normalizer_shrink(n.Sequence([n.NFD(), n.Lowercase()])) == 1
    for dropping in (n.StripAccents(), n.Strip(), n.BertNormalizer(), n.Replace("ab", ""),
                     n.Sequence([n.NFC(), n.StripAccents()])):
        assert _normalizer_shrink(dropping) is None, dropping  # may delete text: no text bound
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 0, "abc": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.normalizer = n.NFKC()
    codec = SimpleNamespace(tok=tok, byte_level=False)
    lim = prompt_limits(SimpleNamespace(context=10, codec=codec))
    assert (lim.unit, lim.span) == ("characters", 5 * 4)  # "[UNK]", times the composition factor
    tok.normalizer = n.StripAccents()
    assert prompt_limits(SimpleNamespace(context=10, codec=codec)).span is None


@needs_proc
def test_hostile_bodies_leave_the_servers_memory_flat(tiny_dir, tmp_path):
    """The bodies of the attack, nine at once: 125,000 empty messages (3.9 MB), and, within the body limit, 30,000
    empty messages and one message of 1 MiB of emoji (the densest text for a byte-level tokenizer). All are refused
    (413 or 400) without being tokenized; the server's peak RSS grows by less than 10% of the embedded model's
    memory plan (~450 MB), and it keeps answering. Before: +400 MB and more, each tokenized first."""
    bodies = [json.dumps({"messages": [{"role": "user", "content": ""}] * 125_000}).encode(),
              json.dumps({"messages": [{"role": "user", "content": ""}] * 30_000}).encode(),
              json.dumps({"messages": [{"role": "user", "content": "\U0001F600" * 262_000}]},
                         ensure_ascii=False).encode()]
    assert len(bodies[0]) > 3_900_000 and all(len(b) <= MAX_BODY for b in bodies[1:])

    def post(raw, out):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/v1/chat/completions", raw, {"Content-Type": "application/json"})
            out.append(conn.getresponse().status)
        except (BrokenPipeError, ConnectionResetError):  # refused (413) before it was all sent
            out.append(413)
        finally:
            conn.close()

    with open(tmp_path / "serve.log", "wb") as log:
        proc, port = _start(tiny_dir, log)
        try:
            before = _peak_rss_mb(proc.pid)
            statuses = []
            for raw in bodies:
                threads = [threading.Thread(target=post, args=(raw, statuses)) for _ in range(9)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
            growth = _peak_rss_mb(proc.pid) - before
            print(f"\npeak RSS {before:.0f} MB before, +{growth:.1f} MB after 27 hostile requests")
            assert sorted(statuses) == [400] * 18 + [413] * 9, statuses
            h = _health(port)
            assert h["invalid"] == 27 and h["completed"] == 0
            assert growth < 45, f"peak RSS grew {growth:.0f} MB"
            assert _call(port, "POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})[0] == 200
        finally:
            _stop(proc)


# ------------------------------------------------------------------------------ DNS rebinding

@pytest.mark.parametrize("host,allowed,bound,ok", [
    ("localhost:8080", (), None, True),
    ("LOCALHOST.", (), None, True),
    ("app.localhost:8080", (), None, True),
    ("127.0.0.1:8080", (), None, True),
    ("127.1.2.3", (), None, True),
    ("[::1]:8080", (), None, True),
    ("192.168.1.20:8080", (), "0.0.0.0", True),  # an address cannot be rebound
    (None, (), None, True),  # HTTP/1.0 without a Host: not a browser
    ("evil.example:8080", (), None, False),
    ("localhost.evil.example", (), None, False),
    ("127.0.0.1.nip.io:8080", (), None, False),
    ("box.lan:8080", (), "box.lan", True),  # the name the server was bound to
    ("box.lan:8080", (), "127.0.0.1", False),
    ("chat.example.org", ("chat.example.org",), None, True),
    ("Chat.Example.Org:443", ("chat.example.org",), None, True),
    ("other.example.org", ("chat.example.org",), None, False),
    ("anything.example", ("*",), None, True),
])
def test_host_policy(host, allowed, bound, ok):
    assert host_allowed(host, allowed, bound) == ok


def test_requests_for_other_host_names_are_refused_before_any_work():
    engine = StandIn()
    with serving(engine, allow_hosts=("chat.example.org",)) as (port, _):
        status, body = _call(port, "POST", "/v1/chat/completions", {"messages": MSGS},
                             {"Host": "rebound.example:8080"})
        assert status == 403 and body["error"]["code"] == "host_not_allowed"
        msg = body["error"]["message"]
        assert "\n" not in msg and "--allow-host rebound.example" in msg and "DNS rebinding" in msg
        assert _call(port, headers={"Host": "rebound.example"})[0] == 403  # GETs too: /health says what runs here
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "chat.example.org"):
            assert _call(port, headers={"Host": host})[0] == 200, host
        h = _health(port)
        assert engine.encoded == 0 and h["completed"] == 0


def test_cli_passes_the_bound_host_and_allowed_names(monkeypatch, capsys):

    seen = {}
    monkeypatch.setattr(serve, "_listen_check", lambda host, port: (None, None))
    monkeypatch.setattr(edge, "load", lambda *a, **k: SimpleNamespace(context=100, default_drafter="none",
                                                                       manifest=SimpleNamespace(name="m"),
                                                                       has_chat_template=True))
    monkeypatch.setattr("edge.args.chat_context_problem", lambda engine: None)
    monkeypatch.setattr(serve, "create_app", lambda engine, **kw: seen.update(kw) or SimpleNamespace(
        state=SimpleNamespace(worker=None)))
    monkeypatch.setattr(serve, "uvicorn_server", lambda config, worker: SimpleNamespace(
        run=lambda sockets=None: None, started=True))
    assert serve.main(["--host", "127.0.0.1", "--allow-host", "box.lan", "--allow-host", "chat.lan",
                       "--max-body-mb", "2"]) == 0
    assert seen["bound_host"] == "127.0.0.1" and seen["allow_hosts"] == ["box.lan", "chat.lan"]
    assert seen["max_body"] == 2 << 20


# ------------------------------------------------------------------------------ malformed fields, leaving clients

@pytest.mark.parametrize("role", [["user"], {"user": 1}, 5, None, True])
def test_a_role_that_is_not_a_string_is_a_400(role):
    with pytest.raises(ApiError) as e:
        parse_chat_request(json.dumps({"messages": [{"role": role, "content": "hi"}]}).encode(), 16)
    assert e.value.status == 400 and e.value.param == "messages[0].role"


HOSTILE = [[], {}, [[]], [{}], {"a": {"b": []}}, None, True, 0, -1, 1e308, "", "x" * 100, ["user"]]
FIELDS = ["messages", "model", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "edgespec", "logprobs", "top_logprobs", "response_format",
          "tool_choice"]


def test_hostile_values_in_every_field_are_refused_by_name_never_a_crash():
    """Every field, and every key of a message and of the edgespec object, given lists, objects, nulls, huge and
    negative numbers: parsed, or refused with a 400; nothing else (a TypeError was a 500)."""
    bodies = [{"messages": MSGS, f: v} for f in FIELDS for v in HOSTILE]
    bodies += [{"messages": [{"role": "user", "content": "hi", k: v}] if k != "content" else
                [{"role": "user", "content": v}]} for k in ("content", "name") for v in HOSTILE]
    bodies += [{"messages": [v]} for v in HOSTILE]
    bodies += [{"messages": MSGS, "edgespec": {k: v}} for k in ("drafter", "draft_len") for v in HOSTILE]
    limits = PromptLimits(100, 4)
    for body in bodies:
        try:
            parse_chat_request(json.dumps(body).encode(), 16, limits)
        except ApiError as e:
            assert e.status == 400, (body, e.status)
    # and a text completion's fields
    for body in [{"prompt": "hi", f: v} for f in FIELDS[1:] + ["prompt", "echo", "suffix", "best_of"] for v in HOSTILE]:
        try:
            parse_completion_request(json.dumps(body).encode(), 16, limits)
        except ApiError as e:
            assert e.status == 400, (body, e.status)


def test_a_client_that_leaves_mid_body_logs_at_most_one_short_line(caplog):
    caplog.set_level(logging.INFO)
    with serving(StandIn()) as (port, _):
        with _raw(port) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"messages\": [")
            time.sleep(0.2)  # the handler is reading the body
        deadline = time.monotonic() + 10
        while _health(port)["cancelled"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        h = _health(port)
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) <= 1 and all(r.exc_info is None and "\n" not in r.getMessage() for r in lines), \
        [r.getMessage()[:200] for r in lines]
    assert (h["cancelled"], h["invalid"], h["failed"]) == (1, 0, 0)


def _job():
    class Loop:
        def call_soon_threadsafe(self, fn, item):
            pass

    return Job(Request(MSGS, dict(max_tokens=4, temperature=0.0)), Loop())


def test_the_busy_503_gives_a_count_that_agrees_with_its_cap():
    """--max-queue 2: two wait while one runs, so the fourth request is refused with three held. The count
    includes the request the worker is about to take (before, it said "3 request(s) already waiting
    (--max-queue 2)")."""
    worker = Worker(engine=None, max_queue=2)  # not started: the three stay in the queue
    for _ in range(3):
        worker.submit(_job())
    with pytest.raises(ApiError) as e:
        worker.submit(_job())
    assert e.value.status == 503 and e.value.code == "server_busy"
    assert ("3 requests already running or waiting, the most --max-queue 2 allows (2 waiting while one runs)"
            in e.value.message)


def test_only_a_full_queue_counts_as_rejected():
    """/health: a too-long prompt (refused once queued), malformed JSON and a too-large body are invalid requests;
    rejected is the 503 of a full queue."""
    engine = StandIn(context=4)  # two messages encode to 5 tokens: too long once tokenized
    with serving(engine, max_queue=0, max_body=1000) as (port, _):
        status, body = _call(port, "POST", "/v1/chat/completions", {"messages": MSGS * 2})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/chat/completions", b"{not json", {"Content-Type": "application/json"})
        assert conn.getresponse().status == 400
        conn.close()
        assert _call(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2000}]}
                     )[0] == 413
        h = _health(port)
        assert (h["invalid"], h["rejected"], h["failed"], h["completed"]) == (3, 0, 0, 0), h
        engine.hold = True
        first = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        first.request("POST", "/v1/chat/completions", json.dumps({"messages": MSGS}),
                      {"Content-Type": "application/json"})
        try:
            assert engine.running.wait(10)
            assert _call(port, "POST", "/v1/chat/completions", {"messages": MSGS})[0] == 503
            engine.go.release()
            engine.go.release()
            assert first.getresponse().status == 200
        finally:
            first.close()
        h = _health(port)
        assert (h["invalid"], h["rejected"], h["completed"]) == (3, 1, 1), h


def test_cli_flags_for_the_caps_have_help_and_are_checked(capsys):

    r = subprocess.run([sys.executable, "-m", "edge.server.app", "--help"], capture_output=True, text=True, timeout=60)
    for flag in ("--max-connections", "--header-timeout", "--body-timeout", "--max-body-mb", "--allow-host"):
        assert flag in r.stdout, flag
    for bad in (["--max-connections", "0"], ["--header-timeout", "0"], ["--body-timeout", "-1"],
                ["--max-body-mb", "0"], ["--header-timeout", "inf"]):
        assert serve.main(["--model-dir", "/nonexistent", *bad]) == 2, bad
        assert "--max-connections must be >= 1" in capsys.readouterr().err
