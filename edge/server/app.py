"""edge-serve: an OpenAI-compatible local HTTP server for one exported model.

    POST /v1/chat/completions   messages, max_tokens, temperature, top_p, top_k, seed, stop, stream (+ stream_options)
    POST /v1/completions        prompt (text it continues, raw: no chat template), echo, and the same sampling fields
    GET  /v1/models             the loaded model, and which of the two it serves
    GET  /health                status and counters

A base model (no chat template) serves /v1/completions only: its chat completions are refused with a 400 that
points there, rather than answered through a made-up chat format. Both endpoints share the parsing, the queue, the
worker, streaming and the errors below; they differ in the prompt and the shape of the answer.

edgespec extensions live under an "edgespec" key: in a request `{"edgespec": {"drafter": "lookup", "draft_len": 4}}`,
in a response the speculative counters (drafted, accepted, steps, mean accepted length) and `prompt_tokens_reused`.

Requests run one at a time on the engine, in one worker thread (never on the event loop), behind a bounded queue;
a full queue is a 503. The engine keeps the longest common token prefix of the previous conversation in its KV
cache, so a chat client that resends the whole history each turn only prefills the new tokens
(`usage.prompt_tokens_details.cached_tokens`). A client that disconnects stops its generation; the engine rolls
its cache back in `finally`, so the next request starts from a consistent state.

HTTP stack: starlette + uvicorn (pure Python, no pydantic); see docs/server.md.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import errno
import inspect
import ipaddress
import json
import logging
import math
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..drafters import DRAFTER_CHOICES
from ..engine import (CANCELLED, DEFAULT_MAX_TOKENS, MAX_DRAFT_LEN, BadMessage, EngineError, base_model,
                      normalize_messages)
from ..manifest import ModelDirError
from ..text import valid_text

log = logging.getLogger("edge.server")

# A request body is held and parsed whole, and JSON parsing costs up to ~27 bytes of memory per body byte (a body
# of `[{}, {}, ...]`); 1 MiB is ~60 times a prompt that fills a 4096-token context (--max-body-mb)
MAX_BODY = 1 << 20
MAX_STOP = 32  # OpenAI allows 4; llama-server and Ollama take any number, and editors send 5-10
SHUTDOWN_GRACE_S = 5  # after Ctrl-C / SIGTERM, uvicorn's wait for open requests (each was told to stop already)
MAX_CONNECTIONS = 512  # open connections (--max-connections); a browser opens at most 6 per host
HEADER_TIMEOUT_S = 10.0  # a connection's request head must arrive within this (--header-timeout)
BODY_TIMEOUT_S = 30.0  # ... and its body within this (--body-timeout)
FD_RESERVE = 256  # descriptors kept for the model's files, ONNX Runtime, logs
BACKLOG = 2048  # uvicorn's: pending connections the kernel holds, and asyncio accepts at a time
LOG_EVERY_S = 10.0  # a flood of one kind of log line prints one line (with a count) per this many seconds
# Tokenizing costs ~300-450 bytes of memory per token, all at once, and holds the GIL: a prompt whose template
# renders to more than this many UTF-8 bytes is first counted a piece at a time, and refused once it cannot fit
WHOLE_PROMPT_BYTES = 32 << 10  # tokenized whole: ~15 MB at most
PIECE_CHARS = 8192  # counted pieces: ~15 MB at most each
CUT_SLACK = 4  # tokens a cut between pieces may add to their count
_CUT = re.compile(r"\S \S")  # a single space between two non-spaces: where the pre-tokenizers split anyway
# NFC / NFKC compose up to 4 code points into one character (U+1FAF: Ω + 3 marks), and NFKC maps one character of
# 4 UTF-8 bytes to one of 1 (U+1FBF9): the tokenizer may see a text up to 4 times shorter than the request's
NORMALIZER_SHRINK = 4
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")  # the first needs a chat template


class ApiError(Exception):
    """An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _client_gone() -> ApiError:
    """What a handler whose client has left is told (nginx's 499; nobody reads it, but the handler must wake)."""
    return ApiError(499, "client closed the request", code="client_closed")


def _shutting_down(detail: str = "") -> ApiError:
    """What every request still queued or running is told once Ctrl-C / SIGTERM began the shutdown."""
    return ApiError(503, "server is shutting down" + detail, code="shutting_down")


# ---------------------------------------------------------------------------------------------- request parsing

@dataclass
class Request:
    """A parsed request: chat messages (/v1/chat/completions), or a text the model continues as it is
    (/v1/completions)."""
    prompt: list[dict] | str
    params: dict  # keyword arguments for Engine.stream
    stream: bool = False
    include_usage: bool = False
    echo: bool = False  # /v1/completions: the answer starts with the prompt

    @property
    def raw(self) -> bool:
        """A text to continue, encoded as it is (Engine.encode's raw=True), whatever the model."""
        return isinstance(self.prompt, str)

    @property
    def param(self) -> str:
        return _param(self.prompt)


def _param(prompt: list[dict] | str) -> str:
    """The request field that holds `prompt`, for errors about it."""
    return "prompt" if isinstance(prompt, str) else "messages"


def _texts(prompt: list[dict] | str) -> list[str]:
    """The text a prompt is made of: a completion's string, or each message's content."""
    return [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]


def _too_long(param: str, tokens: str, context: int) -> ApiError:
    """A prompt of `tokens` (a count, or "over N") that cannot fit in the context."""
    return ApiError(400, f"the {param} {'is' if param == 'prompt' else 'are'} {tokens} tokens but the context holds "
                         f"{context}; {_shorten(param)}", param, "context_length_exceeded")


def _number(body: dict, key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}] (got {v!r})", key, "invalid_value")
    return float(v)


