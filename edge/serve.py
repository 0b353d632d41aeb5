"""edge-serve: an OpenAI-compatible local HTTP server for one exported model.

    POST /v1/chat/completions   messages, max_tokens, temperature, top_p, top_k, seed, stop, stream (+ stream_options)
    GET  /v1/models             the loaded model
    GET  /health                status and counters

edgespec extensions live under an "edgespec" key: in a request `{"edgespec": {"drafter": "lookup", "draft_len": 4}}`,
in a response the speculative counters (drafted, accepted, steps, mean accepted length) and `prompt_tokens_reused`.

Requests run one at a time on the engine, in one worker thread (never on the event loop), behind a bounded queue;
a full queue is a 503. The engine keeps the longest common token prefix of the previous conversation in its KV
cache, so a chat client that resends the whole history each turn only prefills the new tokens
(`usage.prompt_tokens_details.cached_tokens`). A client that disconnects stops its generation; the engine rolls
its cache back in `finally`, so the next request starts from a consistent state.

HTTP stack: starlette + uvicorn (pure Python, no pydantic); see the README's "OpenAI-compatible server" section.
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
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from .engine import DRAFTERS, MAX_DRAFT_LEN, BadMessage, EngineError, normalize_messages
from .manifest import ModelDirError

log = logging.getLogger("edge.serve")

MAX_BODY = 4 << 20  # bytes; a prompt past the context is refused anyway, this bounds the tokenizer's work
MAX_STOP = 4  # OpenAI's limit
SHUTDOWN_GRACE_S = 5  # after Ctrl-C / SIGTERM, uvicorn's wait for open requests (each was told to stop already)


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
class ChatRequest:
    messages: list[dict]
    params: dict  # keyword arguments for Engine.stream
    stream: bool = False
    include_usage: bool = False


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


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages",
                       "missing_required_parameter" if msgs is None else "invalid_value")
    try:  # the engine's rules (roles, text parts); only role and content reach the template here
        return [{"role": m["role"], "content": m["content"]} for m in normalize_messages(msgs)]
    except BadMessage as e:
        raise ApiError(400, str(e), e.param, "invalid_value") from None


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
        if ext["drafter"] not in DRAFTERS:
            raise ApiError(400, f"edgespec.drafter {ext['drafter']!r}: choose one of {', '.join(DRAFTERS)}",
                           "edgespec.drafter", "invalid_value")
        out["drafter"] = ext["drafter"]
    k = _int(ext, "draft_len", 0, "edgespec.draft_len")
    if k is not None:
        if k > MAX_DRAFT_LEN:
            raise ApiError(400, f"edgespec.draft_len must be in [0, {MAX_DRAFT_LEN}] (got {k})", "edgespec.draft_len",
                           "invalid_value")
        out["draft_len"] = k
    return out


async def _read_body(request) -> bytes:
    """The request body, refused with 413 as soon as it is known to pass MAX_BODY (from Content-Length, or while
    reading): a client cannot make the server hold an arbitrarily large body in memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise ApiError(413, f"request body is {int(declared)} bytes; the limit is {MAX_BODY}", None,
                       "request_too_large")
    parts, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_BODY:
            raise ApiError(413, f"request body is over the limit of {MAX_BODY} bytes", None, "request_too_large")
        parts.append(chunk)
    return b"".join(parts)


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


