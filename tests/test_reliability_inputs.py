"""Bad and odd input on the tiny export: empty and over-long prompts, chat history overflow (refuse / drop oldest),
control characters and lone surrogates, multi-byte text split across tokens (fuzzed), stop strings that straddle
an accepted multi-token draft, absurd sampling values. Refusals are EngineErrors that leave the engine usable."""
from __future__ import annotations

import copy
import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edge
from edge import EngineError
from edge.engine import ContextFull
from edge.text import StreamDecoder, TextCodec
from edge.output import AnswerText

FUZZ = settings(max_examples=150, deadline=None, database=None)
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return edge.load(tiny_dir, drafter="none", context=256)


@pytest.fixture(scope="module")
def small(tiny_dir):
    """A 128-token context: chats overflow after a few turns."""
    return edge.load(tiny_dir, drafter="lookup", context=128)


def consistent(e) -> None:
    assert e.target.cache.length == len(e.cached)


# ----------------------------------------------------------------------------- empty and over-long prompts

def test_empty_prompt(engine):
    with pytest.raises(EngineError, match="empty prompt"):
        engine.generate("", raw=True)
    with pytest.raises(EngineError, match="empty prompt"):  # a blank question string: refused, with the reason
        engine.generate(" ", max_tokens=4)
    # an empty user message given as messages is a valid chat turn (the template is not empty; OpenAI clients send it)
    r = engine.generate([{"role": "user", "content": ""}], max_tokens=4)
    assert len(r.token_ids) == 4 or r.finish_reason == "stop"
    consistent(engine)


def test_prompt_longer_than_context_names_both_numbers(small):
    text = "the quick brown fox " * 40
    n = len(small.encode(text))
    with pytest.raises(EngineError, match=rf"prompt is {n} tokens but the context holds 128"):
        small.generate(text)
    consistent(small)


def test_max_tokens_beyond_the_context_stops_at_the_window(small):
    r = small.generate("hi", max_tokens=10**12)
    assert r.finish_reason in ("length", "stop")
    assert len(small.encode("hi")) + len(r.token_ids) <= small.context
    consistent(small)


def test_a_prompt_that_fills_the_context_is_refused_and_one_that_leaves_a_slot_is_answered(tiny_dir):
    """An answer needs at least one free slot after the prompt: a prompt of exactly `context` tokens is refused
    (nothing is left for even one token), one of `context - 1` tokens gets its one token."""
    n = len(edge.load(tiny_dir, drafter="none", context=256).encode(PROMPT))
    with pytest.raises(EngineError, match=rf"prompt is {n} tokens but the context holds {n}"):
        edge.load(tiny_dir, drafter="none", context=n).generate(PROMPT)
    e = edge.load(tiny_dir, drafter="none", context=n + 1)
    r = e.generate(PROMPT, max_tokens=10)
    assert len(r.token_ids) == 1 and r.finish_reason == "length"


# ----------------------------------------------------------------------------- chat history overflow

QUESTIONS = ["name a river", "and a city?", "what is 7 times 8", "say hello", "one more word", "why?"]


def test_chat_overflow_is_refused_with_the_numbers_by_default(small):
    small.reset()
    chat = small.chat(system="Be terse.")
    for i in range(40):
        before = [dict(m) for m in chat.messages]
        try:
            chat.ask(QUESTIONS[i % len(QUESTIONS)], max_tokens=16)
        except EngineError as e:
            m = re.search(r"chat history is (\d+) tokens but the context holds (\d+)", str(e))
            assert m and int(m.group(1)) >= int(m.group(2)) == 128, str(e)
            assert "drop_oldest" in str(e)
            assert chat.messages == before  # the refused question is not kept
            consistent(small)
            return
    pytest.fail("40 turns never overflowed a 128-token context")


