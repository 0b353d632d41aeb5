"""Interruption in the middle of a step: a KeyboardInterrupt injected into the N-th target (or drafter) call —
prefill, a verify call, a drafter call — or a stream closed mid-answer leaves the KV cache, the drafters' state and
the chat history consistent: the next turn equals a fresh chat fed the same visible history."""
from __future__ import annotations

import pytest

import edge


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return edge.load(tiny_dir, drafter="none", context=256)


class Interrupt:
    """Wrap session.call (every forward goes through it): the `after`-th call from now raises KeyboardInterrupt
    (before the call runs)."""

    def __init__(self, monkeypatch, session, after: int):
        self.calls, self.after, real = 0, after, session.call

        def call(*a, **k):
            self.calls += 1
            if self.calls == self.after:
                raise KeyboardInterrupt
            return real(*a, **k)

        monkeypatch.setattr(session, "call", call)


def check_state(e) -> None:
    assert e.target.cache.length == len(e.cached)
    if e._drafter_sess is not None:  # the model drafter's own cache holds one id per committed slot
        assert e._drafter_sess.cache.length == len(e._drafter_sess.cache.tokens)
    lk = e.lookup
    assert max(lk.index.values(), default=0) <= len(lk.history)  # the n-gram index points inside the history


def next_turn_equals_fresh(chat, reference, drafter) -> None:
    r = chat.ask("and then?", max_tokens=16, drafter=drafter)
    reference.reset()
    assert reference.generate(chat.messages[:-1], max_tokens=16).token_ids == r.token_ids


@pytest.mark.parametrize("drafter", ["lookup", "recycling", "hybrid", "model"])
@pytest.mark.parametrize("after", [1, 2, 5])  # 1: the prefill call; 2: the first verify call; 5: a later one
def test_keyboard_interrupt_inside_a_target_call(tiny_dir, reference, monkeypatch, drafter, after):
    e = edge.load(tiny_dir, drafter=drafter, context=256)
    chat = e.chat(system="Be brief.")
    chat.ask("the quick brown fox", max_tokens=12)
    shown = []
    inj = Interrupt(monkeypatch, e.target, after)
    with pytest.raises(KeyboardInterrupt):
        for ch in chat.send("abc abc abc abc abc", max_tokens=40, draft_len=4):
            shown.append(ch.text)
    assert inj.calls == after
    monkeypatch.undo()
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(shown)}
    check_state(e)
    next_turn_equals_fresh(chat, reference, drafter)
    check_state(e)


@pytest.mark.parametrize("after", [1, 3])
def test_keyboard_interrupt_inside_a_drafter_call(tiny_dir, reference, monkeypatch, after):
    e = edge.load(tiny_dir, drafter="model", context=256)
    chat = e.chat()
    chat.ask("def add(a, b):", max_tokens=8)  # builds the drafter session
    inj = Interrupt(monkeypatch, e._drafter_sess, after)
    shown = []
    with pytest.raises(KeyboardInterrupt):
        for ch in chat.send("Summarize: the council met", max_tokens=40, draft_len=3):
            shown.append(ch.text)
    assert inj.calls == after
    monkeypatch.undo()
    assert chat.messages[-1]["content"] == "".join(shown)
    check_state(e)
    next_turn_equals_fresh(chat, reference, "model")


@pytest.mark.parametrize("drafter", ["hybrid", "model"])
def test_closing_the_stream_after_each_chunk_count(tiny_dir, reference, drafter):
    """Close after 1, 2, 3 … chunks in successive turns: every turn's history is what was shown."""
    e = edge.load(tiny_dir, drafter=drafter, context=256)
    chat = e.chat()
    for n in (1, 2, 3):
        stream = chat.send(f"turn {n}: the quick brown fox", max_tokens=30, draft_len=4)
        shown = [next(stream).text for _ in range(n)]
        stream.close()
        assert chat.messages[-1]["content"] == "".join(shown)
        check_state(e)
    next_turn_equals_fresh(chat, reference, drafter)


def test_interrupted_sampling_turn_keeps_state_consistent(tiny_dir, reference, monkeypatch):
    """Sampling mode: the interrupted turn's randomness does not leak into the greedy turn that follows."""
    e = edge.load(tiny_dir, drafter="hybrid", context=256)
    chat = e.chat()
    Interrupt(monkeypatch, e.target, 3)
    with pytest.raises(KeyboardInterrupt):
        list(chat.send("the quick brown fox", max_tokens=30, temperature=0.9, seed=5))
    monkeypatch.undo()
    check_state(e)
    next_turn_equals_fresh(chat, reference, "hybrid")


def test_an_interrupted_prefill_keeps_the_prefix_it_reused(fresh, monkeypatch):
    """Ctrl-C during a prefill rolls the cache back to what it shares with the new prompt (still valid), not to
    nothing: the next request re-uses it."""
    fresh.generate("the quick brown fox", max_tokens=4)
    before = list(fresh.cached)
    ids = fresh.encode("the quick brown cat")
    lcp = next(i for i, (a, b) in enumerate(zip(before, ids)) if a != b)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(fresh.target, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fresh.generate("the quick brown cat", max_tokens=4)
    monkeypatch.undo()
    assert fresh.cached == ids[:lcp] and fresh.target.cache.length == lcp
    assert fresh.generate("the quick brown cat", max_tokens=4).stats.reused_tokens == lcp