def _int(body: dict, key: str, lo: int, param: str | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ApiError(400, f"{key} must be an integer >= {lo} (got {v!r})", param or key, "invalid_value")
    return v


@dataclass(frozen=True)
class PromptLimits:
    """Bounds a prompt is held to before it is tokenized (tokenizing a long prompt costs ~300 bytes of memory per
    token and holds the GIL). Each bound only refuses prompts that cannot fit in `context` tokens:

    - messages: fewer than `context`, since every chat template marks where each message starts (a token at least).
    - text: a token spans at most `span` units of the text it stands for (its longest vocabulary entry; units are
      UTF-8 bytes for a byte-level BPE without a normalizer, which splits the text's bytes into tokens, else
      characters), so more than (context - 1) × span units need at least `context` tokens. Contents are measured
      without surrounding whitespace (templates that trim them); a normalizer that composes characters (NFC, NFKC)
      multiplies `span` by NORMALIZER_SHRINK; one that may drop text (None) leaves the text unbounded.
    These are cheap and far above any conversation that fits (`span` is the vocabulary's longest token, 81 bytes
    for SmolLM2's, against ~4 bytes per token of prose), so a template that leaves part of a message out (an
    earlier turn's reasoning) would need a history many contexts long to be refused wrongly. Prompts that pass
    them but are large are counted before they are tokenized whole (`refuse_if_surely_too_long`)."""
    context: int
    span: int | None = None
    unit: str = "bytes"  # or "characters"

    def check_count(self, msgs: list) -> None:
        if len(msgs) >= self.context:
            raise ApiError(400, f"messages: {len(msgs)} messages cannot fit in the context of {self.context} tokens "
                                "(every message takes at least one token); shorten the conversation",
                           "messages", "context_length_exceeded")

    def check_text(self, prompt: list[dict] | str) -> None:
        """`prompt`: the messages, or a completion's text."""
        if self.span is None:
            return
        texts = [t.strip() for t in _texts(prompt)]
        size = (sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) if self.unit == "bytes" else
                sum(map(len, texts)))
        most = (self.context - 1) * self.span
        if size > most:
            param = _param(prompt)
            raise ApiError(400, f"{param}: {size:,} {self.unit} of text cannot fit in the context of {self.context} "
                                f"tokens (no token of this tokenizer spans more than {self.span} {self.unit}, so at "
                                f"most {most:,} fit); {_shorten(param)}", param, "context_length_exceeded")


def _shorten(param: str) -> str:
    """The fix for a prompt that cannot fit the context."""
    return (f"shorten the {'conversation' if param == 'messages' else 'prompt'} (or restart edge-serve with a larger "
            "--context)")


def prompt_limits(engine) -> PromptLimits:
    """PromptLimits for an engine's context and tokenizer (read once, ~50 ms for a 49k vocabulary). An engine
    without a `tokenizers` tokenizer (a test's stand-in) gets the message bound only."""
    context = int(engine.context)
    codec = getattr(engine, "codec", None)
    tok = getattr(codec, "tok", None)
    if tok is None:
        return PromptLimits(context)
    if hasattr(tok, "max_token_chars"):  # edge.bpe.CompactBpe: its own bound
        return PromptLimits(context, tok.max_token_chars(), "characters")
    try:
        shrink = _normalizer_shrink(tok.normalizer)
        if shrink is None:
            return PromptLimits(context)
        if shrink == 0 and codec.byte_level:  # no normalizer: a token stands for at most its own bytes
            added = tok.get_added_tokens_decoder().values()
            span = max([len(t) for t in tok.get_vocab(with_added_tokens=False)]
                       + [len(a.content.encode("utf-8")) for a in added])
            return PromptLimits(context, span, "bytes")
        span = max(len(t) for t in tok.get_vocab(with_added_tokens=True)) * max(shrink, 1)
        return PromptLimits(context, span, "characters")
    except Exception:  # noqa: BLE001 - an unusual tokenizer: the other bounds still hold
        log.warning("no text-size bound for this tokenizer", exc_info=True)
        return PromptLimits(context)


def _normalizer_shrink(normalizer) -> int | None:
    """How many times shorter (in characters) a normalizer can make a text: 0 for none at all, 1 when no step
    shortens it, NORMALIZER_SHRINK for composing steps, None when a step may drop text (strip accents, remove
    control characters, a regex replacement)."""
    if normalizer is None:
        return 0
    steps, out = [json.loads(normalizer.__getstate__())], 0
    while steps:
        n = steps.pop()
        kind = n.get("type")
        if kind == "Sequence":
            steps.extend(n.get("normalizers") or [])
        elif kind in ("NFC", "NFKC"):
            out = max(out, NORMALIZER_SHRINK)
        elif kind in ("NFD", "NFKD", "Lowercase", "Prepend"):
            out = max(out, 1)
        elif kind == "Replace":
            pattern = (n.get("pattern") or {}).get("String")
            if pattern is None or len(n.get("content") or "") < len(pattern):
                return None  # a regex, or a replacement shorter than what it replaces
            out = max(out, 1)  # e.g. "▁" for " "
        else:
            return None
    return out


def tokens_at_least(encode, text: str, context: int) -> tuple[int, int]:
    """(tokens counted, cuts): `text` tokenized a piece of at most PIECE_CHARS at a time, stopping as soon as the
    count shows it cannot fit in `context` tokens; memory and GIL hold are one piece's. Pieces are cut at a single
    space between two non-spaces, where the regex pre-tokenizers of byte-level BPEs (GPT-2, Llama 3, Qwen) and
    SentencePiece's whitespace split cut too, so their pieces' tokens are the whole's; elsewhere (a prepended "▁",
    a long run without spaces cut anywhere) a cut can change the count by a token or two, and CUT_SLACK tokens per
    cut are given back: `tokens - CUT_SLACK * cuts >= context` means it cannot fit."""
    count = cuts = start = 0
    while start < len(text) and count - CUT_SLACK * cuts < context:
        end = start + PIECE_CHARS
        if end < len(text):
            m = _CUT.search(text, start + PIECE_CHARS // 2, end + 1)
            end = m.start() + 1 if m else end
            cuts += 1
        count += len(encode(text[start:end]))
        start = end
    return count, cuts


def may_be_large(prompt: list[dict] | str) -> bool:
    """Could `prompt` (messages, or a completion's text) render to more than WHOLE_PROMPT_BYTES? (UTF-8 takes at
    most 4 bytes a character; a template's own markup is a few dozen bytes a message.) Most requests are answered
    no here, on the event loop."""
    texts = _texts(prompt)
    return 4 * sum(map(len, texts)) + 64 * len(texts) > WHOLE_PROMPT_BYTES


def refuse_if_surely_too_long(engine, prompt: list[dict] | str) -> None:
    """ApiError(400) when `prompt` cannot fit in the context, found by `tokens_at_least` on a prompt of more than
    WHOLE_PROMPT_BYTES before anything tokenizes it whole. For messages, the prompt they render to, not the
    messages: templates leave parts out (an earlier turn's reasoning); a completion's text is counted as it is (the
    tokenizer's prefix only adds to it). Runs off the event loop."""
    if isinstance(prompt, str):
        text = prompt
    else:
        render = getattr(getattr(engine, "codec", None), "render", None)
        if render is None:  # a stand-in engine
            return
        try:
            text = render(prompt)
        except Exception:  # noqa: BLE001 - a template's own refusal: the engine says it in its words
            return
    if len(text.encode("utf-8", "surrogatepass")) <= WHOLE_PROMPT_BYTES:
        return
    count, cuts = tokens_at_least(lambda t: engine.encode(t, raw=True), text, engine.context)
    if count - CUT_SLACK * cuts >= engine.context:
        raise _too_long(_param(prompt), f"over {count - CUT_SLACK * cuts}", engine.context)


def _messages(body: dict, limits: PromptLimits | None = None) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages",
                       "missing_required_parameter" if msgs is None else "invalid_value")
    if limits is not None:
        limits.check_count(msgs)  # before copying them
    try:  # the engine's rules (roles, text parts); only role and content reach the template here
        out = [{"role": m["role"], "content": m["content"]} for m in normalize_messages(msgs)]
    except BadMessage as e:
        raise ApiError(400, str(e), e.param, "invalid_value") from None
    if limits is not None:
        limits.check_text(out)
    return out


