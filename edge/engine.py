"""The engine: one generation loop (prefill → draft → verify → accept/reject → KV commit/rollback → drafter update),
and the thin `generate` / `stream` / `Chat` wrappers around it.

Invariant between steps: the target KV cache holds the context plus every emitted token except the last one (the
"root"), which is the first token of the next verify call. The cache owns its token ids, so a new request (or chat
turn) re-uses the longest common prefix and prefills only what is new.

The pieces the loop calls: `edge.draftlen` (how many tokens to draft, and what each step teaches), `edge.output`
(EOS, max_tokens, stop strings, UTF-8 → chunks), `kernels` (accept/reject), `edge.kv` (commit and rollback).
"""
from __future__ import annotations

import contextlib
import copy
import numbers
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from kernels.sampling import CorruptOutput, check_chosen, make_sampler, probs_from_top, process_logits
from kernels.tree import TreeLayout, verify_greedy_tree, verify_sampling_tree
from kernels.verify import verify_greedy, verify_sampling
from memory.footprint import PREFILL_CHUNK, drafter_graph
from memory.planner import MAX_CHAIN, fullest, plain_call_rows

from .draftlen import DraftLength
from .drafters import (DRAFTER_CHOICES, DRAFTER_KINDS, Draft, Drafter, HybridDrafter, LookupDrafter, ModelDrafter,
                       NoDrafter, RecyclingDrafter)
from .errors import BudgetError, EngineError, ModelOutputError, as_engine_error
from .manifest import (VERIFY_LEVELS, ModelDirError, check_drafter, load_manifest, reexport_command,
                       require_drafter_graph)
from .output import AnswerText, Chunk
from .pages import release as release_pages
from .runner import HEAD_TOPK_MAX, HEAD_TOPK_NUCLEUS, GraphSession, Output, check_threads, open_session
from .text import TextCodec

DEFAULT_CONTEXT = 4096  # tokens, when neither the caller nor a smaller export says otherwise
MAX_DRAFT_LEN = 64  # draft tokens per call a request may ask for (draft_len)
DEFAULT_MAX_TOKENS = 512  # answer length when a request sets none: the API, edge-chat and edge-serve alike
CANCELLED = "cancelled"  # the finish_reason of an answer `Engine.cancel` ended


