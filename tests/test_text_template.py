"""Chat templates rendered as transformers renders them, under a budget: the real templates of SmolLM2, Llama 3.1 /
3.2, Qwen2.5, Gemma 3, Phi-3 and Mistral v0.3 give transformers' text and ids; a template that loops for ever,
builds huge text or fails is one EngineError line from the API and from every CLI."""
from __future__ import annotations

import json
import shutil

import pytest
from chat_templates import FAMILIES, family_codec_and_hf

import edge
import edge.text
from edge import EngineError
from edge.text import ChatTemplateError, TextCodec

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = {
    "system_and_turns": ([SYSTEM, {"role": "user", "content": "Hello there, how are you?"},
                          {"role": "assistant", "content": "I am fine, thank you."},
                          {"role": "user", "content": "What is the capital of France?"}], True),
    "one_question": ([{"role": "user", "content": "Name three rivers."}], True),
    "history_only": ([{"role": "user", "content": "Hello there!"},
                      {"role": "assistant", "content": "Hello! How can I help?"}], False),
    "spaces_to_trim": ([{"role": "user", "content": "  Summarize the document.\n\n"},
                        {"role": "assistant", "content": "\n The weather in Paris is sunny.  "},
                        {"role": "user", "content": " def add(a, b): "}], True),
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    return {f: family_codec_and_hf(f, d) for f in FAMILIES}


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_real_templates_give_transformers_text_and_ids(families, family, conversation):
    """The same prompt text as apply_chat_template(tokenize=False) and the same ids as tokenize=True."""
    codec, hf = families[family]
    msgs, gen = CONVERSATIONS[conversation]
    assert codec.render(msgs, gen) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert codec.encode_chat(msgs, gen) == list(hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stretches_between_control_tokens_encode_as_the_whole_prompt(families, family):
    """Content with control-token strings is encoded stretch by stretch; on ordinary text, encoding every stretch
    on its own gives exactly the whole prompt's ids (no merge across a control token; Metaspace "first", the
    prepended "▁" and Phi-3's whitespace-stripping tokens line up)."""
    codec, _ = families[family]
    for msgs, gen in CONVERSATIONS.values():
        text = codec.render(msgs, gen)
        assert codec._encode_protected(text, [], force=True) == codec.encode(text)


def test_qwen_tool_calls_render_json_as_transformers_does(families):
    """transformers' tojson: no HTML escaping of < > & ' (jinja's own tojson writes \\u003c ...)."""
    codec, hf = families["qwen2_5"]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "<Paris & 'Lyon'>"}}}]},
            {"role": "tool", "content": "sunny & warm"}]
    text = codec.render(msgs)
    assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert '{"city": "<Paris & \'Lyon\'>"}' in text
    assert codec.encode_chat(msgs) == list(hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True))


def _save(families, tmp_path):
    path = tmp_path / "tokenizer.json"
    families["smollm2"][0].tok.save(str(path))
    return path


def _codec(tmp_path, families, template) -> TextCodec:
    return TextCodec(_save(families, tmp_path), template, None, ())


FEATURES = (
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}{% continue %}"
    "{% endif %}[{{ m.role }}]{% generation %}{{ m.content | trim }}{% endgeneration %}{% endfor %}"
    "{{ {'a': '<b> & \\'c\\'', 'n': [1, 2]} | tojson }}|{{ {'x': 1} | tojson(indent=2) }}"
    "|{{ {'y': [1, 2]} | tojson(separators=(',', ':')) }}|{{ strftime_now('%Y') }}"
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}|{{ ns.n }}"
    "{% if add_generation_prompt %}|A{% endif %}")