def _stop(body: dict) -> tuple[str, ...]:
    s = body.get("stop")
    if s is None:
        return ()
    s = [s] if isinstance(s, str) else s
    if not isinstance(s, list) or len(s) > MAX_STOP or not all(isinstance(x, str) and x for x in s):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop",
                       "invalid_value")
    return tuple(s)


def _extensions(body: dict) -> dict:
    ext = body.get("edgespec")
    if ext is None:
        return {}
    if not isinstance(ext, dict) or set(ext) - {"drafter", "draft_len"}:
        raise ApiError(400, "edgespec must be an object with optional keys drafter, draft_len", "edgespec",
                       "invalid_value")
    out = {}
    if ext.get("drafter") is not None:
        if ext["drafter"] not in DRAFTER_CHOICES:
            raise ApiError(400, f"edgespec.drafter {ext['drafter']!r}: choose one of {', '.join(DRAFTER_CHOICES)}",
                           "edgespec.drafter", "invalid_value")
        out["drafter"] = ext["drafter"]
    k = _int(ext, "draft_len", 0, "edgespec.draft_len")
    if k is not None:
        if k > MAX_DRAFT_LEN:
            raise ApiError(400, f"edgespec.draft_len must be in [0, {MAX_DRAFT_LEN}] (got {k})", "edgespec.draft_len",
                           "invalid_value")
        out["draft_len"] = k
    return out


async def _read_body(request, limit: int = MAX_BODY, timeout: float | None = None) -> bytes:
    """The request body, refused with 413 as soon as it is known to pass `limit` (from Content-Length, or while
    reading): a client cannot make the server hold an arbitrarily large body in memory. A body that has not
    arrived within `timeout` seconds is a 408 (a client trickling it would hold its connection forever); a client
    that leaves mid-body is a 499, which nobody reads and nothing logs."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {int(declared)} bytes; the limit is {limit} (--max-body-mb)", None,
                       "request_too_large")

    async def read() -> bytes:
        parts, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise ApiError(413, f"request body is over the limit of {limit} bytes (--max-body-mb)", None,
                               "request_too_large")
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g} s (--body-timeout)", None,
                       "request_timeout") from None
    except ClientDisconnect:
        raise _client_gone() from None


def _refuse_unsupported(body: dict) -> None:
    """Fields whose answer a client would read in a shape this server cannot give (log-probabilities, JSON mode,
    a forced tool call): refused by name rather than answered as plain text the client then misreads. Fields that
    only tune or annotate (penalties, `user`, `tools` with tool_choice auto/none) are ignored."""
    for key in ("logprobs", "top_logprobs"):
        if body.get(key) not in (None, False, 0):
            raise ApiError(400, f"{key}: log-probabilities are not returned by this server", key,
                           "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported (no JSON mode or schema)",
                       "response_format", "unsupported_parameter")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise ApiError(400, "tool_choice: this server does not make tool calls (tools are ignored; 'auto' and "
                            "'none' are accepted)", "tool_choice", "unsupported_parameter")


def parse_chat_request(raw: bytes, default_max_tokens: int, limits: PromptLimits | None = None) -> Request:
    """Validate a chat-completions body → Request; ApiError(400) names the offending parameter, or the bound of
    `limits` a prompt that cannot fit passes (checked before it is tokenized).
    Unknown top-level fields (user, logit_bias, ...) are ignored, as OpenAI-compatible servers commonly do."""
    body = _json_object(raw)
    messages = _messages(body, limits)
    _refuse_unsupported(body)
    return Request(messages, **_common(body, default_max_tokens))


def parse_completion_request(raw: bytes, default_max_tokens: int, limits: PromptLimits | None = None) -> Request:
    """Validate a (legacy) completions body → Request, as `parse_chat_request` does. `prompt` is one text, which
    the model continues as it is: a string, or a list of one. A batch of prompts, token ids, `suffix`, `best_of`
    and `logprobs` are refused by name; `echo` puts the prompt before the answer."""
    body = _json_object(raw)
    prompt = _prompt(body, limits)
    if body.get("suffix") not in (None, ""):
        raise ApiError(400, "suffix: text after the completion (insertion) is not supported; send the text to continue "
                            "as prompt", "suffix", "unsupported_parameter")
    best_of = body.get("best_of")
    if isinstance(best_of, bool) or best_of not in (None, 1):
        raise ApiError(400, "best_of: only one candidate per request is generated", "best_of", "unsupported_parameter")
    if body.get("logprobs") is not None:
        raise ApiError(400, "logprobs: log-probabilities are not returned by this server", "logprobs",
                       "unsupported_parameter")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ApiError(400, "echo must be true or false", "echo", "invalid_value")
    return Request(prompt, **_common(body, default_max_tokens), echo=bool(echo))


def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:  # nesting deeper than the parser's recursion limit
        raise ApiError(400, "request body is not valid JSON: nested too deeply", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", None, "invalid_json")
    return body


def _prompt(body: dict, limits: PromptLimits | None = None) -> str:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        if p is None:
            raise ApiError(400, "prompt is required: the text for the model to continue", "prompt",
                           "missing_required_parameter")
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            why = f"a list of {len(p)} prompts is a batch; send one request per prompt"
        elif isinstance(p, list) and p and all(isinstance(x, (int, list)) and not isinstance(x, bool) for x in p):
            why = "token ids are not taken; send the text"
        else:
            why = "it must be a string (or a list of one string)"
        raise ApiError(400, f"prompt: {why}", "prompt", "invalid_value")
    if limits is not None:
        limits.check_text(p)
    return p


def _common(body: dict, default_max_tokens: int) -> dict:
    """What both endpoints take alike (model, n, max_tokens, sampling, stop, stream and its options, the edgespec
    extensions) → Request's keyword arguments `params`, `stream`, `include_usage`."""
    if body.get("model") is not None and not isinstance(body["model"], str):  # any name is served (one model)
        raise ApiError(400, f"model must be a string (got {body['model']!r})", "model", "invalid_value")
    n = body.get("n")
    if isinstance(n, bool) or n not in (None, 1):
        raise ApiError(400, "n: only one choice per request is supported", "n", "invalid_value")
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = _int(body, "max_tokens", 1) if max_tokens is None else max_tokens
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"seed must be an integer (got {seed!r})", "seed", "invalid_value")
    stream = body.get("stream")
    stream = False if stream is None else stream  # null, as OpenAI's API allows: no stream
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream", "invalid_value")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict)):
        raise ApiError(400, "stream_options is only allowed with stream: true, as an object", "stream_options",
                       "invalid_value")
    top_k = body.get("top_k")  # not OpenAI's, but vLLM's and llama.cpp's servers take it (-1 / 0: no cut)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise ApiError(400, f"top_k must be an integer >= 0, or -1 for none (got {top_k!r})", "top_k", "invalid_value")
    params = dict(max_tokens=max_tokens or default_max_tokens,
                  temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
                  top_p=_number(body, "top_p", 0.0, 1.0, 1.0), seed=None if seed is None else seed % 2**64,
                  stop=_stop(body), **({"top_k": top_k} if top_k and top_k > 0 else {}),
                  **_extensions(body))  # numpy seeds are unsigned; OpenAI's may be negative
    if params["top_p"] == 0:
        raise ApiError(400, "top_p must be in (0, 1] (got 0)", "top_p", "invalid_value")
    return dict(params=params, stream=stream, include_usage=bool((opts or {}).get("include_usage")))


