"""Two or more real threads on one engine: a request that finds the engine busy gets EngineBusy at once (the
caller serializes by retrying), never a corrupted cache or an answer that differs from the single-threaded one.
The server's bounded queue with disconnecting clients is tested in test_server.py."""
from __future__ import annotations

import threading
import time

import pytest

import edge
from edge import EngineBusy

PROMPTS = ["the quick brown fox", "def add(a, b):", "Summarize: the council met", "abc abc abc abc"]


@pytest.fixture(scope="module")
def engine(exported_llama):
    return edge.load(exported_llama[0], drafter="hybrid", context=256)


@pytest.fixture(scope="module")
def expected(engine):
    return {p: engine.generate(p, max_tokens=24, drafter="none").token_ids for p in PROMPTS}


def run_together(*fns, timeout: float = 60) -> None:
    threads = [threading.Thread(target=f) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def test_second_thread_is_refused_while_the_first_streams(engine, expected):
    holding, release = threading.Event(), threading.Event()
    got = {}

    def first():
        ids = []
        for i, ch in enumerate(engine.stream(PROMPTS[0], max_tokens=24)):
            ids += ch.token_ids
            if i == 0:
                holding.set()
                release.wait(30)
        got["first"] = ids

    def second():
        holding.wait(30)
        try:
            engine.generate(PROMPTS[1], max_tokens=24)
            got["second"] = "ran"
        except EngineBusy as e:
            got["second"] = str(e)
        release.set()

    run_together(first, second)
    assert "another thread" in got["second"]
    assert got["first"] == expected[PROMPTS[0]]
    assert engine.generate(PROMPTS[1], max_tokens=24).token_ids == expected[PROMPTS[1]]
    assert engine.target.cache.length == len(engine.cached)


def generate_retrying(engine, prompt, **kw):
    """How a caller serializes: retry on EngineBusy."""
    busy = 0
    while True:
        try:
            return engine.generate(prompt, **kw), busy
        except EngineBusy:
            busy += 1
            time.sleep(0.001)


def test_threads_hammering_one_engine_get_the_single_threaded_answers(engine, expected):
    results, errors = [], []

    def worker(w):
        try:
            for i in range(6):
                p = PROMPTS[(w + i) % len(PROMPTS)]
                drafter = ("none", "lookup", "recycling", "hybrid", "model")[(w + i) % 5]
                r, busy = generate_retrying(engine, p, max_tokens=24, drafter=drafter)
                results.append((p, r.token_ids, busy, r.stats.drafter))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 18
    assert sum(busy for _, _, busy, _ in results) > 0  # the threads did collide (else the test proves nothing)
    for p, ids, _, drafter in results:
        assert ids == expected[p], (p, drafter)
    assert engine.target.cache.length == len(engine.cached)


def test_one_chat_from_two_threads_keeps_its_history(engine):
    engine.reset()
    chat = engine.chat()
    holding, release = threading.Event(), threading.Event()
    got = {}

    def first():
        for i, ch in enumerate(chat.send("the quick brown fox", max_tokens=16)):
            if i == 0:
                holding.set()
                release.wait(30)

    def second():
        holding.wait(30)
        try:
            chat.ask("def add(a, b):", max_tokens=16)
        except EngineBusy as e:
            got["second"] = str(e)
        release.set()

    run_together(first, second)
    assert "another thread" in got["second"]
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    assert chat.messages[0]["content"] == "the quick brown fox"


def test_reset_or_new_drafter_state_under_a_live_stream_is_refused(engine, expected):
    """A desktop app's "New chat" button may call reset() while an answer still streams (same thread, between
    chunks, or another thread). It used to empty the KV cache beneath the generator: the rest of that answer came
    from an empty context, silently. Now it is EngineBusy, and the answer goes on unchanged."""
    p = PROMPTS[0]
    chat = engine.chat()
    state = engine.drafter_state()
    stream = engine.stream(p, max_tokens=24, drafter="none")
    ids = list(next(stream).token_ids)
    for what in (engine.reset, lambda: engine.reset(keep_drafter_state=True), lambda: engine.set_drafter_state(state),
                 chat.reset):
        with pytest.raises(EngineBusy, match="close"):
            what()
    errors = []
    other = threading.Thread(target=lambda: errors.append(pytest.raises(EngineBusy, engine.reset)))
    other.start()
    other.join(30)
    assert len(errors) == 1  # the other thread was refused too
    for ch in stream:
        ids += ch.token_ids
    assert ids == expected[p]
    talk = chat.send("hello", max_tokens=8)  # a chat's own unfinished answer holds the chat
    next(talk)
    with pytest.raises(EngineBusy):
        chat.reset()
    talk.close()
    chat.reset()  # once closed, all of these work
    engine.set_drafter_state(state)
    engine.reset()
    assert chat.messages == [] and engine.generate(p, max_tokens=24, drafter="none").token_ids == expected[p]