def test_chat_drop_oldest_keeps_the_system_message_and_matches_a_fresh_chat(small, tiny_dir):
    small.reset()
    chat = small.chat(system="Be terse.", overflow="drop_oldest")
    for i in range(20):
        chat.ask(QUESTIONS[i % len(QUESTIONS)], max_tokens=16)
        assert chat.messages[0] == {"role": "system", "content": "Be terse."}
        assert [m["role"] for m in chat.messages[1:]] == ["user", "assistant"] * ((len(chat.messages) - 1) // 2)
        assert len(small.encode(chat.messages[:-1])) + 16 <= small.context
        consistent(small)
    assert chat.dropped > 0 and len(chat.messages) < 41
    # the last answer is what a fresh engine answers to the same (shortened) visible history
    last = chat.messages[-1]["content"]
    fresh = edge.load(tiny_dir, drafter="none", context=128)
    assert fresh.generate(chat.messages[:-1], max_tokens=16).text == last


def test_drop_oldest_refuses_when_the_question_alone_does_not_fit(small):
    chat = small.chat(system="Be terse.", overflow="drop_oldest")
    chat.ask("hello", max_tokens=4)
    before, dropped = [dict(m) for m in chat.messages], chat.dropped
    with pytest.raises(EngineError, match=r"chat history is \d+ tokens but the context holds 128.*shorten"):
        chat.ask("word " * 200, max_tokens=4)
    assert chat.messages == before and chat.dropped == dropped


def test_unknown_overflow_policy(small):
    with pytest.raises(EngineError, match="overflow"):
        small.chat(overflow="truncate_middle")


def test_a_chat_turn_that_exactly_fills_the_context_is_context_full(tiny_dir):
    n = len(edge.load(tiny_dir, drafter="none", context=256).encode([{"role": "user", "content": PROMPT}]))
    chat = edge.load(tiny_dir, drafter="none", context=n).chat()
    with pytest.raises(ContextFull) as e:
        chat.ask(PROMPT, max_tokens=4)
    assert (e.value.n, e.value.context, e.value.alone) == (n, n, True) and chat.messages == []


def test_a_question_too_long_alone_says_so_with_a_system_message(tiny_dir):
    chat = edge.load(tiny_dir, drafter="none", context=64).chat(system="Be terse.")
    with pytest.raises(ContextFull) as e:
        chat.ask("word " * 100, max_tokens=4)
    assert e.value.alone and chat.messages == [{"role": "system", "content": "Be terse."}]


def test_drop_oldest_reserves_at_most_half_the_context_for_the_answer(tiny_dir):
    """max_tokens beyond the context (allowed: the answer stops at the window) must not drop turns that fit with
    half the context left for the answer."""
    e = edge.load(tiny_dir, drafter="none", context=256)
    chat = e.chat(overflow="drop_oldest")
    chat.ask("name a river", max_tokens=2)
    chat.ask("and a city?", max_tokens=2)
    history = [dict(m) for m in chat.messages]
    assert len(e.encode(history + [{"role": "user", "content": "why?"}])) + 128 <= 256
    chat.ask("why?", max_tokens=10**6)
    assert chat.dropped == 0 and chat.messages[:4] == history


def test_drop_oldest_keeps_a_history_that_fits_exactly(tiny_dir):
    """Prompt plus the answer's reserve exactly filling the context fits: nothing is dropped."""
    history = [{"role": "user", "content": "name a river"}, {"role": "assistant", "content": "the Nile"}]
    n = len(edge.load(tiny_dir, drafter="none", context=256).encode(history + [{"role": "user", "content": "why?"}]))
    chat = edge.load(tiny_dir, drafter="none", context=n + 5).chat(overflow="drop_oldest")
    chat.messages = [dict(m) for m in history]
    chat.ask("why?", max_tokens=5)
    assert chat.dropped == 0 and chat.messages[:2] == history


# ----------------------------------------------------------------------------- odd characters

@pytest.mark.parametrize("prompt", ["a\x00b", "\x1b[31mred\x1b[0m", "\u202eevil\u202c", "\ufeffbom", "tab\tnl\n\r",
                                    "\x7f\x08", "𝕏 \U0010ffff", "e\u0301\u0301\u0301"])
def test_control_and_unusual_characters(engine, prompt):
    chunks = list(engine.stream(prompt, max_tokens=12))
    for c in chunks:
        c.text.encode("utf-8")  # strict: no surrogates, never half a character
    assert chunks[-1].finish_reason in ("stop", "length")
    consistent(engine)


def test_lone_surrogate_is_read_as_replacement_character(engine):
    a = engine.generate("x\ud800y", max_tokens=8)
    b = engine.generate("x\ufffdy", max_tokens=8)
    assert a.token_ids == b.token_ids


# ----------------------------------------------------------------------------- multi-byte text split across tokens

def deltas(codec, ids, cuts, bytewise: bool = True) -> list[str]:
    """Stream `ids` pushed in groups ending at `cuts`; `bytewise` False takes the re-decoding path that tokenizers
    other than byte-level BPE use (the test tokenizer is byte-level, so both paths run on the same ids)."""
    assert codec.byte_level
    codec = copy.copy(codec)
    codec._byte_level = bytewise
    dec, out, prev = StreamDecoder(codec), [], 0
    for c in sorted(set(cuts)) + [len(ids)]:
        out.append(dec.push(ids[prev:c]))
        prev = c
    out.append(dec.flush())
    return out


@pytest.mark.parametrize("bytewise", [True, False])
@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_an_answer_cut_inside_a_character_ends_before_it(engine, bytewise, stop):
    """max_tokens reached inside a character's bytes: the answer's text ends with the last whole character, not
    a U+FFFD (as llama.cpp's server does); its ids still hold every token generated."""
    codec = copy.copy(engine.codec)
    codec._byte_level = bytewise
    ids = codec.encode("ab😀日")
    cut_inside = 0
    for n in range(1, len(ids) + 1):
        out = AnswerText(codec, set(), n, stop)
        ch = out.push(list(ids), 0, False)
        full = codec.decode(ids[:n])
        cut_inside += full.endswith("\ufffd")
        assert ch.finish_reason == "length" and out.ids == ids[:n]
        assert ch.text == full.rstrip("\ufffd") and "\ufffd" not in ch.text, (n, ch.text)
    assert cut_inside  # the tokenizer splits these characters' bytes, so some cut lands inside one


MULTIBYTE = st.text(alphabet=st.sampled_from(list("aé😀日本語ß€\u0301🏳️‍🌈👍🏽 \n")), min_size=1, max_size=24)


@pytest.mark.parametrize("bytewise", [True, False])
@FUZZ
@given(text=MULTIBYTE, data=st.data())
def test_streamed_text_is_whole_characters_for_any_split(engine, text, data, bytewise):
    """Text the tokenizer splits inside characters (byte-level BPE), pushed in random groups of tokens: every delta
    is whole characters (no U+FFFD, encodable) and the deltas add up to the text."""
    ids = engine.codec.encode(text)
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids)))
    out = deltas(engine.codec, ids, cuts, bytewise)
    assert "".join(out) == engine.codec.decode(ids) == text
    for d in out:
        assert "\ufffd" not in d
        d.encode("utf-8")