# ---------------------------------------------------------------------------------------------- the engine's thread

@dataclass(eq=False)  # a job is itself (Worker.withdraw finds it in the queue by identity)
class Job:
    """One request handed to the worker; results come back on the event loop through `out`."""
    request: Request
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value=None) -> None:
        """("chunk", Chunk) … then ("done", Stats) or ("error", ApiError). Called from the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel.set()

    async def next(self):
        return await self.out.get()


OUTCOMES = ("completed", "cancelled", "rejected", "invalid", "failed")


class Worker:
    """The only thread that touches the engine. Holds at most one running job plus `max_queue` waiting ones.

    Counts each request's outcome once (`status`): completed; cancelled (its client left, or a shutdown cut it
    short); rejected (503: the queue was full); invalid (4xx: a bad request, a prompt that cannot fit, a body too
    large or too slow, whether found while parsing or once queued); failed (500)."""

    def __init__(self, engine, max_queue: int = 8, reuse: bool = True):
        self.engine, self.max_queue, self.reuse = engine, max_queue, reuse
        self.waiting: collections.deque[Job] = collections.deque()
        self.current: Job | None = None
        self.counts = collections.Counter()  # OUTCOMES
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="edge-serve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """Take no more work: the running generation stops within a step and, like every waiting request, is
        answered 503 shutting_down. Does not wait (a signal handler calls it: the server's own shutdown would
        otherwise wait for every running and queued generation to finish)."""
        with self._cv:
            self._stopping = True
            dropped = list(self.waiting)
            self.waiting.clear()  # the same deque: a submit this handler interrupted appends where drain looks
            if self.current is not None:
                self.current.cancel.set()  # the engine reads it too: a prefill stops at its next chunk
            self._cv.notify_all()
        for job in dropped:
            job.emit("error", _shutting_down())

    def stop(self, timeout: float = 10.0) -> None:
        self.drain()
        self._thread.join(timeout)

    def withdraw(self, job: Job) -> None:
        """The client of `job` left: free its queue slot now, and wake its handler, if it is still waiting (the
        running job stops at its next chunk instead)."""
        with self._cv:
            try:
                self.waiting.remove(job)
            except ValueError:
                return
            self.counts["cancelled"] += 1
        job.emit("error", _client_gone())

    def note(self, outcome: str) -> None:
        """Count a request answered before it reached the queue (parsing, reading its body)."""
        with self._cv:
            self.counts[outcome] += 1

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise _shutting_down()
            held = len(self.waiting) + (self.current is not None)  # the one the worker is about to take is waiting
            if held > self.max_queue:
                self.counts["rejected"] += 1
                raise ApiError(503, f"server busy: {held} requests already running or waiting, the most --max-queue "
                                    f"{self.max_queue} allows ({self.max_queue} waiting while one runs); retry "
                                    "later", code="server_busy")
            self.waiting.append(job)
            self._cv.notify()
            # a Ctrl-C / SIGTERM handler (drain) may have run on this thread between the check above and the
            # append, the lock being re-entrant: then nobody would ever answer this job
            if self._stopping:
                try:
                    self.waiting.remove(job)
                except ValueError:  # drain took it after the append and answered it 503
                    return
                raise _shutting_down()

    def status(self) -> dict:
        with self._cv:
            return {"busy": self.current is not None, "waiting": len(self.waiting), "max_queue": self.max_queue,
                    **{k: self.counts[k] for k in OUTCOMES}}

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self.waiting and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self.current = self.waiting.popleft()
            try:
                self._serve(job)
            finally:
                with self._cv:
                    self.current = None

    def _end(self, job: Job, outcome: str, kind: str, value) -> str:
        """Count the job's outcome, then emit what ends it: a /health read right after its answer includes it."""
        with self._cv:
            self.counts[outcome] += 1
        job.emit(kind, value)
        return outcome

    def _serve(self, job: Job) -> str:
        """Run one job: its chunks, then its counted end (`_end`) → its outcome."""
        if job.cancel.is_set():  # the client left while queued, or a shutdown began (its handler still waits)
            return self._end(job, "cancelled", "error", _shutting_down() if self._stopping else _client_gone())
        e, req = self.engine, job.request
        try:
            n = len(e.encode(req.prompt, raw=req.raw))
            if n >= e.context:
                raise _too_long(req.param, str(n), e.context)
            if not self.reuse:
                e.reset(keep_drafter_state=True)  # measure reuse's effect: prefill every prompt in full
            # the job's flag, set when its client leaves or the server shuts down, is the engine's cancel too: it
            # stops a long prompt's prefill at the next chunk, even one that has not begun yet
            stream, stopped = e.stream(req.prompt, raw=req.raw, cancel=job.cancel, **req.params), False
            try:
                for ch in stream:
                    if ch.finish_reason == CANCELLED:  # its client left, or a shutdown
                        stopped = True
                        break
                    job.emit("chunk", ch)
                    if ch.finish_reason is None and job.cancel.is_set():
                        stopped = True
                        break
            finally:
                stream.close()  # the engine rolls its cache back to what was emitted
            outcome = "cancelled" if stopped else "completed"
            if stopped and self._stopping:  # stopped by a shutdown, not by its client: say so
                return self._end(job, outcome, "error", _shutting_down("; the answer was cut short"))
            return self._end(job, outcome, "done", e.last_stats)
        # a client error found once queued is "invalid": a bad request, not a full queue
        except ApiError as x:  # refused here (a 400: too long for the context), not a failure of the server
            return self._end(job, "invalid", "error", x)
        except ModelDirError as x:  # e.g. a drafter this export does not have
            return self._end(job, "invalid", "error", ApiError(400, str(x), "edgespec.drafter", "unsupported_drafter"))
        except EngineError as x:
            param = getattr(x, "param", None)  # a BadMessage names the part of the request
            return self._end(job, "invalid", "error", ApiError(400, str(x), param, "invalid_request"))
        except Exception as x:  # a bug: answer 500, keep serving
            log.exception("generation failed")
            return self._end(job, "failed", "error", ApiError(500, f"internal error: {type(x).__name__}: {x}"))


