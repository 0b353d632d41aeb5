"""An app embedding the engine: stopping a running answer from another thread, closing the engine, and the API's
shape (keyword-only `raw`, arguments checked when a stream is made, the last request's stats)."""
from __future__ import annotations

import threading

import pytest

import edge
from edge import EngineError


@pytest.fixture
def engine(tiny_dir):
    e = edge.load(tiny_dir, drafter="none", context=256)
    yield e
    e.close()


def test_cancel_from_another_thread_ends_the_answer_and_keeps_what_was_shown(engine):
    """A Stop button: cancel() on the UI thread ends the worker's stream at its next step with finish_reason
    "cancelled"; the text is what was shown, and the next greedy answer (no reset) equals a fresh engine's."""
    prompt = "count with me: one two three"
    ref = engine.generate(prompt, max_tokens=40)
    engine.reset()
    chunks, third, go_on = [], threading.Event(), threading.Event()

    def worker():
        for ch in engine.stream(prompt, max_tokens=40):
            chunks.append(ch)
            if len(chunks) == 3:
                third.set()
                assert go_on.wait(30)

    t = threading.Thread(target=worker)
    t.start()
    assert third.wait(60)
    assert engine.cancel() is True  # from this thread, while the worker holds the stream
    go_on.set()
    t.join(60)
    assert not t.is_alive()
    assert chunks[-1].finish_reason == "cancelled" and len(chunks) == 4
    ids = [i for c in chunks for i in c.token_ids]
    assert ids == ref.token_ids[: len(ids)] and len(ids) < len(ref.token_ids)
    assert "".join(c.text for c in chunks) == engine.codec.decode(ids)
    assert engine.cancel() is False  # nothing running
    assert engine.generate(prompt, max_tokens=40).token_ids == ref.token_ids


def test_an_event_set_before_the_stream_starts_cancels_it_and_a_chat_keeps_its_history(engine):
    """The `cancel` Event a caller gives is read from the first prefill chunk on (a server's client that left
    before its turn); a chat turn cancelled before anything was shown leaves the history as it was."""
    stop = threading.Event()
    s = engine.stream("hello there", max_tokens=8, cancel=stop)
    stop.set()
    chunks = list(s)
    assert [c.finish_reason for c in chunks] == ["cancelled"] and not chunks[0].token_ids
    chat = engine.chat()
    chat.ask("hi", max_tokens=4)
    before = [dict(m) for m in chat.messages]
    stop = threading.Event()
    stop.set()
    r = chat.ask("and then?", max_tokens=4, cancel=stop)
    assert r.finish_reason == "cancelled" and r.token_ids == [] and chat.messages == before


def test_cancel_during_prefill_stops_between_chunks(engine, monkeypatch):
    """A long prompt's prefill stops at the next chunk: no token is generated."""
    monkeypatch.setattr(engine, "_prefill_chunk", lambda: 4)
    calls = []
    prefill = engine.target.prefill

    def spy(tokens, chunk, stop=None):
        def stop_after_two():
            calls.append(1)
            if len(calls) == 2:
                engine.cancel()
            return stop()
        return prefill(tokens, chunk, stop_after_two)

    monkeypatch.setattr(engine.target, "prefill", spy)
    r = engine.generate("a b c d e f g h i j k l m n o p q r s t", max_tokens=8)
    assert r.finish_reason == "cancelled" and r.token_ids == [] and r.text == ""
    assert len(calls) == 2  # asked before chunk 1, then cancelled as it asked before chunk 2
    assert engine.target.cache.length == 4  # the chunk done stays, as a stream closed early keeps its part


def test_last_stats_are_the_last_requests(engine):
    r = engine.generate("hello", max_tokens=8)
    assert r.finish_reason in ("stop", "length") and engine.last_stats is r.stats


def test_a_refused_request_leaves_the_last_stats(engine):
    r = engine.generate("hello", max_tokens=8)
    with pytest.raises(EngineError, match="context holds"):
        engine.generate("word " * 400, max_tokens=8)
    assert engine.last_stats is r.stats


def test_bad_arguments_are_refused_when_the_stream_is_made(engine):
    """An app builds the stream on one thread and iterates it on another: bad arguments are refused where it is
    made."""
    with pytest.raises(EngineError, match="max_tokens"):
        engine.stream("hi", max_tokens=0)
    with pytest.raises(EngineError, match="prompt must be"):
        engine.stream(5)


def test_raw_is_keyword_only(engine):
    """generate("hi", 5) used to mean raw=True with the default max_tokens: now a TypeError."""
    with pytest.raises(TypeError):
        engine.generate("hi", 5)
    with pytest.raises(TypeError):
        engine.stream("hi", True)
    assert engine.generate("hi", raw=True, max_tokens=2).token_ids


def test_close_releases_the_sessions_and_later_calls_say_so(tiny_dir):
    with edge.load(tiny_dir, drafter="none", context=64) as e:
        assert e.generate("hi", max_tokens=2).token_ids
    assert e.target is None
    for call in (lambda: e.generate("hi"), lambda: e.stream("hi"), e.reset, e.chat, lambda: e.cached,
                 e.drafter_state):
        with pytest.raises(EngineError, match="closed"):
            call()
    e.close()  # twice is fine


def test_an_error_inside_the_with_block_is_the_one_raised_even_with_a_stream_open(tiny_dir):
    with pytest.raises(ValueError, match="the app's own"):
        with edge.load(tiny_dir, drafter="none", context=64) as e:
            s = e.stream("hi", max_tokens=8)
            next(s)
            raise ValueError("the app's own")
    s.close()
    with pytest.raises(edge.EngineBusy, match="cancel"):  # without an error on its way, the open stream is said
        with edge.load(tiny_dir, drafter="none", context=64) as e:
            s = e.stream("hi", max_tokens=8)
            next(s)
    s.close()


def test_close_while_generating_is_refused(engine):
    s = engine.stream("hi", max_tokens=8)
    next(s)
    with pytest.raises(edge.EngineBusy, match="cancel"):
        engine.close()
    s.close()
    engine.close()


def test_a_model_that_is_not_a_name_or_path_is_one_line():
    with pytest.raises(edge.ModelDirError, match="model must be a directory or a model name"):
        edge.load(123)