@pytest.mark.parametrize("bytewise", [True, False])
@FUZZ
@given(ids=st.lists(st.integers(3, 383), min_size=1, max_size=30), data=st.data())
def test_streamed_text_of_arbitrary_tokens_adds_up(engine, ids, data, bytewise):
    """Any token sequence (invalid UTF-8 included, as a model may emit): deltas add up to the full decode, and a
    U+FFFD only appears where the full decode has one (an incomplete character held back, never split)."""
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids)))
    out = deltas(engine.codec, ids, cuts, bytewise)
    full = engine.codec.decode(ids)
    assert "".join(out) == full
    assert sum(d.count("\ufffd") for d in out) == full.count("\ufffd")
    for d in out:
        d.encode("utf-8")


def _tokenizer(tmp_path, vocab: dict, decoder: dict | None) -> TextCodec:
    import json

    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab))))
    spec = json.loads(tok.to_str())
    spec["decoder"] = decoder
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return TextCodec(path, None, None, ())


def test_streaming_a_metaspace_tokenizer_keeps_the_spaces(tmp_path):
    """SentencePiece-style tokenizers (Llama 2, Mistral, Gemma: ▁ for a space) take the re-decoding path; the
    suite only streamed byte-level ones, so a decoder that dropped every word's space passed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "\u2581foo": 3, "!": 4}
    tok = Tokenizer(models.Unigram([(k, -1.0) for k in vocab], unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(tmp_path / "tokenizer.json", None, None, ())
    ids = codec.encode("hello world foo!")
    assert not codec.byte_level and len(ids) == 4
    for cuts in ([1, 2, 3], [2], []):
        dec, out, prev = StreamDecoder(codec), [], 0
        for c in cuts + [len(ids)]:
            out.append(dec.push(ids[prev:c]))
            prev = c
        out.append(dec.flush())
        assert "".join(out) == codec.decode(ids) == "hello world foo!", out


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
# the decoder SmolLM2's GGUF tokenizer comes with: ByteFallback, Fuse and a ▁ -> space Replace before ByteLevel
SEQUENCE = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"},
                                              {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                              BYTE_LEVEL]}


@pytest.mark.parametrize("vocab, decoder, bytewise", [
    ({"a": 0, "Ġb": 1, "Ã©": 2}, BYTE_LEVEL, True),
    ({"a": 0, "Ġb": 1, "Ã©": 2}, SEQUENCE, True),
    ({"a": 0, "Ġb": 1, "€": 2}, BYTE_LEVEL, False),  # a character with no byte: ByteLevel keeps its UTF-8
    ({"a": 0, "<0x41>": 1}, SEQUENCE, False),  # a byte-fallback piece
    ({"a": 0, "\u2581b": 1}, {**SEQUENCE, "decoders": SEQUENCE["decoders"][2:]}, False),  # ▁ has no byte either
    ({"a": 0, "b": 1}, {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "a"}, "content": "b"},
                                                         BYTE_LEVEL]}, False),  # a Replace tokens can spell
    ({"a": 0, "b": 1}, {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}, False),
    ({"a": 0, "b": 1}, None, False),
])
def test_bytewise_decoding_only_where_it_equals_the_tokenizer(tmp_path, vocab, decoder, bytewise):
    """The incremental byte path is taken only for decoders that concatenate token bytes, and where it is taken it
    decodes every token as the tokenizer does."""
    codec = _tokenizer(tmp_path, vocab, decoder)
    assert codec.byte_level == bytewise
    if bytewise:
        for i in vocab.values():
            assert codec.token_bytes(i).decode("utf-8", "replace") == codec.decode([i])


# ----------------------------------------------------------------------------- stop strings across a draft

PROMPTS = ["the quick brown fox", "def add(a, b):", "Summarize: the council met", "1 2 3 4 5 6 7 8",
           "abc abc abc abc"]


def find_straddling_stop(engine):
    """A (prompt, drafter, stop) where the stop string starts before an accepted multi-token draft and ends inside
    it: its first character is in the text before the chunk, its last one in the chunk's second token."""
    codec = engine.codec
    for drafter in ("lookup", "recycling", "hybrid", "model"):
        for p in PROMPTS:
            chunks = list(engine.stream(p, max_tokens=48, drafter=drafter, draft_len=4))
            ids = [t for c in chunks for t in c.token_ids]
            full = "".join(c.text for c in chunks)
            pos = 0
            for c in chunks:
                if c.drafted >= 1 and pos > 0:
                    b0 = codec.decode(ids[:pos])
                    b1 = codec.decode(ids[: pos + 1])
                    b2 = codec.decode(ids[: pos + 2])
                    ok = all(full.startswith(b) for b in (b0, b1, b2)) and len(b0) < len(b1) < len(b2)
                    if ok and len(b0) > 0:
                        stop = full[len(b0) - 1 : len(b1) + 1]
                        if full.find(stop) == len(b0) - 1 and "\ufffd" not in stop:
                            return p, drafter, stop, full
                pos += len(c.token_ids)
    return None