# ---------------------------------------------------------------------------------------------- response bodies

def _usage(st) -> dict:
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.generated,
            "total_tokens": st.prompt_tokens + st.generated,
            "prompt_tokens_details": {"cached_tokens": st.reused_tokens}}


def _counters(st) -> dict:
    return {"drafter": st.drafter, "drafted": st.drafted, "accepted": st.accepted, "steps": st.steps,
            "mean_accepted_len": round(st.mean_accepted, 3), "prompt_tokens_reused": st.reused_tokens,
            "prefill_ms": round(1000 * st.prefill_s, 2), "decode_tok_s": round(st.decode_tok_s, 2)}


class _Reply:
    """The response, and the stream's chunks, of one chat completion (`chat.completion`, `chat.completion.chunk`):
    the fields they all share, and the shape of a choice."""
    prefix, kind, chunk_kind = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, request: Request):
        self.base = {"id": f"{self.prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model,
                     "system_fingerprint": "edgespec"}
        self.usage = {"usage": None} if request.include_usage else {}  # in every chunk until the usage chunk

    def completion(self, text: str, finish: str, st) -> dict:
        return {**self.base, "object": self.kind, "choices": [self.choice(text, finish)], "usage": _usage(st),
                "edgespec": _counters(st)}

    def chunk(self, text: str | None, finish: str | None = None, **extra) -> bytes:
        """One event with a piece of the text (None: no choice, as in the usage chunk)."""
        return self._event([] if text is None else [self.delta(text, finish)], **extra)

    def _event(self, choices: list, **extra) -> bytes:
        obj = {**self.base, "object": self.chunk_kind, "choices": choices, **extra}
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def opening(self) -> bytes | None:
        """The event before the first piece of text: the assistant's role."""
        return self._event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], **self.usage)

    @staticmethod
    def choice(text: str, finish: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    @staticmethod
    def delta(text: str, finish: str | None) -> dict:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}


class _TextReply(_Reply):
    """The same for a text completion (`text_completion`, the object of OpenAI's legacy completions, streamed or
    not); with `echo` the text starts with the prompt."""
    prefix, kind, chunk_kind = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str, request: Request):
        super().__init__(model, request)
        self.echo = valid_text(request.prompt) if request.echo else ""  # (as the tokenizer read it)

    def completion(self, text: str, finish: str, st) -> dict:
        return super().completion(self.echo + text, finish, st)

    def opening(self) -> bytes | None:
        return self.chunk(self.echo, **self.usage) if self.echo else None

    @staticmethod
    def choice(text: str, finish: str | None) -> dict:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}

    delta = choice


async def _events(job: Job, reply: _Reply, first) -> object:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    opening = reply.opening()
    if opening is not None:
        yield opening
    kind, value, finish = *first, None
    while kind == "chunk":
        if value.text:
            yield reply.chunk(value.text, **reply.usage)
        finish = value.finish_reason or finish
        kind, value = await job.next()
    if kind == "done":
        yield reply.chunk("", finish or "length", **reply.usage, edgespec=_counters(value))
        if job.request.include_usage:
            yield reply.chunk(None, usage=_usage(value), edgespec=_counters(value))
    else:  # failed after the stream began: the status line is sent already, so say it in the stream
        yield b"data: " + json.dumps(value.body()).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


async def _cancel_on_disconnect(receive, job: Job, worker: Worker) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()
    worker.withdraw(job)


# ---------------------------------------------------------------------------------------------- the app

APP_SCHEMES = ("app", "file", "tauri", "vscode-webview")  # desktop shells' page origins: pages on this machine


def origin_allowed(origin: str, allowed=()) -> bool:
    """May a web page of this Origin use the server? Pages served from this machine (http(s) on a loopback host,
    a desktop shell's app:// or file:// page) and the origins given with --allow-origin ("*": any)."""
    import urllib.parse

    if "*" in allowed or origin in allowed:
        return True
    try:
        u = urllib.parse.urlsplit(origin)
        host = u.hostname or ""
    except ValueError:  # a malformed Origin header
        return False
    return u.scheme in APP_SCHEMES or (u.scheme in ("http", "https") and _is_loopback(host))