def parse_chat_request(raw: bytes, default_max_tokens: int) -> ChatRequest:
    """Validate a chat-completions body → ChatRequest; ApiError(400) names the offending parameter.
    Unknown top-level fields (user, logit_bias, ...) are ignored, as OpenAI-compatible servers commonly do."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:  # nesting deeper than the parser's recursion limit
        raise ApiError(400, "request body is not valid JSON: nested too deeply", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", None, "invalid_json")
    messages = _messages(body)
    if body.get("model") is not None and not isinstance(body["model"], str):  # any name is served (one model)
        raise ApiError(400, f"model must be a string (got {body['model']!r})", "model", "invalid_value")
    n = body.get("n")
    if isinstance(n, bool) or n not in (None, 1):
        raise ApiError(400, "n: only one choice per request is supported", "n", "invalid_value")
    _refuse_unsupported(body)
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
    return ChatRequest(messages, params, stream, bool((opts or {}).get("include_usage")))


# ---------------------------------------------------------------------------------------------- the engine's thread

@dataclass(eq=False)  # a job is itself (Worker.withdraw finds it in the queue by identity)
class Job:
    """One request handed to the worker; results come back on the event loop through `out`."""
    request: ChatRequest
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


class Worker:
    """The only thread that touches the engine. Holds at most one running job plus `max_queue` waiting ones."""

    def __init__(self, engine, max_queue: int = 8, reuse: bool = True):
        self.engine, self.max_queue, self.reuse = engine, max_queue, reuse
        self.waiting: collections.deque[Job] = collections.deque()
        self.current: Job | None = None
        self.counts = collections.Counter()  # completed / cancelled / rejected / failed
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
                self.current.cancel.set()
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

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise _shutting_down()
            if len(self.waiting) + (self.current is not None) > self.max_queue:
                self.counts["rejected"] += 1
                raise ApiError(503, f"server busy: {len(self.waiting)} request(s) already waiting (--max-queue "
                                    f"{self.max_queue}); retry later", code="server_busy")
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
                    **{k: self.counts[k] for k in ("completed", "cancelled", "rejected", "failed")}}

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self.waiting and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self.current = self.waiting.popleft()
            try:
                outcome = self._serve(job)
            finally:
                with self._cv:
                    self.current = None
                    self.counts[outcome] += 1

    def _serve(self, job: Job) -> str:
        if job.cancel.is_set():  # the client left while queued, or a shutdown began (its handler still waits)
            job.emit("error", _shutting_down() if self._stopping else _client_gone())
            return "cancelled"
        e, req = self.engine, job.request
        try:
            n = len(e.encode(req.messages))
            if n >= e.context:
                raise ApiError(400, f"the messages are {n} tokens but the context holds {e.context}; shorten the "
                                    "conversation (or restart edge-serve with a larger --context)", "messages",
                               "context_length_exceeded")
            if not self.reuse:
                e.reset(keep_drafter_state=True)  # measure reuse's effect: prefill every prompt in full
            stream, stopped = e.stream(req.messages, **req.params), False
            try:
                for ch in stream:
                    job.emit("chunk", ch)
                    if ch.finish_reason is None and job.cancel.is_set():
                        stopped = True
                        break
            finally:
                stream.close()  # the engine rolls its cache back to what was emitted
            if stopped and self._stopping:  # stopped by a shutdown, not by its client: say so
                job.emit("error", _shutting_down("; the answer was cut short"))
            else:
                job.emit("done", e.last_stats)
            return "cancelled" if stopped else "completed"
        except ApiError as x:  # refused here (a 400: too long for the context), not a failure of the server
            job.emit("error", x)
        except ModelDirError as x:  # e.g. a drafter this export does not have
            job.emit("error", ApiError(400, str(x), "edgespec.drafter", "unsupported_drafter"))
        except EngineError as x:
            job.emit("error", ApiError(400, str(x), None, "invalid_request"))
        except Exception as x:  # a bug: answer 500, keep serving
            log.exception("generation failed")
            job.emit("error", ApiError(500, f"internal error: {type(x).__name__}: {x}"))
            return "failed"
        return "rejected"


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
    """The fields every response and chunk of one completion share."""

    def __init__(self, model: str):
        self.base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model,
                     "system_fingerprint": "edgespec"}

    def completion(self, text: str, finish: str, st) -> dict:
        return {**self.base, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish}],
                "usage": _usage(st), "edgespec": _counters(st)}

    def chunk(self, delta: dict | None, finish: str | None = None, **extra) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        obj = {**self.base, "object": "chat.completion.chunk", "choices": choices, **extra}
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _events(job: Job, reply: _Reply, first) -> object:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    usage = {"usage": None} if job.request.include_usage else {}
    yield reply.chunk({"role": "assistant", "content": ""}, **usage)
    kind, value, finish = *first, None
    while kind == "chunk":
        if value.text:
            yield reply.chunk({"content": value.text}, **usage)
        finish = value.finish_reason or finish
        kind, value = await job.next()
    if kind == "done":
        yield reply.chunk({}, finish or "length", **usage, edgespec=_counters(value))
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


def create_app(engine, max_queue: int = 8, reuse: bool = True, default_max_tokens: int = 1024,
               allow_origins=()):
    """The ASGI app around one loaded Engine (the caller keeps ownership of the engine). `allow_origins`: web
    page origins allowed besides this machine's own (`origin_allowed`)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    worker = Worker(engine, max_queue, reuse)
    model_id = engine.manifest.name
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

    async def chat_completions(request):
        body = await _read_body(request)
        req = parse_chat_request(body, default_max_tokens)
        job = Job(req, asyncio.get_running_loop())
        worker.submit(job)
        watcher = asyncio.create_task(_cancel_on_disconnect(request.receive, job, worker))
        handed_off = False
        try:
            kind, value = first = await job.next()
            if kind == "error":
                raise value
            reply = _Reply(model_id)
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

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": started, "owned_by": "edgespec"}

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request):
        if request.path_params["model"] != model_id:
            raise ApiError(404, f"model {request.path_params['model']!r} not found; this server has {model_id!r}",
                           "model", "model_not_found")
        return JSONResponse(model_card())

    async def health(request):
        return JSONResponse({"status": "ok", "model": model_id, "drafter": engine.default_drafter,
                             "context": engine.context, "reuse": reuse, **worker.status()})

    async def on_api_error(request, e: ApiError):
        return error_response(e)

    async def on_http_error(request, e: HTTPException):
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                       code="not_found" if e.status_code == 404 else None))

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

    app = Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                            Route("/v1/models", models), Route("/v1/models/{model:path}", model),
                            Route("/health", health)],
                    exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash},
                    lifespan=lifespan,
                    # allowed pages get CORS answers (and their preflight); the guard has refused all others
                    middleware=[Middleware(_OriginGuard, allowed=allow_origins),
                                Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST"],
                                           allow_headers=["*"])])
    app.state.worker = worker
    return app