def test_stop_string_straddling_an_accepted_draft(engine, tiny_dir):
    engine.reset()
    found = find_straddling_stop(engine)
    assert found is not None, "no accepted multi-token draft to straddle"
    prompt, drafter, stop, full = found
    chunks = list(engine.stream(prompt, max_tokens=48, drafter=drafter, draft_len=4, stop=[stop]))
    text = "".join(c.text for c in chunks)
    assert text == full[: full.find(stop)] and chunks[-1].finish_reason == "stop"
    assert all(stop not in c.text for c in chunks)
    consistent(engine)
    # in a chat, the next turn sees only the visible text: equal to a fresh chat fed the same history
    chat = engine.chat()
    r1 = chat.ask(prompt, max_tokens=48, drafter=drafter, draft_len=4, stop=[stop])
    assert r1.text == text
    r2 = chat.ask("and then?", max_tokens=16, drafter=drafter)
    fresh = edge.load(tiny_dir, drafter="none", context=256)
    assert fresh.generate(chat.messages[:-1], max_tokens=16).token_ids == r2.token_ids


# ----------------------------------------------------------------------------- absurd sampling values

@pytest.mark.parametrize("kw,match", [
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=-1e-9), "temperature"), (dict(top_p=float("nan")), "top_p"), (dict(top_p=1 + 1e-9), "top_p"),
    (dict(top_p=-0.5), "top_p"), (dict(top_k=1.5), "top_k"), (dict(max_tokens=-5), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"), (dict(max_tokens=True), "max_tokens"), (dict(max_tokens=None), "max_tokens"),
    (dict(seed=-1), "seed"), (dict(seed="7"), "seed"), (dict(seed=1.5), "seed"), (dict(stop=[""]), "stop"),
    (dict(stop=["ok", None]), "stop"), (dict(draft_len=65), "draft_len"), (dict(draft_len=-1), "draft_len"),
    (dict(temperature=None), "temperature"), (dict(temperature="0.5"), "temperature"), (dict(top_p=None), "top_p"),
    (dict(draft_len="3"), "draft_len"), (dict(stop=5), "stop"), (dict(top_k=None), "top_k"),
])
def test_absurd_values_are_refused_and_leave_the_engine_usable(engine, kw, match):
    ref = engine.generate("hello", max_tokens=6)
    with pytest.raises(EngineError, match=match):
        engine.generate("hello", **{"max_tokens": 6, **kw})
    consistent(engine)
    assert engine.generate("hello", max_tokens=6).token_ids == ref.token_ids