class _OriginGuard:
    """Refuses (403) requests from web pages of other origins before any work is done. A browser sends a page's
    cross-site POST without asking first (CORS only hides the answer from the page), so without this any web
    site the user visits could keep the engine busy or fill the queue. Clients that are not browsers send no
    Origin and are unaffected."""

    def __init__(self, app, allowed=()):
        self.app, self.allowed = app, tuple(allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            origin = dict(scope["headers"]).get(b"origin")
            if origin is not None and not origin_allowed(origin.decode("latin-1"), self.allowed):
                from starlette.responses import JSONResponse

                o = origin.decode("latin-1")
                e = ApiError(403, f"requests from web pages at {o} are refused; to allow them, start edge-serve with "
                                  f"--allow-origin {o}", None, "origin_not_allowed")
                await JSONResponse(e.body(), 403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """A Host header's name or address, lower case, without port, brackets or a final dot."""
    h = host.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    if h.count(":") == 1:  # name:port (more colons: an unbracketed IPv6 address, kept whole)
        h = h.split(":")[0]
    return h.rstrip(".")


def host_allowed(host: str | None, allowed=(), bound: str | None = None) -> bool:
    """May a request whose Host header is `host` be served? DNS rebinding: a web page whose own name its author
    points at 127.0.0.1 reaches this server with `Host: <that name>`, and the browser treats it as the page's own
    site. So names are served only when they are this machine's (localhost, *.localhost, which resolve to loopback
    only), the address the server was bound to (--host), or given with --allow-host ("*": any). An IP address
    cannot be rebound (a page at an address comes from the machine that has it), so addresses are served; so is
    a request without a Host (HTTP/1.0: not a browser's)."""
    if host is None or not host.strip():
        return True
    name = _host_name(host)
    if "*" in allowed or name in {_host_name(a) for a in allowed}:
        return True
    if name == "localhost" or name.endswith(".localhost") or (bound is not None and name == _host_name(bound)):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class _HostGuard:
    """Refuses (403) requests addressed to a name that is not this server's (`host_allowed`), before any work."""

    def __init__(self, app, allowed=(), bound=None):
        self.app, self.allowed, self.bound = app, tuple(allowed), bound

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host")
            host = None if host is None else host.decode("latin-1")
            if not host_allowed(host, self.allowed, self.bound):
                from starlette.responses import JSONResponse

                name = _host_name(host)
                e = ApiError(403, f"requests for host {name!r} are refused (a web page can reach a local server "
                                  f"under its own name by DNS rebinding); to serve it, start edge-serve with "
                                  f"--allow-host {name}", None, "host_not_allowed")
                await JSONResponse(e.body(), 403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine, max_queue: int = 8, reuse: bool = True, default_max_tokens: int = DEFAULT_MAX_TOKENS,
               allow_origins=(), allow_hosts=(), bound_host: str | None = None, max_body: int = MAX_BODY,
               body_timeout: float | None = BODY_TIMEOUT_S):
    """The ASGI app around one loaded Engine (the caller keeps ownership of the engine). `allow_origins`: web
    page origins allowed besides this machine's own (`origin_allowed`); `allow_hosts`: Host names served besides
    this machine's and `bound_host` (`host_allowed`); `max_body` bytes and `body_timeout` seconds: a request body's
    limits. Prompts are held to `prompt_limits(engine)` before they are queued."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    worker = Worker(engine, max_queue, reuse)
    limits = prompt_limits(engine)
    model_id, chat = engine.manifest.name, engine.has_chat_template
    started = int(time.time())

    class SSEResponse(StreamingResponse):
        """Streams the events; however the response ends (done, client gone, server stopping), the job stops."""

        def __init__(self, events, job: Job):
            super().__init__(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.job.cancel.set()

    def error_response(e: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), e.status, headers=headers)

    async def answer(request, parse, refusal: ApiError | None = None):
        """One request of either endpoint: `parse` its body, or `refusal` once the body is in."""
        try:
            body = await _read_body(request, max_body, body_timeout)
            if refusal is not None:
                raise refusal
            req = parse(body, default_max_tokens, limits)
            if may_be_large(req.prompt):
                await asyncio.to_thread(refuse_if_surely_too_long, engine, req.prompt)
        except ApiError as e:  # answered before the queue: counted here, the worker counts the rest
            worker.note("cancelled" if e.status == 499 else "invalid")
            raise
        job = Job(req, asyncio.get_running_loop())
        worker.submit(job)
        watcher = asyncio.create_task(_cancel_on_disconnect(request.receive, job, worker))
        handed_off = False
        try:
            kind, value = first = await job.next()
            if kind == "error":
                raise value
            reply = (_TextReply if req.raw else _Reply)(model_id, req)
            if req.stream:
                handed_off = True
                return SSEResponse(_events(job, reply, first), job)
            text, finish = [], "length"
            while kind == "chunk":
                text.append(value.text)
                finish = value.finish_reason or finish
                kind, value = await job.next()
            if kind == "error":
                raise value
            return JSONResponse(reply.completion("".join(text), finish, value))
        finally:
            watcher.cancel()
            if not handed_off:
                job.cancel.set()  # no-op when done; stops the generation if this handler was cancelled

    async def chat_completions(request):
        refusal = None if chat else ApiError(400, f"{base_model(model_id)}; send the text to continue to POST "
                                                  "/v1/completions (prompt)", "messages", "no_chat_template")
        return await answer(request, parse_chat_request, refusal)

    async def completions(request):
        return await answer(request, parse_completion_request)

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": started, "owned_by": "edgespec",
                "edgespec": {"endpoints": list(ENDPOINTS if chat else ENDPOINTS[1:])}}

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request):
        if request.path_params["model"] != model_id:
            raise ApiError(404, f"model {request.path_params['model']!r} not found; this server has {model_id!r}",
                           "model", "model_not_found")
        return JSONResponse(model_card())

    async def health(request):
        conns = getattr(request.app.state, "connections", None)  # set by main(): the connection limits' counters
        return JSONResponse({"status": "ok", "model": model_id, "drafter": engine.default_drafter,
                             "context": engine.context, "reuse": reuse, **worker.status(),
                             **({"connections": conns.status()} if conns is not None else {})})

    async def on_api_error(request, e: ApiError):
        return error_response(e)

    async def on_http_error(request, e: HTTPException):
        r = error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                    code={404: "not_found", 405: "method_not_allowed"}.get(e.status_code)))
        r.headers.update(e.headers or {})  # a 405's Allow
        return r

    async def on_crash(request, e: Exception):
        log.exception("request failed")
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    # every route also without its /v1, as llama-server serves them, for clients given the bare address
    routes = [(ENDPOINTS[0], chat_completions, ["POST"]), (ENDPOINTS[1], completions, ["POST"]),
              ("/v1/models", models, None), ("/v1/models/{model:path}", model, None)]
    app = Starlette(routes=[Route(path, fn, methods=methods) for v1, fn, methods in routes
                            for path in (v1, v1.removeprefix("/v1"))] + [Route("/health", health)],
                    exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash},
                    lifespan=lifespan,
                    # allowed pages get CORS answers (and their preflight); the guards have refused all others
                    middleware=[Middleware(_HostGuard, allowed=allow_hosts, bound=bound_host),
                                Middleware(_OriginGuard, allowed=allow_origins),
                                Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST"],
                                           allow_headers=["*"],
                                           # Chromium's Private Network Access preflight (a page on a public site
                                           # reaching this loopback server); only pages the origin guard let
                                           # through get that far
                                           allow_private_network=True)])
    app.state.worker = worker
    return app


# ---------------------------------------------------------------------------------------------- connections

class ConnectionLimits:
    """At most `max_connections` open connections, each given `header_timeout` seconds for every request head.

    uvicorn's own `limit_concurrency` is no help here: it answers 503 to a request once its head is parsed, counting
    idle connections too, so a client holding idle sockets would turn every real request into a 503; and nothing
    closes a connection that never sends a request. Here a new connection over the cap closes the oldest one that is
    not in the middle of a request (idle, or still sending its head); when every one is, the new one is answered 503
    and closed. A request's body has its own deadline (--body-timeout); queued and running requests are bounded by
    --max-queue. Floods are logged as one line per LOG_EVERY_S with counts, never one per connection."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT_S,
                 clock=time.monotonic):
        self.max_connections, self.header_timeout, self.clock = max_connections, header_timeout, clock
        self.open: dict = {}  # protocol -> None, oldest first
        self.counts = collections.Counter()  # closed_idle / refused / timed_out, since start
        self._unlogged = collections.Counter()
        self._log_at = -math.inf

    def admit(self, conn) -> bool:
        """Register a new connection, making room by closing the oldest idle one; False: refuse it."""
        if len(self.open) >= self.max_connections:
            victim = next((c for c in self.open if c.waiting_for_head()), None)
            if victim is None:
                self._note("refused")
                return False
            del self.open[victim]
            victim.close_idle()
            self._note("closed_idle")
        self.open[conn] = None
        return True

    def forget(self, conn) -> None:
        self.open.pop(conn, None)

    def timed_out(self) -> None:
        self._note("timed_out")

    def status(self) -> dict:
        return {"open": len(self.open), "max": self.max_connections, **{k: self.counts[k] for k in
                                                                         ("closed_idle", "refused", "timed_out")}}

    def _note(self, kind: str) -> None:
        self.counts[kind] += 1
        self._unlogged[kind] += 1
        now = self.clock()
        if kind != "timed_out" and now >= self._log_at:  # timeouts alone are routine: counted in /health only
            n = self._unlogged
            done = [f"closed {n['closed_idle']} idle connection(s) to admit new ones"] if n["closed_idle"] else []
            done += [f"refused {n['refused']} new connection(s), every open one busy"] if n["refused"] else []
            log.warning(f"--max-connections {self.max_connections} reached: {'; '.join(done)} (one such line per "
                        f"{LOG_EVERY_S:g} s at most; /health counts them all)")
            self._unlogged.clear()
            self._log_at = now + LOG_EVERY_S


def guarded_protocol(limits: ConnectionLimits) -> type:
    """uvicorn's h11 protocol, held to `limits`: registered on connect, and closed when a request head has not
    fully arrived `limits.header_timeout` seconds after the connection opened or its last response ended (a client
    that never sends, or trickles its headers a byte at a time)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\n")
    body = json.dumps(ApiError(503, f"server busy: all {limits.max_connections} connections (--max-connections) are "
                                    "serving requests; retry later", code="server_busy").body()).encode()
    refusal = busy + b"content-length: %d\r\n\r\n" % len(body) + body

    class GuardedH11Protocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            if limits.admit(self):
                self._await_head()
            else:
                transport.write(refusal)
                transport.close()

        def data_received(self, data):
            super().data_received(data)
            if self._head_timer is not None and not self.waiting_for_head():  # the head is in: a request runs
                self._head_timer.cancel()
                self._head_timer = None

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing() and self.waiting_for_head():
                self._await_head()  # the next request's head gets the same time

        def connection_lost(self, exc):
            limits.forget(self)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def close_idle(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def _await_head(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(limits.header_timeout, self._head_overdue)

        def _head_overdue(self):
            self._head_timer = None
            if self.waiting_for_head() and not self.transport.is_closing():
                limits.timed_out()
                self.transport.close()

    return GuardedH11Protocol


class RateLimitFilter(logging.Filter):
    """Lets one record whose message starts with `prefix` through per `period` seconds, as one line (no
    traceback) saying how many were held back since the last one. For asyncio's accept loop, which at the
    descriptor limit logs 'socket.accept() out of system resource' with a traceback for every attempt (thousands a
    second)."""

    def __init__(self, prefix: str, period: float = LOG_EVERY_S, clock=time.monotonic):
        super().__init__()
        self.prefix, self.period, self.clock = prefix, period, clock
        self.held, self._next = 0, -math.inf
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            return True
        with self._lock:
            now = self.clock()
            if now < self._next:
                self.held += 1
                return False
            held, self.held, self._next = self.held, 0, now + self.period
        exc = record.exc_info[1] if record.exc_info else None
        record.msg = (self.prefix + (f": {exc}" if exc is not None else "")
                      + (f" ({held} more like it since the last such line)" if held else "")
                      + f" (at most one such line per {self.period:g} s)")
        record.args, record.exc_info, record.exc_text = None, None, None
        return True


ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message at the descriptor limit


def raise_fd_limit(want: int) -> int:
    """Raise the soft limit on open descriptors towards `want`, as far as the hard limit allows; the soft limit
    now in force (or `want` where there is no such limit to read, as on Windows)."""
    try:
        import resource
    except ImportError:
        return want
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return want if soft == resource.RLIM_INFINITY else soft


def uvicorn_config(app, host: str, port: int, limits: ConnectionLimits, **kw):
    """uvicorn's Config for `app`, its connections held to `limits`."""
    import uvicorn

    kw.setdefault("timeout_graceful_shutdown", SHUTDOWN_GRACE_S)
    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limits), ws="none", **kw)