def _is_int(v) -> bool:
    """A whole number (numpy's too), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


class ContextFull(EngineError):
    """A chat turn refused because the history does not fit the context (`n` tokens, `context` slots); `alone`:
    the new question (with the system message) does not fit even without earlier turns."""

    def __init__(self, message: str, n: int, context: int, alone: bool = False):
        super().__init__(message)
        self.n, self.context, self.alone = n, context, alone


class EngineBusy(EngineError):
    """The engine is running another request (one at a time per engine): serialize calls, `cancel()` the running
    one, or load a second engine."""


BUSY_HINT = ("in another thread, or an earlier stream() that was neither finished nor closed: call its close(), "
             "or iterate it inside contextlib.closing")


@contextlib.contextmanager
def _holding(lock: threading.Lock, busy: str):
    """Hold `lock` for the block, or raise EngineBusy(busy) at once if a generation (or a chat turn) holds it."""
    if not lock.acquire(blocking=False):
        raise EngineBusy(busy)
    try:
        yield
    finally:
        lock.release()

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class BadMessage(EngineError):
    """A chat message or prompt the API cannot take; `param` names it as OpenAI's API does (`messages[2].content`,
    `prompt`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None and m.get("role") == "assistant":  # an assistant turn that only called tools (OpenAI's null)
        return ""
    if isinstance(c, list):  # OpenAI's content parts: text only
        texts = [x.get("text") for x in c if isinstance(x, dict) and x.get("type") == "text"]
        if len(texts) == len(c) and all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
        raise BadMessage(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
    raise BadMessage(f"bad message {i}: content must be a string or a list of text parts (got {c!r:.60})",
                     f"messages[{i}].content")


def base_model(name: str) -> str:
    """What a model without a chat template is, for the messages that refuse a chat on it (each adds its fix)."""
    return f"{name} is a base model without a chat template: it continues text rather than answering messages"


def normalize_messages(msgs) -> list[dict]:
    """OpenAI-style messages → the chat template's: roles system/developer (a system message)/user/assistant/tool,
    content a string or a list of text parts (joined by newlines). Other keys are kept for the template."""
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadMessage(f"bad message {i}: expected {{'role': ..., 'content': ...}} (got {m!r:.60})",
                             f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # (a list or dict role is unhashable)
            raise BadMessage(f"bad message {i}: role {role!r}; expected one of {', '.join(ROLES)}",
                             f"messages[{i}].role")
        out.append({**m, "role": ROLES[role], "content": _content(m, i)})
    return out


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    drafter: str | None = None  # None: the engine's default
    draft_len: int | None = None  # None: the drafter's default

    def check(self, context_room: int) -> None:
        for name in ("temperature", "top_p"):  # numbers (numpy's too), not strings or None
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                raise EngineError(f"{name} must be a number (got {v!r})")
        for name in ("top_k", "draft_len"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise EngineError(f"{name} must be an integer (got {v!r})")
        # max_tokens beyond the context is allowed: the answer ends with finish_reason "length" when the window is full
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise EngineError(f"max_tokens must be a positive integer (got {self.max_tokens!r})")
        if not (0 <= self.temperature < float("inf")):
            raise EngineError(f"temperature must be a finite number >= 0 (got {self.temperature!r}); 0 means greedy")
        if not (0 < self.top_p <= 1):
            raise EngineError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise EngineError(f"top_k must be an integer >= 0 (got {self.top_k!r}); 0 disables it")
        if self.drafter is not None and self.drafter not in DRAFTER_CHOICES:
            raise EngineError(f"drafter {self.drafter!r}: choose one of {', '.join(DRAFTER_CHOICES)}")
        if self.draft_len is not None and not (0 <= self.draft_len <= MAX_DRAFT_LEN):
            raise EngineError(f"draft_len must be in [0, {MAX_DRAFT_LEN}] (got {self.draft_len!r})")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise EngineError(f"seed must be an integer >= 0 or None (got {self.seed!r})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise EngineError(f"stop strings must be non-empty strings (got {list(self.stop)!r})")


@dataclass
class Stats:
    """One request's counters and timings (`GenerationResult.stats`; `Engine.last_stats` after a stream's last
    chunk)."""
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens already in the KV cache (not prefilled again)
    generated: int = 0
    steps: int = 0  # target verify/decode calls after prefill
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens the target accepted
    prefill_s: float = 0.0
    decode_s: float = 0.0
    target_s: float = 0.0  # time inside target calls during decode (ONNX Runtime and the Python around it)
    draft_s: float = 0.0  # time inside the drafter
    ort_s: float = 0.0  # time inside ONNX Runtime during decode (target and drafter graphs); the rest is Python
    drafter: str = "none"

    @property
    def decode_tok_s(self) -> float:
        return (self.generated - 1) / self.decode_s if self.decode_s > 0 and self.generated > 1 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per verify call (accepted drafts + the target's own)."""
        return (self.generated - 1) / self.steps if self.steps else 0.0

    @property
    def overhead_ms_per_step(self) -> float:
        """The loop's own bookkeeping per step: decode time outside target calls and the drafter."""
        return 1000 * (self.decode_s - self.target_s - self.draft_s) / self.steps if self.steps else 0.0

    @property
    def python_ms_per_step(self) -> float:
        """Everything that is not ONNX Runtime per step: feeds and bindings, drafting, verification, Token
        Recycling's tables, bookkeeping, text decoding."""
        return 1000 * (self.decode_s - self.ort_s) / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(decode_tok_s=round(self.decode_tok_s, 2), mean_accepted=round(self.mean_accepted, 3),
                 overhead_ms_per_step=round(self.overhead_ms_per_step, 3),
                 python_ms_per_step=round(self.python_ms_per_step, 3))
        return d


@dataclass
class GenerationResult:
    """A whole answer: its text, the token ids generated (ending with EOS or the token that completed a stop
    string, whose text is not shown), finish_reason ("stop": EOS or a stop string; "length": max_tokens or a full
    context; "cancelled": `Engine.cancel`) and the request's `Stats`."""
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats = field(default_factory=Stats)

    @property
    def drafted(self) -> int:
        return self.stats.drafted

    @property
    def accepted(self) -> int:
        return self.stats.accepted

    @property
    def steps(self) -> int:
        return self.stats.steps


def collect(chunks: Iterator[Chunk], engine: "Engine", into: GenerationResult | None = None) -> GenerationResult:
    """The answer a stream of chunks makes, built in `into` (a caller that catches Ctrl-C keeps what came before it).
    Its stats are the request's own: read while the request holds the engine, since another may follow."""
    r = into if into is not None else GenerationResult("", [], "length")
    parts = [r.text]
    try:
        for ch in chunks:
            if len(parts) == 1:
                r.stats = engine.last_stats
            parts.append(ch.text)
            r.token_ids += ch.token_ids
            r.finish_reason = ch.finish_reason or r.finish_reason
    finally:
        r.text = "".join(parts)
        if len(parts) == 1 and engine.last_stats is not None:  # no chunk came: the latest request's
            r.stats = engine.last_stats
    return r


class Engine:
    """One loaded model: the target session and its KV cache, the drafters, the adaptive draft length and the memory
    plan. `stream` / `generate` / `chat` run requests on it, one at a time."""

    def __init__(self, model_dir: str | Path, drafter: str = "auto", threads: int | None = None,
                 context: int | None = None,
                 providers=("CPUExecutionProvider",), verify: str = "fast", profile=None,
                 budget_mb: float | None = None):
        if drafter not in DRAFTER_CHOICES:
            raise EngineError(f"drafter {drafter!r}: choose one of {', '.join(DRAFTER_CHOICES)}")
        if threads is not None and (not _is_int(threads) or threads < 1):
            raise EngineError(f"threads must be a whole number >= 1 (got {threads!r})")
        threads = check_threads(threads)
        if context is not None and (not _is_int(context) or context < 1):
            raise EngineError(f"context must be a whole number >= 1 (got {context!r})")
        threads, context = int(threads), None if context is None else int(context)
        if verify not in VERIFY_LEVELS:
            raise EngineError(f"verify={verify!r}: choose one of {', '.join(VERIFY_LEVELS)}")
        self.model_dir = Path(model_dir)
        self.manifest = m = load_manifest(self.model_dir, verify=verify)
        for g in m.drafters:  # a foreign or damaged drafter fails here, not on its first request
            check_drafter(self.model_dir, m, g)
        self.codec = _open_codec(self.model_dir, m)
        self.eos = set(self.codec.eos)
        self.threads, self.providers = threads, providers
        t = m.target
        if context is not None and context > t.max_len:
            raise EngineError(f"context {context} is more than the {t.max_len} tokens {t.file} was exported for; ask "
                              f"for at most {t.max_len}, or re-export with a larger --max-len")
        self.context = min(context or DEFAULT_CONTEXT, t.max_len)
        self.target = open_session(str(self.model_dir / t.file), m, t, self.context, threads, providers)
        # the model file's pages loading mapped (edge.pages): given back now, and after every request
        release_pages(self.model_dir)
        self.last_stats: Stats | None = None  # the counters of the latest request, once one has run
        self.lookup = LookupDrafter()
        # fed by every speculative target call (not plain decoding); persists across turns. Trees only where the graph
        # verifies them exactly.
        self.recycling = RecyclingDrafter(m.arch["vocab"], chains_only=not self.target.tree_exact)
        self._drafter_sess = None  # a model drafter's session, while requests use it
        self._drafter_graph = None  # which drafter graph it runs
        self._id_map = None
        self._lock = threading.Lock()
        self._cancel: threading.Event | None = None  # the running request's (`cancel`)
        self._closed = False
        self.head_hits = self.head_misses = 0  # sampled rows whose p came from the on-graph head / from the logits
        # memory planning: with a device profile or budget, the plan picks drafter and K and is re-made for every
        # request at the context it can reach; without, the drafter runs unconstrained
        self.profile, self.budget_mb, self.plan = profile, budget_mb, None
        self.policy = DraftLength(lambda: self.manifest, lambda: self.target.cache.length, self.target.min_call,
                                  lambda: getattr(self.profile, "calibration", None),
                                  lambda: self._drafter_graph)
        self.default_drafter = self._resolve(drafter)
        self._configured = drafter  # with a plan: the drafter it may choose ("auto": any), or plain decoding
        self._own = self.default_drafter  # what this engine runs unplanned (auto resolved)
        if profile is not None or budget_mb is not None:
            try:
                self.plan = self._replan(self.context // 2)
            except BudgetError as e:  # say which context the numbers are for: --plan defaults to the full one
                raise as_engine_error(e, f"{e} (planned at load for half the {self.context}-token context, "
                                         "re-planned as a chat grows; `edge-chat --plan --context "
                                         f"{self.context}` shows the need at the full context)") from None

    @property
    def has_chat_template(self) -> bool:
        """False for a base model: a prompt is text it continues, and a list of messages is refused."""
        return self.manifest.chat_template is not None

    @property
    def cached(self) -> list[int]:
        """The token ids in the target's KV cache (owned by the cache)."""
        self._check_open()
        return self.target.cache.tokens

    # ------------------------------------------------------------------ the memory plan
    def _replan(self, context: int, sampling: bool = False):
        """The best memory plan at `context` tokens, from the acceptance measured so far: the drafter this engine
        runs and its draft tokens per call (BudgetError, PlanError: EngineErrors)."""
        from .planning import make_plan, profile_for

        if self.profile is None:
            self.profile = profile_for(None)
        stats = dict(self.policy.acceptance)
        if "model" in stats and self._drafter_graph is not None:  # measured on that graph, not on every one
            stats[self._drafter_graph] = stats.pop("model")
        pl = make_plan(self.manifest, self.profile, max(1, context), self.budget_mb, stats=stats,
                       min_call=self.target.min_call, capacity=self.context, tree_exact=self.target.tree_exact,
                       drafter=self._configured, sampling=sampling)
        self.default_drafter = pl.drafter
        return pl

    def _plan_request(self, prompt: int, p: GenerationParams) -> int:
        """Re-plan for a request (the context grows with every turn) → the context it plans for."""
        end = prompt + p.max_tokens
        if self.plan is None:
            return end
        end = min(fullest(self.context, plain_call_rows(self.profile, self.target.min_call)), end)
        try:
            self.plan = self._replan(end, sampling=p.temperature > 0)
        except BudgetError as e:  # when the answer's room is what does not fit, say which setting to lower
            if e.fits is None or e.fits <= prompt:
                raise
            raise as_engine_error(e, f"{e} — this request plans for its {prompt}-token prompt plus max_tokens "
                                     f"{p.max_tokens}: max_tokens up to {e.fits - prompt} fits (edge-chat "
                                     "--max-tokens)") from None
        return end

    def _planned_drafter(self, asked: str | None, context: int, sampling: bool,
                         draft_len: int | None = None) -> tuple[str, int | None]:
        """(drafter, draft tokens per call the budget allows; None: no plan) of a request.

        Without a plan: the drafter asked for, else the engine's. With one, a request that leaves the choice to
        the engine ("auto", or the drafter it was loaded with) runs the plan's drafter at its nodes; when the plan
        predicts plain decoding to be fastest, the engine's own drafter still runs with what fits, because its
        adaptive length drafts nothing unless its acceptance says so, and its probes keep that acceptance measured
        (a plan made from a poor turn would otherwise never draft again). A drafter asked by name runs with what
        fits (up to the request's `draft_len`); a model drafter that does not fit at all is refused before its
        session opens. A model session the request does not use is dropped (its memory is budgeted only while
        used)."""
        if self.plan is None:
            return self._resolve(asked or self.default_drafter), None
        following = asked in (None, "auto", self._configured)
        if not following:
            kind = self._resolve(asked)
        else:
            kind = self.plan.drafter if self.plan.drafter != "none" else self._own
        if kind == "none" or (following and kind == self.plan.drafter):
            n = self.plan.nodes
        else:
            from .planning import fitting_nodes

            graph = self._model_graph().name if kind == "model" else None
            n = fitting_nodes(self.manifest, self.profile, context, self.plan.budget_mb, kind, draft_graph=graph,
                              min_call=self.target.min_call, capacity=self.context, sampling=sampling,
                              max_k=max(MAX_CHAIN, draft_len or 0))
            if kind == "model" and n == 0 and not following:
                self._drafter_sess = None  # open from an earlier request: no longer within the budget
                raise EngineError(f"drafter 'model' does not fit the {self.plan.budget_mb:g} MB memory budget at "
                                  f"context {context} (its session and KV cache); leave the drafter unset to follow "
                                  f"the plan ({self.plan.drafter})")
            if n == 0:
                kind = "none"
        if kind != "model":  # the drafter session's memory is budgeted only while a request uses it
            self._drafter_sess = None
        return kind, n

    # ------------------------------------------------------------------ drafters
    def _resolve(self, kind: str) -> str:
        if kind == "model":
            require_drafter_graph(self.model_dir, self.manifest)
        if kind != "auto" and DRAFTER_KINDS[kind].needs_topk and not self.target.topk:
            raise ModelDirError(f"{self.model_dir}: drafter {kind!r} needs the target's on-graph top-k output; "
                                "re-export with this edgespec, or use the lookup drafter (drafter='lookup', "
                                "--drafter lookup)")
        if kind != "auto":
            return kind
        if not self.target.chains_exact:  # drafts would be verified by calls whose width changes the logits
            return "none"
        if self.manifest.drafters and self._model_earns_its_cost():
            return "model"
        return "hybrid" if self.target.topk else "lookup"

    def _model_earns_its_cost(self) -> bool:
        """`edge.planning.model_earns_its_cost`, priced by this engine's own verify curve."""
        from .planning import model_earns_its_cost

        return model_earns_its_cost(self.manifest, self.policy.verify_ms)

    def _model_graph(self):
        """The drafter graph a model drafter runs: the memory plan's when it plans one (its budget is for that
        graph), else the best one."""
        want = self.plan.draft_graph if self.plan is not None and self.plan.drafter == "model" else None
        return drafter_graph(self.manifest, want)

    def _model_drafter(self, p: GenerationParams, rng) -> ModelDrafter:
        g = self._model_graph()
        if self._drafter_sess is None or self._drafter_graph != g.name:
            switched = self._drafter_graph not in (None, g.name)  # not a reload of the same graph
            self._drafter_sess = None  # one drafter session at a time; nothing below is kept unless all of it loads
            id_map = np.load(self.model_dir / g.id_map) if g.id_map else np.arange(g.vocab)
            if id_map.max() >= self.manifest.arch["vocab"] or id_map.min() < 0:
                raise ModelDirError(f"{self.model_dir / g.id_map}: ids outside the target vocabulary; re-export")
            sess = GraphSession(str(self.model_dir / g.file), self.manifest, g, self.context, self.threads,
                                self.providers)
            self._drafter_sess, self._drafter_graph, self._id_map = sess, g.name, id_map
            if switched:  # another graph: its own acceptance (from its measured agreement) and cost per token
                self.policy.model_switched()
        # with a seed it drafts its argmax (a point mass, verified as lookup's drafts are): each emitted token is then
        # one draw from p, so the answer equals plain sampling's with that seed whatever the drafter learned so far
        # (sampled drafts draw per draft token, and how many it drafts depends on the acceptance it has measured)
        return ModelDrafter(self._drafter_sess, self._id_map, self.manifest.arch["vocab"], threshold=0.0,
                            temperature=p.temperature if p.seed is None else 0.0, top_k=p.top_k, top_p=p.top_p,
                            rng=rng, input_vocab=self.manifest.arch_of(g)["vocab"],
                            prefill_chunk=self._prefill_chunk())

    def _drafter(self, kind: str, p: GenerationParams, rng) -> tuple[Drafter, int]:
        """The drafter of `kind` for this request and its draft tokens per call (the request's, else its default)."""
        if kind == "model":
            drafter = self._model_drafter(p, rng)
        elif kind == "hybrid":
            drafter = HybridDrafter(self.lookup, self.recycling)
        else:
            drafter = {"none": NoDrafter(), "lookup": self.lookup, "recycling": self.recycling}[kind]
        if kind == "none":
            return drafter, 0
        return drafter, p.draft_len if p.draft_len is not None else DRAFTER_KINDS[kind].default_len

    # ------------------------------------------------------------------ encoding
    def encode(self, prompt_or_messages, *, raw: bool = False, special_tokens_in_content: bool = False) -> list[int]:
        """The prompt's token ids. Message text is encoded as text (a control token's string in it stays text);
        `special_tokens_in_content=True` lets it become control tokens (see TextCodec.encode_chat). A plain string
        is one user message, or for a base model (no chat template) the text it continues; with `raw=True` it is
        encoded as it is (the tokenizer's own BOS rule applies), whatever the model. A base model refuses messages."""
        if isinstance(prompt_or_messages, str):
            if raw:
                return self.codec.encode_prompt(prompt_or_messages)
            if not prompt_or_messages.strip():  # the REPL skips blank lines; the API says why instead of answering
                raise EngineError("empty prompt: nothing to answer")
            if not self.has_chat_template:
                return self.codec.encode_prompt(prompt_or_messages)
            msgs = [{"role": "user", "content": prompt_or_messages}]
        elif isinstance(prompt_or_messages, (list, tuple)):
            if not self.has_chat_template:  # no made-up chat format: the caller decides what text to continue
                raise EngineError(f"{base_model(self.manifest.name)}; give it the text to continue as a string")
            msgs = normalize_messages(prompt_or_messages)
            if not msgs:
                raise EngineError("no messages: give a prompt string or a non-empty list of {'role', 'content'} dicts")
        else:
            raise EngineError(f"prompt must be a string or a list of messages (got {type(prompt_or_messages).__name__})")
        # a ChatTemplateError (an EngineError) when the template refuses them, fails or runs past its budget
        return self.codec.encode_chat(msgs, special_tokens_in_content=special_tokens_in_content)

    # ------------------------------------------------------------------ the loop's phases
    def _prefill(self, ids: list[int], st: Stats, stop=None) -> np.ndarray | None:
        """Re-use the longest cached prefix, prefill the rest in chunks; → logits [V] after the last prompt token,
        or None when `stop()` ended it between chunks."""
        n = self.target.cache.common_prefix(ids, len(ids) - 1)
        self._rewind_to(n)
        st.reused_tokens = n
        logits = self.target.prefill(ids[n:], self._prefill_chunk(), stop)
        return None if logits is None else logits.copy()

    def _commit(self, tokens: list[int], path: list[int] | None) -> None:
        """Commit the verified tokens (root + accepted drafts) to the target cache."""
        if path is None:
            self.target.cache.append(len(tokens), tokens)
        else:
            self.target.cache.keep(path, tokens)

    def _prefill_chunk(self) -> int:
        """Rows per prefill call, the target's and a model drafter's: a device profile's (what its memory plan
        counts), else the footprint model's default."""
        return getattr(self.profile, "prefill_chunk", None) or PREFILL_CHUNK

    def _rewind_to(self, length: int) -> None:
        """Roll the target cache back to `length` tokens (or keep it, if shorter)."""
        cache = self.target.cache
        cache.trim(cache.length - min(length, cache.length))

    def _head_request(self, p: GenerationParams) -> tuple[int | None, bool]:
        """(k the on-graph head should return probabilities for, or None; whether the call must return logits)."""
        if not self.target.head:  # sampling needs the logits (a graph without any TopK returns them anyway)
            return None, p.temperature > 0
        if p.temperature == 0:
            return None, False
        vocab = self.target.vocab
        top_k = p.top_k if p.top_k < vocab else 0  # a cut at the whole vocabulary cuts nothing (process_logits)
        if 0 < top_k <= HEAD_TOPK_MAX:
            return top_k, False  # the kept set is inside the head's k: exact without the logits
        if top_k == 0 and vocab <= HEAD_TOPK_MAX:
            return vocab, False  # a small vocabulary: the head returns all of it
        if top_k == 0 and p.top_p < 1:
            return HEAD_TOPK_NUCLEUS, True  # the nucleus usually closes inside; the logits are there if it does not
        return None, True  # every token can be drawn: the full distribution

    def _target_probs(self, out: Output, p: GenerationParams) -> np.ndarray:
        """p [R, V] of a verify call: each row from the on-graph head when its top k hold the row's kept set, else
        from its logits (`kernels.sampling.process_logits`; the head's rows equal its to float rounding, bar a top-p
        cut that lands within rounding of a cumulative mass)."""
        if out.top_probs is None:
            self.head_misses += len(out.logits)
            return process_logits(out.logits, p.temperature, p.top_k, p.top_p)
        P, exact = probs_from_top(out.top_ids, out.top_probs, self.target.vocab, p.top_k, p.top_p)
        self.head_hits += int(exact.sum())
        if not exact.all():  # rows whose nucleus reaches past the head's k: from their logits
            if out.logits is None:  # a cut inside the head's k declines only rows that are not finite
                rows = np.flatnonzero(~exact).tolist()
                raise CorruptOutput(f"the model's probabilities in rows {rows} are not finite; "
                                    "the model output is corrupt")
            self.head_misses += int((~exact).sum())
            P[~exact] = process_logits(out.logits[~exact], p.temperature, p.top_k, p.top_p)
        return P

    def _verify(self, root: int, d: Draft, p: GenerationParams, rng, before: int | None = None, learn: bool = True,
                head: tuple[int | None, bool] | None = None) -> tuple[list[int], list[int] | None, int]:
        """One target call over [root] + draft → (committed tokens, tree path or None, next token); `before` is the
        committed token before the root (for Token Recycling's two-token successors); `learn`: feed the call's
        candidates to Token Recycling (not in plain decoding, which keeps its steps free of drafting work); `head`:
        `_head_request(p)`, which a request computes once."""
        # the call's ids as a Python list: this runs right after the last call, when each numpy op costs tens of µs
        tokens = ([int(root)] + d.ids) if len(d) else [int(root)]
        L = self.target.cache.length
        greedy = p.temperature == 0
        head_k, need_logits = self._head_request(p) if head is None else head
        sample = None if head_k is None else (p.temperature, head_k)
        if d.is_chain:
            # [K+1, V] logits, or None when the on-graph head returns all this step needs (greedy, or a sampling cut
            # that lies inside its top k)
            out = self.target.call(tokens, logits=need_logits, sample=sample)
            layout = None
        else:
            layout = TreeLayout.from_parents(np.concatenate([[-1], d.parents]))
            out = self.target.call(tokens, layout.position_ids(L), layout.attention_bias(L), logits=need_logits,
                                   sample=sample)
        if out.top_ids is not None and learn:
            self.recycling.observe(tokens, out.top_ids, None if layout is None else layout.parents, before)
        argmax = None
        if greedy:
            if out.logits is None:  # the session's lists where it has them: no numpy right after the call
                argmax = out.top_ids[:, 0].tolist() if out.best is None else out.best
                if out.top_logits is not None:
                    check_chosen(out.top_logits[:, 0] if out.best_logits is None else out.best_logits)
            else:
                argmax = out.logits.argmax(-1)
                check_chosen(out.logits[np.arange(len(argmax)), argmax])
        if layout is None:
            if greedy:
                n, nxt = verify_greedy(tokens[1:], argmax)
            else:
                n, nxt = verify_sampling(d.tokens, self._target_probs(out, p), d.q, rng)
            return tokens[: n + 1], None, int(nxt)
        parents = layout.parents
        if greedy:
            path, nxt = verify_greedy_tree(tokens, parents, argmax)
        else:
            P = self._target_probs(out, p)
            q = None if d.q is None else np.concatenate([d.q, np.zeros((1, d.q.shape[1]))])
            path, nxt = verify_sampling_tree(tokens, parents, P, q, rng)
        return [tokens[i] for i in path], list(path), int(nxt)

    def _check_request(self, ids: list[int], p: GenerationParams) -> None:
        if not ids:
            raise BadMessage("empty prompt: nothing to continue from", "prompt")
        room = self.context - len(ids)
        if room < 1:
            more = self.manifest.target.max_len
            raise EngineError(f"prompt is {len(ids)} tokens but the context holds {self.context}; shorten it"
                              + (f" (or load with a larger context, up to {more}: edge.load(context=N), edge-chat "
                                 "--context N)" if more > self.context else ""))
        p.check(room)

    # ------------------------------------------------------------------ the loop
    def _run(self, ids: list[int], p: GenerationParams, cancel: threading.Event) -> Iterator[Chunk]:
        """prefill → (emit → draft → verify → commit → drafter update)* → rollback in `finally`. `ids` and `p` were
        checked by `stream`; `cancel`, once set, ends the answer at the next step or prefill chunk."""
        st = Stats(prompt_tokens=len(ids))
        rng = np.random.default_rng(p.seed)
        end = self._plan_request(len(ids), p)
        # also refuses a drafter this export cannot run, with the fix named
        kind, cap = self._planned_drafter(p.drafter, end, p.temperature > 0, p.draft_len)
        drafter, k = self._drafter(kind, p, rng)
        if cap is not None:
            k = min(k, cap)  # the memory budget caps draft tokens per call
        # tree drafters fill their node budget where the target verifies trees exactly; chains get an adaptive length
        tree, fixed = DRAFTER_KINDS[kind].trees and self.target.tree_exact, p.draft_len is not None
        free = self.policy.is_free(kind, fixed, tree)
        st.drafter = kind
        answer = AnswerText(self.codec, self.eos, p.max_tokens, p.stop)
        self.last_stats = st  # a refused request leaves the previous one's
        t0 = t1 = time.perf_counter()
        ort1 = self._ort_run_s()
        try:
            logits = self._prefill(ids, st, cancel.is_set)
            if logits is None:  # cancelled between prefill chunks
                st.prefill_s = time.perf_counter() - t0
                yield answer.end(CANCELLED)
                return
            first = make_sampler(p.temperature, p.top_k, p.top_p)(logits, rng)  # greedy: argmax, checked
            st.prefill_s = time.perf_counter() - t0
            t1, ort1 = time.perf_counter(), self._ort_run_s()
            drafter.begin(ids + [first])  # a model drafter prefills its own cache here: drafter time
            st.draft_s += time.perf_counter() - t1
            new, drafted, root = [first], 0, first
            head, learn = self._head_request(p), kind != "none"
            while True:
                # ---- emit what the last step produced (EOS, limits, stop strings)
                chunk = answer.push(new, drafted, full=self.target.cache.room() < 2)
                st.accepted -= drafted - chunk.drafted  # accepted past an EOS or a stop: never emitted, not counted
                st.generated = len(answer.ids)
                if chunk.finish_reason is not None:
                    st.decode_s, st.ort_s = time.perf_counter() - t1, self._ort_run_s() - ort1
                    yield chunk
                    return
                yield chunk
                if cancel.is_set():
                    st.decode_s, st.ort_s = time.perf_counter() - t1, self._ort_run_s() - ort1
                    yield answer.end(CANCELLED)
                    return

                # ---- one speculative step: draft, verify in one target call, commit, update the drafter
                self.policy.at_context()
                room = min(p.max_tokens - len(answer.ids) - 1, self.target.cache.room() - 2)
                ts = time.perf_counter()
                d = self.policy.draft(drafter, kind, k, room, fixed=fixed, tree=tree)
                dt = time.perf_counter() - ts
                st.draft_s += dt
                if kind == "model":
                    self.policy.timed_draft(len(d), dt)
                before = answer.ids[-2] if len(answer.ids) >= 2 else ids[-1]
                ts = time.perf_counter()
                committed, path, nxt = self._verify(root, d, p, rng, before, learn=learn, head=head)
                dt = time.perf_counter() - ts
                st.target_s += dt
                self.policy.timed_call(max(len(d) + 1, self.target.min_call), dt)
                drafted = len(committed) - 1
                new = committed[1:] + [nxt]
                self.policy.learn(kind, d, drafted, new, free=free, tree=tree)
                self._commit(committed, path)
                st.steps += 1
                st.drafted += len(d)
                st.accepted += drafted
                drafter.accept(new)
                root = nxt
        except CorruptOutput as e:  # non-finite logits or probabilities: an EngineError, converted here once
            raise ModelOutputError(str(e)) from e
        finally:
            if not st.decode_s:
                st.decode_s, st.ort_s = time.perf_counter() - t1, self._ort_run_s() - ort1
            # the cache keeps the prompt and the answer but its last token (the next step's root); an interrupted
            # prefill keeps its part
            self._rewind_to(len(ids) + len(answer.ids) - 1 if answer.ids else len(ids))
            release_pages(self.model_dir)  # what this request mapped of the model file

    def _ort_run_s(self) -> float:
        """Seconds spent inside ONNX Runtime so far by the target and the drafter session."""
        return self.target.run_s + (self._drafter_sess.run_s if self._drafter_sess is not None else 0.0)

    # ------------------------------------------------------------------ public API
    def stream(self, prompt_or_messages, *, raw: bool = False, special_tokens_in_content: bool = False,
               cancel: threading.Event | None = None, **params) -> Iterator[Chunk]:
        """Answer a prompt (a string, or OpenAI-style messages rendered with the chat template), yielding `Chunk`s
        (text, token ids, how many were accepted drafts, finish_reason on the last) as they are verified.

        `params` are `GenerationParams`: max_tokens (default 512), temperature (0: greedy), top_p, top_k, seed,
        stop (a string or a list), drafter (one of "auto", "hybrid", "recycling", "model", "lookup", "none"),
        draft_len. Greedy answers equal plain decoding's token for token; sampled ones follow the same
        distribution. Closing the stream early (or Ctrl-C) rolls the KV cache back to what was emitted. `cancel()`
        from another thread, or setting the `cancel` Event given here (at any time, even before the first chunk),
        ends it at its next step or prefill chunk with finish_reason "cancelled". After the last chunk,
        `last_stats` holds the request's `Stats`. `raw=True` encodes a string as it is, without the chat template.
        Every refusal is an EngineError: bad arguments and a prompt beyond the context when the stream is made;
        another request running (`EngineBusy`), a drafter this export lacks or a memory budget the request cannot
        fit at its first chunk."""
        self._check_open()
        p = GenerationParams(**_normalize(params))
        ids = self.encode(prompt_or_messages, raw=raw, special_tokens_in_content=special_tokens_in_content)
        self._check_request(ids, p)
        return self._locked_run(ids, p, cancel)

    def _locked_run(self, ids: list[int], p: GenerationParams, cancel: threading.Event | None) -> Iterator[Chunk]:
        with _holding(self._lock, f"this engine is already generating ({BUSY_HINT}); serialize calls or load a "
                      "second engine"):
            self._check_open()
            self._cancel = cancel if cancel is not None else threading.Event()
            try:
                yield from self._run(ids, p, self._cancel)
            finally:
                self._cancel = None

    def cancel(self) -> bool:
        """Stop the running request, from any thread (a Stop button): it ends at its next step, or between prefill
        chunks, with a last chunk whose finish_reason is "cancelled"; what was emitted stays in the KV cache, as
        when a stream is closed. True if a request was running."""
        ev = self._cancel
        if ev is None:
            return False
        ev.set()
        return True

    def close(self) -> None:
        """Release the ONNX Runtime sessions and the KV cache now, rather than when the engine is collected (a
        chat or a stream holds it alive). Later requests raise EngineError; closing twice is fine. `with
        edge.load(...) as engine:` closes on leaving the block."""
        with _holding(self._lock, f"cannot close while this engine is generating ({BUSY_HINT}; or cancel() it)"):
            if self._closed:
                return
            self._closed = True
            self.target = self._drafter_sess = None
            self.recycling = self.lookup = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.cancel()
        try:
            self.close()
        except EngineBusy:  # a stream of the block still open: its error, if one is on its way, is the one to see
            if exc_type is None:
                raise

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("this engine was closed; load the model again (edge.load)")

    def generate(self, prompt_or_messages, *, raw: bool = False, special_tokens_in_content: bool = False,
                 cancel: threading.Event | None = None, **params) -> GenerationResult:
        """The whole answer of `stream` (same arguments) as a `GenerationResult`: text, token ids, finish_reason
        ("stop": EOS or a stop string; "length": max_tokens or the context; "cancelled": `cancel()`), and the
        request's `Stats`."""
        return collect(self.stream(prompt_or_messages, raw=raw, special_tokens_in_content=special_tokens_in_content,
                                   cancel=cancel, **params), self)

    def chat(self, system: str | None = None, overflow: str = "refuse") -> "Chat":
        """A multi-turn conversation on this engine (`Chat`)."""
        self._check_open()
        return Chat(self, system, overflow)

    def drafter_state(self):
        """A copy of what drafting has learned from earlier answers (Token Recycling's tables, acceptance
        statistics): `set_drafter_state` puts it back, e.g. so a benchmark's repeats never draft from their own
        earlier answers."""
        self._check_open()
        return copy.deepcopy((self.recycling, *self.policy.state()))

    # both change state a running generation uses (a reset under a live stream used to empty the KV cache beneath
    # it: the rest of that answer came from an empty context, silently), so both hold the engine
    def set_drafter_state(self, state) -> None:
        with _holding(self._lock, f"cannot set the drafter state while this engine is generating ({BUSY_HINT})"):
            self._check_open()
            self.recycling, *learned = copy.deepcopy(state)
            self.policy.set_state(tuple(learned))

    def reset(self, keep_drafter_state: bool = False) -> None:
        """Forget the KV cache; Token Recycling's matrix and the lookup history survive only if asked."""
        with _holding(self._lock, f"cannot reset while this engine is generating ({BUSY_HINT})"):
            self._check_open()
            self._rewind_to(0)
            if not keep_drafter_state:
                self.recycling = RecyclingDrafter(self.manifest.arch["vocab"], chains_only=not self.target.tree_exact)
                self.lookup = LookupDrafter()
            if self.plan is not None:  # an empty context: planned as at load
                self.plan = self._replan(self.context // 2)


def _open_codec(model_dir: Path, m) -> TextCodec:
    """The export's tokenizer and chat template, refused with the fix named when missing or not this model's."""
    tok = model_dir / m.tokenizer
    if not tok.is_file():
        raise ModelDirError(f"{tok}: tokenizer missing; re-run edge-export: "
                            f"{reexport_command(model_dir, m.source.get('path'))}")
    try:
        codec = TextCodec(tok, m.chat_template, m.special_tokens.get("bos"), tuple(m.special_tokens.get("eos") or ()))
    except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
        why = str(e).partition("\n")[0][:200]
        raise ModelDirError(f"{tok}: tokenizer unreadable ({why}); re-run edge-export: "
                            f"{reexport_command(model_dir, m.source.get('path'))}") from e
    if codec.vocab_size > m.arch["vocab"]:
        raise ModelDirError(f"{tok}: tokenizer has {codec.vocab_size} tokens but the model {m.arch['vocab']}; "
                            "the tokenizer belongs to another model — re-export")
    return codec


def _normalize(kw: dict) -> dict:
    if "stop" in kw and kw["stop"] is not None:
        s = kw["stop"]
        if not isinstance(s, (str, list, tuple)):
            raise EngineError(f"stop must be a string or a list of strings (got {s!r})")
        kw["stop"] = (s,) if isinstance(s, str) else tuple(s)
    elif "stop" in kw:
        kw["stop"] = ()
    for name in ("temperature", "top_p"):  # any real number (Fraction, numpy's) as the float the kernels take
        v = kw.get(name)
        if isinstance(v, numbers.Real) and not isinstance(v, (bool, float)):
            kw[name] = float(v)
    known = set(GenerationParams.__dataclass_fields__)
    bad = [k for k in kw if k not in known]
    if bad:
        raise EngineError(f"unknown generation option(s) {bad}; known: {sorted(known)}")
    return kw


OVERFLOW = ("refuse", "drop_oldest")


class Chat:
    """Multi-turn conversation on one engine: the template is re-rendered each turn and only the new tokens are
    prefilled (the engine keeps the longest common prefix). An interrupted answer stays in the history as far as it
    was streamed, so the next turn sees exactly what the user saw.

    History overflow (`overflow`): "refuse" (default) refuses a turn whose prompt does not fit the context, with the
    numbers, and keeps the history as it was; "drop_oldest" drops the oldest turns (never the system message or
    the new question) until prompt + max_tokens fits, or at least the prompt does; `dropped` counts the messages
    dropped. One answer at a time: a second thread gets EngineBusy and the history is untouched.

    On a base model (no chat template) the conversation is one running text (`prompt`), which the model continues:
    each message is added to the text so far, on a line of its own, and each continuation becomes part of the text.
    It has no system message."""

    def __init__(self, engine: Engine, system: str | None = None, overflow: str = "refuse"):
        if overflow not in OVERFLOW:
            raise EngineError(f"overflow {overflow!r}: choose one of {', '.join(OVERFLOW)}")
        if system and not engine.has_chat_template:
            raise EngineError(f"{base_model(engine.manifest.name)}, and has no system prompt: start the first "
                              "message with that text instead")
        self.engine = engine
        self.system = system
        self.overflow = overflow
        self.dropped = 0
        self._lock = threading.Lock()
        self.messages = [{"role": "system", "content": system}] if system else []

    @property
    def prompt(self) -> list[dict] | str:
        """What the engine continues: the messages (through the chat template), or for a base model the running
        text, each message on a new line after the text before it."""
        if self.engine.has_chat_template:
            return self.messages
        text = ""
        for m in self.messages:
            text += ("\n" if m["role"] == "user" and text and not text.endswith("\n") else "") + m["content"]
        return text

    def _fit(self, max_tokens: int, special_tokens_in_content: bool = False) -> None:
        """Drop the oldest turns (after the system message) until prompt + min(max_tokens, context / 2) fits;
        a turn is a user message and the answer after it."""
        e, first = self.engine, 1 if self.system else 0
        reserve = min(max_tokens, e.context // 2)
        while len(self.messages) - first > 1 and len(e.encode(
                self.prompt, special_tokens_in_content=special_tokens_in_content)) + reserve > e.context:
            del self.messages[first]
            self.dropped += 1
            while len(self.messages) - first > 1 and self.messages[first]["role"] != "user":
                del self.messages[first]
                self.dropped += 1

    def reset(self, keep_drafter_state: bool = False) -> None:
        with _holding(self._lock, f"cannot reset this chat while it is answering ({BUSY_HINT})"):
            self.engine.reset(keep_drafter_state)
            self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, text: str, *, special_tokens_in_content: bool = False, **kw) -> Iterator[Chunk]:
        """Send `text` as the next user message and stream the answer (`Engine.stream`'s parameters). The answer
        joins the history with what was shown, even when the stream is closed or cancelled early; a turn refused or
        cancelled before anything was shown leaves the history as it was (`ContextFull` when it does not fit)."""
        if not isinstance(text, str):
            raise EngineError(f"a chat message is a string (got {type(text).__name__})")
        if not text.strip():
            raise EngineError("empty message: nothing to answer")
        with _holding(self._lock, f"this chat is already answering ({BUSY_HINT.replace('stream()', 'send()')}); "
                      "one turn at a time"):
            kept, dropped = list(self.messages), self.dropped
            self.messages.append({"role": "user", "content": text})
            answer, started = [], False
            try:
                if self.overflow == "drop_oldest":
                    params = GenerationParams(**_normalize(dict(kw)))
                    params.check(self.engine.context)  # a bad max_tokens is refused as such, not mid-arithmetic
                    self._fit(params.max_tokens, special_tokens_in_content)
                n = len(self.engine.encode(self.prompt, special_tokens_in_content=special_tokens_in_content))
                ctx = self.engine.context
                if n >= ctx:
                    alone = len(self.messages) == 1 + bool(self.system)  # no earlier turn left to drop
                    raise ContextFull(
                        f"chat history is {n} tokens but the context holds {ctx}: "
                        + ("even the system message and this question alone do not fit; shorten them"
                           if alone or self.overflow == "drop_oldest" else
                           "start a new chat (reset), or use Chat(overflow='drop_oldest') to drop the oldest turns"),
                        n, ctx, alone)
                for ch in self.engine.stream(self.prompt, special_tokens_in_content=special_tokens_in_content, **kw):
                    answer.append(ch.text)
                    started = started or bool(ch.token_ids) or bool(ch.text)
                    if ch.finish_reason == CANCELLED and not started:  # stopped before anything was shown
                        self.messages[:], self.dropped = kept, dropped
                    yield ch
            except Exception:  # (an interrupt keeps the turn with what was shown, even nothing)
                if not started:  # refused (or failed) before anything was shown: the history stays as it was
                    self.messages[:], self.dropped = kept, dropped
                raise
            finally:
                if self.messages and self.messages[-1]["role"] == "user":
                    self.messages.append({"role": "assistant", "content": "".join(answer)})

    def ask(self, text: str, **kw) -> GenerationResult:
        """Send `text` as the next user message and return the whole answer (`send`'s arguments)."""
        return collect(self.send(text, **kw), self.engine)