def test_extreme_but_valid_values(engine):
    greedy = engine.generate("hello", max_tokens=8)
    # a temperature so small that 1/T overflows is the greedy limit (unless the top logits tie exactly)
    tiny_t = engine.generate("hello", max_tokens=8, temperature=1e-300, seed=1, drafter="lookup")
    assert tiny_t.token_ids == greedy.token_ids
    hot = engine.generate("hello", max_tokens=8, temperature=1e6, top_k=10**9, seed=2)
    assert len(hot.token_ids) == 8 or hot.finish_reason == "stop"
    assert engine.generate("hello", max_tokens=8, top_p=1e-12, temperature=1.0, seed=3).token_ids == greedy.token_ids
    consistent(engine)


@pytest.mark.parametrize("prompt,match", [(None, "string or a list"), (5, "string or a list"), (b"hi", "got bytes"),
                                          ([], "no messages"), ([{"role": "user"}], "bad message")])
def test_prompt_of_the_wrong_kind_is_refused(engine, prompt, match):
    with pytest.raises(EngineError, match=match):
        engine.generate(prompt, max_tokens=4)
    consistent(engine)


@pytest.mark.parametrize("kw", [dict(temperature=None), dict(stop=5), dict(max_tokens=0)])
def test_refused_chat_turn_leaves_the_history_as_it_was(engine, kw):
    chat = engine.chat()
    chat.ask("hello", max_tokens=4)
    before = [dict(m) for m in chat.messages]
    with pytest.raises(EngineError):
        chat.ask("and then?", **{"max_tokens": 4, **kw})
    assert chat.messages == before
    consistent(engine)


@pytest.mark.parametrize("kw,match", [(dict(threads=0), "threads"), (dict(threads="2"), "threads"),
                                      (dict(threads=1.5), "threads"),
                                      (dict(context=0), "context"), (dict(context=-5), "context"),
                                      (dict(context=10**6), "exported for"), (dict(verify="bogus"), "verify")])
def test_bad_load_arguments_are_refused(tiny_dir, kw, match):
    with pytest.raises(EngineError, match=match):
        edge.load(tiny_dir, drafter="none", **kw)


def test_chat_failure_before_the_first_chunk_restores_the_history_and_after_it_keeps_the_turn(engine, monkeypatch):
    """Any error before anything was shown (not only EngineError) leaves the history as it was; once text was
    shown, the turn stays with that text, as for an interrupt."""
    chat = engine.chat()
    chat.ask("hello", max_tokens=4)
    before = [dict(m) for m in chat.messages]
    real = engine.stream

    def failing(after: int):
        def stream(*a, **k):
            for i, ch in enumerate(real(*a, **k)):
                if i == after:
                    raise RuntimeError("simulated failure")
                yield ch
        return stream

    monkeypatch.setattr(engine, "stream", failing(0))
    with pytest.raises(RuntimeError):
        chat.ask("and then?", max_tokens=6)
    assert chat.messages == before
    monkeypatch.setattr(engine, "stream", failing(1))
    shown = []
    with pytest.raises(RuntimeError):
        for ch in chat.send("and then?", max_tokens=6):
            shown.append(ch.text)
    assert len(shown) == 1 and chat.messages[:-2] == before
    assert chat.messages[-2:] == [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": shown[0]}]
    monkeypatch.undo()
    consistent(engine)


# ----------------------------------------------------------------------------- what an embedding app passes

def test_every_deliberate_error_is_an_engine_error(engine, tmp_path):
    """An app catches edge.EngineError around load and generation: a model directory's problems and a drafter
    the export lacks are EngineErrors too (they were bare ModelDirErrors)."""
    assert issubclass(edge.ModelDirError, EngineError)
    with pytest.raises(EngineError, match="edge_model.json|manifest"):
        edge.load(tmp_path)
    e = edge.load(engine.model_dir, drafter="none", context=64)
    # as an export made without a drafter graph
    e.manifest = dataclasses.replace(e.manifest, graphs=tuple(g for g in e.manifest.graphs if g.role != "drafter"))
    with pytest.raises(EngineError, match="drafter='lookup'"):
        e.generate("hello", max_tokens=4, drafter="model")


def test_a_chat_template_refusal_is_an_engine_error(tiny_dir):
    """Templates of Mistral, Llama-2 or Gemma raise for a system message or two user turns in a row; that was a
    bare ValueError (and a 500 from edge-serve)."""
    e = edge.load(tiny_dir, drafter="none", context=64)
    e.codec._template_src = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                             "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}"
                             "{% endfor %}")
    e.codec._template = None
    with pytest.raises(EngineError, match="System role not supported"):
        e.generate([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], max_tokens=4)
    assert len(e.generate([{"role": "user", "content": "hi"}], max_tokens=4).token_ids) >= 1


