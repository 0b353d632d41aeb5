"""edge-serve's text completions (POST /v1/completions, OpenAI's legacy API): the prompt is continued as it is, on a
base model (no chat template) and on a chat model alike; answers, streamed or not, equal plain decoding of the raw
prompt on an engine of its own; fields that would change the answer's shape are refused by name; and a base
model's chat completions are refused with a pointer here. The server runs in-process over the session's tiny
export, as a base model (its tokenizer puts BOS first, as Gemma 3's does) and as it is."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

import edge
from conftest import serving
from edge.server.app import ApiError, PromptLimits, parse_completion_request
from helpers import http_call, sse_events

TEXT = "the quick brown fox"


def _parse(**fields):
    return parse_completion_request(json.dumps({"prompt": TEXT, **fields}).encode(), 16)


def _reference(model_dir, prompt: str, **kw):
    """Plain decoding of `prompt` as a raw text, on an engine of its own."""
    return edge.load(model_dir, drafter="none", context=256).generate(prompt, raw=True, **kw)


@pytest.fixture(scope="module")
def base_server(base_model):
    engine = edge.load(base_model, context=256)  # its own drafter: greedy answers equal plain decoding's
    with serving(engine) as (port, _):
        yield port


@pytest.fixture(scope="module")
def client(base_server):
    import openai  # in the [test] extra: a broken install fails, never skips

    return openai.OpenAI(base_url=f"http://127.0.0.1:{base_server}/v1", api_key="unused", max_retries=0)


# ------------------------------------------------------------------------------ request parsing

def test_a_prompt_is_one_text_and_the_shared_fields_are_the_chats():
    req = _parse(max_tokens=9, temperature=0, top_p=0.5, top_k=4, seed=3, stop="\n", stream=True,
                 stream_options={"include_usage": True}, edgespec={"drafter": "lookup"}, n=1, best_of=1, suffix="",
                 logprobs=None, echo=False, user="ignored")
    assert req.prompt == TEXT and req.raw and req.param == "prompt" and not req.echo
    assert req.params == dict(max_tokens=9, temperature=0.0, top_p=0.5, top_k=4, seed=3, stop=("\n",),
                              drafter="lookup")
    assert req.stream and req.include_usage
    assert _parse(prompt=[TEXT]).prompt == TEXT and _parse(echo=True).echo
    assert _parse().params["max_tokens"] == 16 and _parse(prompt="").prompt == ""


BAD = [
    ("no prompt", {"prompt": None}, "prompt", "missing_required_parameter", "the text for the model to continue"),
    ("a batch", {"prompt": ["a", "b"]}, "prompt", "invalid_value", "a list of 2 prompts is a batch"),
    ("token ids", {"prompt": [1, 2, 3]}, "prompt", "invalid_value", "token ids are not taken"),
    ("a batch of token ids", {"prompt": [[1, 2], [3]]}, "prompt", "invalid_value", "token ids are not taken"),
    ("a number", {"prompt": 5}, "prompt", "invalid_value", "a string (or a list of one string)"),
    ("n", {"n": 2}, "n", "invalid_value", "one choice per request"),
    ("best_of", {"best_of": 3}, "best_of", "unsupported_parameter", "one candidate"),
    ("best_of true", {"best_of": True}, "best_of", "unsupported_parameter", "one candidate"),
    ("suffix", {"suffix": "}"}, "suffix", "unsupported_parameter", "insertion"),
    ("logprobs", {"logprobs": 0}, "logprobs", "unsupported_parameter", "log-probabilities"),
    ("echo", {"echo": "yes"}, "echo", "invalid_value", "true or false"),
    ("temperature", {"temperature": 3}, "temperature", "invalid_value", "[0.0, 2.0]"),
    ("stop", {"stop": ""}, "stop", "invalid_value", "non-empty string"),
]


@pytest.mark.parametrize("name,fields,param,code,words", BAD, ids=[b[0] for b in BAD])
def test_bad_fields_are_refused_by_name(name, fields, param, code, words):
    with pytest.raises(ApiError) as e:
        _parse(**fields)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code) and words in e.value.message


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized():
    with pytest.raises(ApiError) as e:
        parse_completion_request(json.dumps({"prompt": "x" * 40}).encode(), 16, PromptLimits(10, 4))
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    assert "shorten the prompt" in str(e.value)


# ------------------------------------------------------------------------------ a base model

def test_an_answer_is_the_raw_prompt_continued(client, base_model):
    r = client.completions.create(model="any", prompt=TEXT, max_tokens=12, temperature=0)
    want = _reference(base_model, TEXT, max_tokens=12)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and len(r.choices) == 1
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    bos_first = Tokenizer.from_file(str(base_model / "tokenizer.json")).encode(TEXT, add_special_tokens=True).ids
    assert r.usage.prompt_tokens == len(bos_first) == want.stats.prompt_tokens  # BOS once, as the tokenizer says
    assert r.usage.completion_tokens == len(want.token_ids)


def test_a_stream_is_text_completion_chunks_ending_with_done(base_server, base_model):
    body = {"prompt": TEXT, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    status, headers, raw = http_call(base_server, body, path="/v1/completions")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    *pieces, last, usage = events[:-1]
    assert all(e["object"] == "text_completion" and e["id"] == pieces[0]["id"] for e in events[:-1])
    assert all(set(e["choices"][0]) == {"text", "index", "logprobs", "finish_reason"} for e in pieces + [last])
    want = _reference(base_model, TEXT, max_tokens=12)
    assert "".join(e["choices"][0]["text"] for e in pieces) == want.text
    assert last["choices"][0]["finish_reason"] == want.finish_reason and last["choices"][0]["text"] == ""
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(want.token_ids)
    assert all(e["usage"] is None for e in pieces + [last])


def test_the_openai_client_streams_the_same_text(client, base_model):
    chunks = list(client.completions.create(model="any", prompt=TEXT, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _reference(base_model, TEXT, max_tokens=12).text


def test_a_stop_string_ends_the_text_before_it(client, base_model):
    full = _reference(base_model, TEXT, max_tokens=24).text
    stop = full[len(full) // 2:][:2]
    assert stop.strip(), full
    r = client.completions.create(model="any", prompt=TEXT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_echo_puts_the_prompt_first(base_server, base_model):
    want = TEXT + _reference(base_model, TEXT, max_tokens=6).text
    status, _, raw = http_call(base_server, {"prompt": TEXT, "max_tokens": 6, "temperature": 0, "echo": True},
                               path="/v1/completions")
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == want
    body = {"prompt": TEXT, "max_tokens": 6, "temperature": 0, "echo": True, "stream": True}
    events = sse_events(http_call(base_server, body, path="/v1/completions")[2])
    assert events[0]["choices"][0]["text"] == TEXT
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want


def test_an_echoed_prompt_that_is_not_valid_text_is_answered_as_the_tokenizer_read_it(base_server):
    """A lone surrogate (JSON "\\ud800") cannot be encoded as UTF-8: echoed as U+FFFD, as the prompt was read."""
    for stream in (False, True):
        raw = http_call(base_server, {"prompt": "\ud800" + TEXT, "max_tokens": 2, "echo": True, "stream": stream},
                        path="/v1/completions")[2]
        first = sse_events(raw)[0] if stream else json.loads(raw)
        assert first["choices"][0]["text"].startswith("\ufffd" + TEXT), first


def test_seeded_sampling_is_the_engines(client, base_model):
    kw = dict(max_tokens=10, temperature=0.9, top_p=0.95, seed=11)
    r = client.completions.create(model="any", prompt=TEXT, extra_body={"top_k": 20}, **kw)
    assert r.choices[0].text == _reference(base_model, TEXT, top_k=20, **kw).text


def test_a_prompt_too_long_for_the_context_is_a_400_naming_the_prompt(base_server):
    status, _, raw = http_call(base_server, {"prompt": "the lazy dog " * 200, "max_tokens": 4},
                               path="/v1/completions")
    err = json.loads(raw)["error"]
    assert status == 400 and (err["param"], err["code"]) == ("prompt", "context_length_exceeded"), err
    assert "the prompt is" in err["message"] and "shorten the prompt" in err["message"]


def test_a_base_models_chat_completions_point_at_completions(base_server):
    before = json.loads(http_call(base_server, None, "GET", "/health")[2])["invalid"]
    status, _, raw = http_call(base_server, {"messages": [{"role": "user", "content": "hi"}]})
    err = json.loads(raw)["error"]
    assert status == 400 and (err["param"], err["code"]) == ("messages", "no_chat_template"), err
    assert "base model without a chat template" in err["message"] and "POST /v1/completions" in err["message"]
    assert json.loads(http_call(base_server, None, "GET", "/health")[2])["invalid"] == before + 1
    models = json.loads(http_call(base_server, None, "GET", "/v1/models")[2])["data"]
    assert models[0]["edgespec"]["endpoints"] == ["/v1/completions"]


# ------------------------------------------------------------------------------ a chat model

def test_a_chat_model_continues_the_raw_prompt_too(tiny_dir):
    """No chat template is applied to a completion's prompt; the chat endpoint is the chat model's as before."""
    engine = edge.load(tiny_dir, context=256)
    with serving(engine) as (port, _):
        status, _, raw = http_call(port, {"prompt": TEXT, "max_tokens": 10, "temperature": 0},
                                   path="/v1/completions")
        chat = json.loads(http_call(port, {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 10,
                                           "temperature": 0})[2])
        models = json.loads(http_call(port, None, "GET", "/v1/models")[2])["data"]
    raw_text = _reference(tiny_dir, TEXT, max_tokens=10)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == raw_text.text
    assert json.loads(raw)["usage"]["prompt_tokens"] == raw_text.stats.prompt_tokens
    templated = edge.load(tiny_dir, drafter="none", context=256).generate(TEXT, max_tokens=10)
    assert chat["choices"][0]["message"]["content"] == templated.text
    assert templated.stats.prompt_tokens > raw_text.stats.prompt_tokens  # the template's own tokens
    assert models[0]["edgespec"]["endpoints"] == ["/v1/chat/completions", "/v1/completions"]


def test_edge_serve_says_at_start_that_a_base_model_serves_completions_only(base_model, monkeypatch, capsys):
    from types import SimpleNamespace

    from edge.server import app as serve

    monkeypatch.setattr(serve, "_listen_check", lambda host, port: (None, None))
    monkeypatch.setattr(serve, "uvicorn_server", lambda config, worker: SimpleNamespace(
        run=lambda sockets=None: None, started=True))
    assert serve.main(["--model", str(base_model), "--context", "256", "--port", "8089"]) == 0
    line = capsys.readouterr().err.strip()
    assert line.endswith("/v1; a base model without a chat template: POST /v1/completions only"), line
