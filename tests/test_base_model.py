"""A base model (no chat template) used as one: the engine continues a prompt string as text, with BOS where the
tokenizer puts it and never twice, and refuses messages; `Chat` keeps one running text; edge-chat says so once and
continues what is typed. The model is the session export with its chat template removed and a tokenizer that
puts BOS before a text, as Gemma 3's does; references are plain decoding of the text on a fresh engine and the
tokenizer's own encoding."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

import edge
from conftest import BOS
from edge import EngineError
from helpers import run_module

TEXT = "the quick brown fox"
NOTE = "is a base model without a chat template: it continues text rather than answering messages"


@pytest.fixture(scope="module")
def base(base_model):
    return edge.load(base_model, drafter="none", context=256)


def _reference(base_model, text: str, max_tokens: int):
    """Plain decoding of `text` as a raw prompt, on an engine of its own."""
    return edge.load(base_model, drafter="none", context=256).generate(text, raw=True, max_tokens=max_tokens)


# ----------------------------------------------------------------------------- the engine

def test_a_prompt_string_is_the_text_to_continue_with_the_tokenizers_bos(base, base_model):
    tok = Tokenizer.from_file(str(base_model / "tokenizer.json"))
    want = tok.encode(TEXT, add_special_tokens=True).ids  # what transformers' tokenizer(text) gives
    assert want[0] == BOS and want[1] != BOS
    assert base.encode(TEXT) == base.encode(TEXT, raw=True) == want
    assert base.encode(tok.id_to_token(BOS) + TEXT) == want  # typed by hand: not doubled
    base.reset()
    r = base.generate(TEXT, max_tokens=8)
    assert r.stats.prompt_tokens == len(want) and r.token_ids == _reference(base_model, TEXT, 8).token_ids


def test_messages_are_refused_not_dressed_up_as_a_chat(base):
    for msgs in ([{"role": "user", "content": TEXT}], [{"role": "system", "content": "x"}]):
        with pytest.raises(EngineError, match=f"{NOTE}; give it the text to continue as a string"):
            base.generate(msgs, max_tokens=2)
    assert not base.has_chat_template


def test_a_chat_is_one_running_text(base, base_model):
    """Each message goes on a new line after the text so far, each continuation is part of the text, and every
    turn's answer is plain decoding of the whole text so far."""
    base.reset()
    chat = base.chat()
    first = chat.ask(TEXT, max_tokens=6)
    second = chat.ask("over the lazy dog", max_tokens=6)
    sep = "" if first.text.endswith("\n") else "\n"
    text = TEXT + first.text + sep + "over the lazy dog"
    assert chat.prompt == text + second.text
    assert first.token_ids == _reference(base_model, TEXT, 6).token_ids
    assert second.token_ids == _reference(base_model, text, 6).token_ids
    assert second.stats.reused_tokens > len(base.encode(TEXT))  # the text so far stayed in the KV cache
    ids = base.encode(chat.prompt)
    assert ids.count(BOS) == 1 and ids[0] == BOS
    chat.reset()
    assert chat.prompt == "" and chat.ask(TEXT, max_tokens=6).token_ids == first.token_ids


def test_a_base_models_chat_has_no_system_prompt(base):
    with pytest.raises(EngineError, match="no system prompt"):
        base.chat(system="be brief")


# ----------------------------------------------------------------------------- edge-chat

def test_edge_chat_says_so_once_and_continues_the_running_text(base_model):
    first, second = TEXT, "over the lazy dog"
    r = run_module(["edge.chat", "--model", str(base_model), "--max-tokens", "6", "--drafter", "none", "--context",
                    "256", "--color", "never"], stdin=f"{first}\n{second}\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(NOTE) == 1 and "one running text" in r.stderr, r.stderr
    one = _reference(base_model, first, 6).text
    two = _reference(base_model, first + one + ("" if one.endswith("\n") else "\n") + second, 6).text
    assert r.stdout == f"{one}\n{two}\n"


def test_edge_chat_prompt_is_the_raw_text(base_model):
    r = run_module(["edge.chat", "--model", str(base_model), "--prompt", TEXT, "--json", "--max-tokens", "8",
                    "--drafter", "none", "--context", "256"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = _reference(base_model, TEXT, 8)
    assert out["token_ids"] == want.token_ids and out["prompt_tokens"] == want.stats.prompt_tokens
    assert "the prompt is continued as it is" in r.stderr and r.stderr.count(NOTE) == 1


def test_edge_chat_refuses_a_system_prompt_for_a_base_model(base_model):
    r = run_module(["edge.chat", "--model", str(base_model), "--prompt", TEXT, "--system", "be brief"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"edge-chat: error: --system: tiny-llama {NOTE}, and has no system prompt: start your " \
                               "text with it"


def test_a_chat_model_gets_no_note(model):
    r = run_module(["edge.chat", "--model", model, "--prompt", TEXT, "--max-tokens", "2", "--context", "256"])
    assert r.returncode == 0 and "base model" not in r.stderr, r.stderr