def test_openai_message_shapes_are_taken(engine):
    """Content as a list of text parts and the `developer` role, as OpenAI clients send them (edge-serve took
    them, the Python API refused them): the same prompt as the plain form."""
    plain = engine.encode([{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}])
    parts = engine.encode([{"role": "developer", "content": "be brief"},
                           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert parts == plain
    with pytest.raises(EngineError, match="only text parts"):
        engine.encode([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(EngineError, match="role 'wizard'"):
        engine.encode([{"role": "wizard", "content": "x"}])
    # an assistant turn that only called tools has content null, and a history resent from such a chat is taken
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert engine.encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": calls},
                          {"role": "user", "content": "b"}]) == \
        engine.encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
                       {"role": "user", "content": "b"}])
    with pytest.raises(EngineError, match="content must be"):
        engine.encode([{"role": "user", "content": None}])


def test_stop_string_ids_do_not_depend_on_the_drafter(tiny_dir):
    """The answer's ids end with the token that completes the stop string, whatever the drafter accepted in that
    step (a lookup step that accepted 5 tokens used to keep all of them, and count them)."""
    e = edge.load(tiny_dir, drafter="none", context=256)
    prompt = "abc abc abc abc abc abc abc abc abc abc"
    ref = e.generate(prompt, max_tokens=40, drafter="none")
    text = ref.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and len(text) > 12, text
    got = {}
    for kind in ("none", "lookup", "hybrid"):
        e.reset()
        r = e.generate(prompt, max_tokens=40, drafter=kind, stop=[stop])
        got[kind] = (r.text, r.token_ids, r.stats.generated)
        assert r.finish_reason == "stop" and stop not in r.text and r.stats.generated == len(r.token_ids)
        assert r.stats.accepted <= r.stats.drafted
        assert stop in e.codec.decode(r.token_ids)  # the last id completes it
        assert stop not in e.codec.decode(r.token_ids[:-1])
        consistent(e)
    assert got["lookup"] == got["none"] == got["hybrid"], got


def test_seeded_sampling_with_the_model_drafter_reproduces(tiny_dir):
    """With a seed the model drafter drafts its argmax, so each emitted token is one draw from p: the answer equals
    plain sampling's with that seed, whatever the drafter learned before (it used to differ run to run)."""
    e = edge.load(tiny_dir, drafter="none", context=256)
    kw = dict(max_tokens=24, temperature=1.0, seed=7)
    plain = e.generate("the quick brown fox", drafter="none", **kw).token_ids
    runs = []
    for warm in ("", "abc abc abc abc", "def add(a, b):"):
        if warm:  # different history: different acceptance statistics and draft lengths
            e.generate(warm, max_tokens=16, drafter="model", temperature=0.8)
        r = e.generate("the quick brown fox", drafter="model", **kw)
        runs.append(r.token_ids)
        assert r.stats.drafter == "model"
    assert all(ids == plain for ids in runs), (plain, runs)


@pytest.mark.parametrize("bad", [None, "5", [5]])
def test_drop_oldest_refuses_a_bad_max_tokens_by_name(small, bad):
    chat = small.chat(overflow="drop_oldest")
    with pytest.raises(EngineError, match="max_tokens"):
        chat.ask("hello", max_tokens=bad)
    assert chat.messages == []


def test_any_real_number_is_a_temperature(engine):
    from fractions import Fraction

    a = engine.generate("hello", max_tokens=6, temperature=Fraction(7, 10), top_p=Fraction(9, 10), seed=3)
    b = engine.generate("hello", max_tokens=6, temperature=0.7, top_p=0.9, seed=3)
    assert a.token_ids == b.token_ids