# ---------------------------------------------------------------------------------------------- CLI

def _load_params() -> set[str]:
    """edge.load's keyword parameters: the edge-chat flags of the same name are the engine flags."""
    import edge

    return set(inspect.signature(edge.load).parameters) - {"model", "progress"}


def _parser() -> argparse.ArgumentParser:
    from ..args import add_engine_args, add_model_arg, add_version

    ap = argparse.ArgumentParser(
        prog="edge-serve",
        description="Serve a local model over the OpenAI API: chat completions (POST /v1/chat/completions), text "
                    "completions (POST /v1/completions: a prompt the model continues as it is), GET /v1/models, "
                    "GET /health. A base model without a chat template (gemma3-270m) serves text completions only; "
                    "its chat completions get a 400 that says so. With no --model, the embedded "
                    "SmolLM2-135M-Instruct is exported into the cache on first run, as edge-chat does.")
    add_model_arg(ap, "--model", "--model-dir")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1, this machine only; anything else exposes the model "
                         "to the network without authentication)")
    ap.add_argument("--port", type=int, default=8080, help="TCP port (default 8080)")
    ap.add_argument("--max-queue", type=int, default=8,
                    help="requests that may wait while one generates; more get HTTP 503 (default 8)")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                    help=f"answer length when a request gives no max_tokens (default {DEFAULT_MAX_TOKENS}, as "
                         "edge-chat and the Python API)")
    ap.add_argument("--no-reuse", action="store_true",
                    help="prefill every prompt in full instead of reusing the previous conversation's KV cache "
                         "(for measuring what reuse saves)")
    ap.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                    help="let web pages of this origin (e.g. https://chat.example.org, or * for any) call the API; "
                         "repeatable. Pages served from this machine (http(s) on localhost, 127.0.0.1 or [::1], any "
                         "port; app://, file://, tauri:// and vscode-webview:// pages of desktop shells) are always "
                         "allowed, others are refused with 403 (default: none). Clients that are not browsers send no "
                         "Origin and are never refused")
    ap.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                    help="serve requests addressed to this host name (e.g. chat.lan, or * for any); repeatable. "
                         "localhost, *.localhost, IP addresses and the --host name are always served; requests for "
                         "other names get 403, since a web page can reach a local server under a name of its own "
                         "(DNS rebinding)")
    ap.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                    help=f"open connections at most (default {MAX_CONNECTIONS}); past it a new connection closes the "
                         "oldest idle one, or gets 503 if every one is serving a request. Lowered to fit the open-file "
                         "limit (ulimit -n), which edge-serve raises as far as the hard limit allows")
    ap.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="S",
                    help=f"seconds a connection may take to send a request's headers, from connecting or from its "
                         f"previous answer (default {HEADER_TIMEOUT_S:g}); slower ones are closed")
    ap.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                    help=f"seconds a client may take to send a request body (default {BODY_TIMEOUT_S:g}); slower ones "
                         "get HTTP 408")
    ap.add_argument("--max-body-mb", type=float, default=MAX_BODY / (1 << 20), metavar="MB",
                    help=f"largest request body in MiB (default {MAX_BODY / (1 << 20):g}); larger ones get HTTP 413. "
                         "Prompts are also refused (400) before tokenizing when they have more messages than the "
                         "context has tokens, or more text than its tokens could hold")
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                    help="uvicorn's log level; info logs every request (default warning)")
    add_engine_args(ap)  # the same engine flags as edge-chat
    add_version(ap)
    return ap


