"""The beginning-of-sequence rule: a prompt without a chat template (raw text, or a checkpoint with no template) is
encoded as the tokenizer's own post-processor says, as transformers' `tokenizer(text)` does; a chat template places
its own BOS and nothing is added to it."""
from __future__ import annotations

import pytest

from conftest import BOS, SPECIALS, build_tokenizer, edit_export
from edge.text import TextCodec


def _with_bos_rule(tmp_path, adds_bos: bool, template: str | None):
    """The tests' byte-level tokenizer, its post-processor adding BOS (as Gemma's and Llama 2's do) or not."""
    from tokenizers import Tokenizer, processors

    build_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    if adds_bos:
        bos = SPECIALS[BOS]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, BOS)])
    tok.save(str(path))
    return TextCodec(path, template, BOS, (2,)), tok


@pytest.mark.parametrize("adds_bos", [True, False])
def test_a_raw_prompt_follows_the_tokenizers_own_rule(tmp_path, adds_bos):
    codec, tok = _with_bos_rule(tmp_path, adds_bos, None)
    text = "The quick brown fox"
    ids = codec.encode_prompt(text)
    assert ids == tok.encode(text, add_special_tokens=True).ids  # what transformers' tokenizer(text) gives
    assert (ids[0] == BOS) is adds_bos
    assert codec.prefix == ([BOS] if adds_bos else [])


def test_a_bos_typed_by_hand_is_not_doubled(tmp_path):
    codec, _ = _with_bos_rule(tmp_path, True, None)
    ids = codec.encode_prompt(SPECIALS[BOS] + "The quick brown fox")
    assert ids[0] == BOS and ids[1] != BOS


def test_without_a_chat_template_the_plain_chat_lines_start_with_bos_where_the_tokenizer_adds_it(tmp_path):
    codec, _ = _with_bos_rule(tmp_path, True, None)
    ids = codec.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == BOS and ids[1:] == codec.encode("user: hi\nassistant: ")


def test_a_chat_template_places_its_own_bos_and_nothing_is_added(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    codec, _ = _with_bos_rule(tmp_path, True, template)
    ids = codec.encode_chat([{"role": "user", "content": "hi"}])
    assert ids == [BOS] + codec.encode("hi")  # one BOS, the template's


def test_the_engine_applies_the_rule_to_raw_prompts(model_copy):
    """An export whose tokenizer adds BOS: `raw=True` prompts get it (a Gemma 3 export without it answered "1 1 1")."""
    import edge

    e = edge.load(edit_export(model_copy, bos_rule=True))
    assert e.encode("hello there", raw=True)[0] == BOS
    r = e.generate("hello there", raw=True, max_tokens=3)
    assert r.stats.prompt_tokens == len(e.codec.encode("hello there")) + 1