# ---------------------------------------------------------------------------------------------- CLI

def _load_params() -> set[str]:
    """edge.load's keyword parameters: the edge-chat flags of the same name are the engine flags."""
    import edge

    return set(inspect.signature(edge.load).parameters) - {"model_dir", "progress"}


def _parser() -> argparse.ArgumentParser:
    from .cli import add_engine_args

    ap = argparse.ArgumentParser(
        prog="edge-serve",
        description="Serve a local model over the OpenAI chat-completions API (POST /v1/chat/completions, "
                    "GET /v1/models, GET /health). With no --model-dir, the embedded SmolLM2-135M-Instruct is "
                    "exported into the cache on first run, as edge-chat does.")
    ap.add_argument("--model-dir", "--model", dest="model_dir", metavar="DIR",
                    help="exported model directory (edge-export); default: the embedded model")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1, this machine only; anything else exposes the model "
                         "to the network without authentication)")
    ap.add_argument("--port", type=int, default=8080, help="TCP port (default 8080)")
    ap.add_argument("--max-queue", type=int, default=8,
                    help="requests that may wait while one generates; more get HTTP 503 (default 8)")
    ap.add_argument("--max-tokens", type=int, default=1024,
                    help="answer length when a request gives no max_tokens (default 1024)")
    ap.add_argument("--no-reuse", action="store_true",
                    help="prefill every prompt in full instead of reusing the previous conversation's KV cache "
                         "(for measuring what reuse saves)")
    ap.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                    help="let web pages of this origin (e.g. https://chat.example.org, or * for any) call the API; "
                         "repeatable. Pages served from this machine (http(s) on localhost, 127.0.0.1 or [::1], any "
                         "port; app://, file://, tauri:// and vscode-webview:// pages of desktop shells) are always "
                         "allowed, others are refused with 403 (default: none). Clients that are not browsers send no "
                         "Origin and are never refused")
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                    help="uvicorn's log level; info logs every request (default warning)")
    add_engine_args(ap)  # the same engine flags as edge-chat
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
    if a.max_queue < 0 or a.max_tokens < 1 or not 0 <= a.port < 65536:
        print("edge-serve: error: --max-queue must be >= 0, --max-tokens >= 1, --port in [0, 65535]", file=sys.stderr)
        return 2
    if not _is_loopback(a.host):
        print(f"edge-serve: warning: binding {a.host}: the API has no authentication; anyone who can reach this "
              "address can use the model", file=sys.stderr)
    sock, problem = _listen_check(a.host, a.port)
    if problem:  # before loading the model, and before claiming to serve on it
        print(f"edge-serve: error: {problem}", file=sys.stderr)
        return 2
    sockets, port = ([sock], sock.getsockname()[1]) if sock else (None, a.port)
    import uvicorn

    import edge

    try:
        engine = edge.load(a.model_dir, **{k: v for k, v in vars(a).items() if k in _load_params()})
    except (EngineError, ValueError) as e:  # ModelDirError is an EngineError
        print(f"edge-serve: error: {e}", file=sys.stderr)
        return 2
    from .cli import chat_context_problem

    problem = chat_context_problem(engine)
    if problem:
        print(f"edge-serve: error: {problem}", file=sys.stderr)
        return 2
    app = create_app(engine, max_queue=a.max_queue, reuse=not a.no_reuse, default_max_tokens=a.max_tokens,
                     allow_origins=a.allow_origin)
    url_host = f"[{a.host}]" if ":" in a.host else a.host
    print(f"edge-serve: {engine.manifest.name} (drafter {engine.default_drafter}, context {engine.context}) on "
          f"http://{url_host}:{port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=a.host, port=port, log_level=a.log_level,
                            access_log=a.log_level in ("debug", "info"), timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
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