def test_template_features_render_as_in_transformers(tmp_path, families):
    """Loop controls, {% generation %}, tojson with indent/separators, strftime_now, namespaces."""
    _, hf = families["smollm2"]
    codec = _codec(tmp_path, families, FEATURES)
    msgs = [SYSTEM, {"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    assert codec.render(msgs) == hf.apply_chat_template(msgs, chat_template=FEATURES, tokenize=False,
                                                        add_generation_prompt=True)



MSGS = [{"role": "user", "content": "hi"}]


def test_a_template_refusal_is_an_engine_error_in_its_own_words(tmp_path, families):
    c = _codec(tmp_path, families, "{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="^Conversation roles must alternate \\(a rule of") as e:
        c.render(MSGS)
    assert isinstance(e.value, EngineError) and isinstance(e.value, ValueError)


def test_a_template_that_never_ends_stops_at_the_time_budget(tmp_path, families, monkeypatch):
    """Nested loops that print nothing (10^10 empty iterations): stopped at RENDER_SECONDS, not hours later."""
    monkeypatch.setattr(edge.text, "RENDER_SECONDS", 0.3)
    c = _codec(tmp_path, families, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                   "{% endfor %}")
    with pytest.raises(ChatTemplateError, match="took more than 0.3 s to render"):
        c.render(MSGS)


def test_recursion_that_doubles_stops_at_the_time_budget(tmp_path, families, monkeypatch):
    """A macro calling itself twice, 40 deep (2^40 calls, no loop at all)."""
    monkeypatch.setattr(edge.text, "RENDER_SECONDS", 0.3)
    c = _codec(tmp_path, families, "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                                   "{% endmacro %}{{ f(40) }}")
    with pytest.raises(ChatTemplateError, match="took more than 0.3 s to render"):
        c.render(MSGS)


@pytest.mark.parametrize("template", [
    "{{ 'a' * 100000000 }}",
    "{{ 100000000 * 'a' }}",
    "{{ messages * 100000000 }}",
    "{{ 2 ** 100000000 }}",
    "{{ ''|center(1000000000) }}",
    "{{ ('x\n' * 1000) | indent(1000000) }}",
    "{{ ('a' * 1000)|replace('a', 'b' * 100000) }}",
    "{{ '%1000000000s' % 'a' }}",
    "{{ '{:>1000000000}'.format('a') }}",
    "{{ 'a'.ljust(1000000000) }}",
    "{{ ('a' * 1000).replace('a', 'b' * 100000) }}",
    "{{ lipsum(10000000) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
])
def test_huge_text_is_refused_before_it_is_built(tmp_path, families, monkeypatch, template):
    """A size budget (RENDER_CHARS plus 4 per character of the messages): refused with "would build" / "would
    compute" / "rendered more than", not after gigabytes (the time budget is raised so it cannot be what stops
    them)."""
    monkeypatch.setattr(edge.text, "RENDER_SECONDS", 60.0)
    with pytest.raises(ChatTemplateError, match="would build|would compute|rendered more than") as e:
        _codec(tmp_path, families, template).render(MSGS)
    assert "took more than" not in str(e.value)


def test_the_size_budget_grows_with_the_messages(tmp_path, families):
    """Long messages (a pasted document) are not refused: the budget counts their text."""
    c = _codec(tmp_path, families, "{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}")
    doc = "word " * 400_000  # 2 MB of text, rendered twice
    assert len(c.render([{"role": "user", "content": doc}])) == 2 * len(doc)


@pytest.mark.parametrize("template,words", [
    ("{% for m in messages %}{{ m.content ~ }}{% endfor %}", "syntax error on line 1"),
    ("{{ messages.append(1) }}", "SecurityError"),
    ("{{ messages[0].nope.deeper }}", "UndefinedError"),
    ("{{ 1 + 'a' }}", "TypeError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses too deep"),
    ("{{ strftime_now('%100000Y') }}", "wider than 256"),
])
def test_template_errors_are_one_line_engine_errors(tmp_path, families, template, words):
    with pytest.raises(ChatTemplateError) as e:
        _codec(tmp_path, families, template).render(MSGS)
    assert words in str(e.value) and "\n" not in str(e.value) and isinstance(e.value, EngineError)


def test_a_broken_template_is_compiled_again_after_it_is_fixed(tmp_path, families):
    c = _codec(tmp_path, families, "{% for %}")
    with pytest.raises(ChatTemplateError, match="syntax error"):
        c.render(MSGS)
    c._template_src = "{{ messages[0].content }}"
    assert c.render(MSGS) == "hi"


# ----------------------------------------------------------------------------- the CLIs and the API

RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BROKEN = "{% for m in messages %}"


def _engine_with(tiny_dir, template):
    e = edge.load(tiny_dir, drafter="none", context=64)
    e.codec._template_src, e.codec._template = template, None
    return e


@pytest.fixture
def bad_engine(tiny_dir, monkeypatch):
    """The tiny model with a chat template that never ends (stopped after 0.3 s)."""
    monkeypatch.setattr(edge.text, "RENDER_SECONDS", 0.3)
    return _engine_with(tiny_dir, RUNAWAY)


def test_generate_with_a_runaway_template_is_an_engine_error(bad_engine):
    with pytest.raises(EngineError, match="chat template took more than"):
        bad_engine.generate("hello", max_tokens=2)
    assert len(bad_engine.generate("hello", raw=True, max_tokens=2).token_ids) >= 1  # raw prompts still work


def test_edge_chat_reports_a_runaway_template_in_one_line(bad_engine, monkeypatch, capsys):
    from edge import chat as cli

    monkeypatch.setattr(edge, "load", lambda *a, **kw: bad_engine)
    assert cli.main(["--model", "x", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edge-chat: error: the model's chat template took more than") and err.count("\n") == 1


@pytest.mark.parametrize("template,words", [(RUNAWAY, "took more than 0.3 s"), (BROKEN, "has a syntax error")])
def test_edge_serve_refuses_to_start_with_a_bad_template(tiny_dir, monkeypatch, capsys, template, words):
    """edge-serve's start-up check encoded an empty question outside its error handling: a traceback (or, for a
    template that never ends, a server that never starts)."""
    from edge.server import app as serve

    monkeypatch.setattr(edge.text, "RENDER_SECONDS", 0.3)
    e = _engine_with(tiny_dir, template)
    monkeypatch.setattr(edge, "load", lambda *a, **kw: e)
    assert serve.main(["--model-dir", "x", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"edge-serve: error: the model's chat template {words}") and err.count("\n") == 1


def test_edge_export_reports_a_broken_template_in_one_line(tiny_llama_dir, tmp_path, capsys):
    """The exporter renders its calibration prompts right after the tokenizer step: a template error there is
    "edge-export: error: ...", exit status 2, before any graph is built."""
    from export import cli as export_cli

    src = tmp_path / "ck"
    shutil.copytree(tiny_llama_dir, src)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{% for m in messages %}"}))
    assert export_cli.main([str(src), "-o", str(tmp_path / "out"), "--quiet", "--no-parity"]) == 2
    err = capsys.readouterr().err
    assert "edge-export: error: the model's chat template has a syntax error" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- special tokens, blocks, no template

def _template_codec(tmp_path, template, bos=1, eos=(2, 3)):
    from tokenizers import Tokenizer, models

    from edge.text import TextCodec

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|eot|>": 3}
    (tmp_path / "tokenizer.json").write_text(Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).to_str())
    return TextCodec(tmp_path / "tokenizer.json", template, bos, eos)


def test_template_gets_bos_and_the_first_eos_token(tmp_path):
    """Templates that write {{ bos_token }} / {{ eos_token }} (Llama, Mistral, Gemma) get the BOS token and the first
    of the export's end tokens."""
    codec = _template_codec(tmp_path, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}"
                                      "{% endfor %}")
    assert codec.render([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def test_template_blocks_on_their_own_lines_leave_no_newlines(tmp_path):
    """Chat templates render with trim_blocks and lstrip_blocks, as Hugging Face renders them: a template written one
    block per line puts no newline before every message."""
    codec = _template_codec(tmp_path, "{% for m in messages %}\n  {% if m['role'] == 'user' %}\n"
                                      "U:{{ m['content'] }}\n  {% endif %}\n{% endfor %}\n"
                                      "{% if add_generation_prompt %}\nA:{% endif %}")
    assert codec.render([{"role": "user", "content": "hi"}]) == "U:hi\nA:"
    assert codec.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "U:hi\n"


def test_no_template_adds_the_assistant_prefix_only_when_asked(tmp_path):
    """Without a chat template, the plain "role: content" rendering ends with "assistant: " only when
    add_generation_prompt is true."""
    codec = _template_codec(tmp_path, None)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert codec.render(msgs) == "system: be brief\nuser: hi\nassistant: "
    assert codec.render(msgs, add_generation_prompt=False) == "system: be brief\nuser: hi\n"