def uvicorn_server(config, worker: Worker):
    """uvicorn's Server, whose Ctrl-C / SIGTERM first drains the worker: uvicorn's graceful shutdown waits for every
    open request, so without it the process would live on until every running and queued generation had finished
    (minutes, past a service manager's SIGKILL). Running and queued requests are answered 503 instead."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            worker.drain()
            super().handle_exit(sig, frame)

    return Server(config)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen_check(host: str, port: int):
    """(socket, problem): why the server could not listen on host:port (unknown host, in use, not an address here),
    checked with a bind like uvicorn's own (SO_REUSEADDR) before the model loads. The socket is released for uvicorn
    to bind again, except for port 0 (any free port): that one is kept and handed to uvicorn, so the port announced
    is the port that serves."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return None, f"cannot resolve --host {host} ({e.strerror or e})"
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = "; stop the other server or choose another --port" if e.errno == errno.EADDRINUSE else ""
        return None, f"cannot listen on {host}:{port} ({e.strerror or e}){hint}"
    if port:
        sock.close()
        return None, None
    return sock, None


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    from ..args import plain_warnings

    plain_warnings("edge-serve")
    if a.max_queue < 0 or a.max_tokens < 1 or not 0 <= a.port < 65536:
        print("edge-serve: error: --max-queue must be >= 0, --max-tokens >= 1, --port in [0, 65535]", file=sys.stderr)
        return 2
    if a.max_connections < 1 or not (0 < a.header_timeout < math.inf and 0 < a.body_timeout < math.inf
                                     and 0 < a.max_body_mb < math.inf):
        print("edge-serve: error: --max-connections must be >= 1; --header-timeout, --body-timeout and "
              "--max-body-mb > 0", file=sys.stderr)
        return 2
    if not _is_loopback(a.host):
        print(f"edge-serve: warning: binding {a.host}: the API has no authentication; anyone who can reach this "
              "address can use the model", file=sys.stderr)
    sock, problem = _listen_check(a.host, a.port)
    if problem:  # before loading the model, and before claiming to serve on it
        print(f"edge-serve: error: {problem}", file=sys.stderr)
        return 2
    sockets, port = ([sock], sock.getsockname()[1]) if sock else (None, a.port)
    import edge

    try:
        engine = edge.load(a.model, **{k: v for k, v in vars(a).items() if k in _load_params()})
    except (EngineError, ValueError) as e:  # ModelDirError is an EngineError
        print(f"edge-serve: error: {e}", file=sys.stderr)
        return 2
    from ..args import chat_context_problem

    problem = chat_context_problem(engine)
    if problem:
        print(f"edge-serve: error: {problem}", file=sys.stderr)
        return 2
    app = create_app(engine, max_queue=a.max_queue, reuse=not a.no_reuse, default_max_tokens=a.max_tokens,
                     allow_origins=a.allow_origin, allow_hosts=a.allow_host, bound_host=a.host,
                     max_body=int(a.max_body_mb * (1 << 20)), body_timeout=a.body_timeout)
    files = raise_fd_limit(a.max_connections + FD_RESERVE + 3 * BACKLOG)
    max_connections = max(1, min(a.max_connections, files - FD_RESERVE))
    if max_connections < a.max_connections:
        print(f"edge-serve: note: --max-connections lowered to {max_connections}: this process may open {files} "
              "files (ulimit -n), some of them for the model", file=sys.stderr)
    app.state.connections = limits = ConnectionLimits(max_connections, a.header_timeout)
    accepts = logging.getLogger("asyncio")
    if not any(isinstance(f, RateLimitFilter) for f in accepts.filters):
        accepts.addFilter(RateLimitFilter(ACCEPT_ERROR))
    url_host = f"[{a.host}]" if ":" in a.host else a.host
    base = "" if engine.has_chat_template else "; a base model without a chat template: POST /v1/completions only"
    print(f"edge-serve: {engine.manifest.name} (drafter {engine.default_drafter}, context {engine.context}) on "
          f"http://{url_host}:{port}/v1{base}", file=sys.stderr, flush=True)
    # asyncio accepts up to `backlog` connections at a time before any of them can be turned away: keep a burst of
    # them (a few rounds) within the descriptors left, or accept() fails and the listener pauses for a second
    backlog = max(16, min(BACKLOG, (files - max_connections - FD_RESERVE // 4) // 3))
    config = uvicorn_config(app, a.host, port, limits, backlog=backlog, log_level=a.log_level,
                            access_log=a.log_level in ("debug", "info"))
    server = uvicorn_server(config, app.state.worker)
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # Ctrl-C after its graceful shutdown (uvicorn.run swallows it the same way)
        pass
    if not server.started:  # as uvicorn.run exits 3 when start-up failed (its log above says why)
        print("edge-serve: error: the server did not start", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
