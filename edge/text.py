"""Tokenizer, chat template and UTF-8-safe incremental detokenization (runtime side: `tokenizers` + jinja2 only;
a SentencePiece-style vocabulary with the exporter's compact tables beside it is read by `edge.bpe` instead).

Chat prompts are rendered as transformers' `apply_chat_template` renders them (a sandboxed jinja2 environment with
loop controls, `{% generation %}`, `strftime_now`, `raise_exception` and a `tojson` that does not HTML-escape), but
under a budget of time and output size: a chat template comes with the model, from wherever the model came from.
Message text is encoded as text: a control token's string inside a message (`<|im_end|>` in a pasted web page or
a tool's output) becomes ordinary tokens, so content cannot close its turn or open a system or assistant turn."""
from __future__ import annotations

import codecs
import functools
import json
import os
import re
import secrets
import threading
import time
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer, pre_tokenizers

from .bpe import CompactBpe, load_beside
from .errors import EngineError

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

RENDER_SECONDS = 2.0  # wall-clock budget of one chat-template render (real templates take well under 10 ms)
RENDER_CHARS = 1 << 20  # output budget: this many characters plus 4 per character of the messages' own text


class ChatTemplateError(EngineError, ValueError):
    """The model's chat template cannot render these messages: a rule of the template (roles must alternate, no
    system message), a syntax error, an error inside it, or a render past its time or size budget."""


def valid_text(s: str) -> str:
    """`s` with each lone UTF-16 surrogate (JSON "\\ud800", a bad clipboard) as U+FFFD, as a UTF-8 decoder reads
    it: such a string is not text, and cannot be encoded."""
    return _LONE_SURROGATE.sub("\ufffd", s)


class TextCodec:
    def __init__(self, tokenizer_json: str | Path, chat_template: str | None, bos: int | None, eos: tuple[int, ...]):
        self._path = str(tokenizer_json)
        self._stat = _file_identity(self._path)
        # Gemma 3's vocabulary: ~12 MB as the exporter's compact tables, ~93 MB in the tokenizers library
        self.tok = load_beside(self._path) or Tokenizer.from_file(self._path)
        self.vocab_size = self.tok.get_vocab_size()
        self.bos, self.eos = bos, tuple(eos)
        self._template_src = chat_template
        self._template = None
        self._byte_level: bool | None = None
        self._bytes: dict[int, bytes] = {}
        # control tokens: the added tokens marked special (the set transformers' split_special_tokens splits)
        self._control = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)
        self._plain: dict[bool, Tokenizer] = {}
        self.prefix = self._special_prefix()

    def encode(self, text: str) -> list[int]:
        """Text as token ids, nothing added (a chat template places its own BOS)."""
        return self.tok.encode(valid_text(text), add_special_tokens=False).ids

    def _special_prefix(self) -> list[int]:
        """The ids the tokenizer's own rule puts before a text (its post-processor: BOS for Llama 2 and Gemma,
        nothing for SmolLM2 or Qwen), as transformers' `tokenizer(text)` adds them."""
        plain = self.tok.encode("a", add_special_tokens=False).ids
        full = self.tok.encode("a", add_special_tokens=True).ids
        n = len(plain)
        return next((full[:i] for i in range(len(full) - n + 1) if full[i : i + n] == plain), [])

    def with_prefix(self, ids: list[int]) -> list[int]:
        """`ids` after the tokenizer's prefix (`prefix`), unless they already start with it (typed by hand)."""
        n = len(self.prefix)
        return ids if not n or ids[:n] == self.prefix else self.prefix + ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt given as text, no chat template: encoded as the tokenizer's own rule says (BOS where it adds
        one), as transformers' `tokenizer(text)` and llama.cpp do."""
        return self.with_prefix(self.encode(text))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    @property
    def byte_level(self) -> bool:
        """Does decoding concatenate each token's bytes and read them as UTF-8 (byte-level BPE, GPT-2 style: SmolLM2,
        Llama 3, Qwen)? Then text can be decoded incrementally, token by token (`token_bytes`). True for a ByteLevel
        decoder, alone or after ByteFallback / Fuse / Replace steps that cannot fire on this vocabulary: every
        token's characters are in the byte table (so the Fuse'd string maps byte for byte), no Replace pattern can
        occur in it, and no token is a <0x..> byte-fallback piece. Checked once (~30 ms for 49k tokens)."""
        if self._byte_level is None:
            self._byte_level = not isinstance(self.tok, CompactBpe) and _decodes_bytewise(self.tok)
        return self._byte_level

    def token_bytes(self, i: int) -> bytes:
        """Token i's bytes, for a `byte_level` tokenizer (every character of every token has one): `decode(ids)` is
        their concatenation read as UTF-8, with U+FFFD for invalid bytes."""
        b = self._bytes.get(i)
        if b is None:
            b = self._bytes[i] = bytes(_UNICODE_TO_BYTE[c] for c in self.tok.id_to_token(i) or "")
        return b

    def token_text(self, i: int) -> str:
        return self.tok.id_to_token(i) or ""

    # ------------------------------------------------------------------ chat prompts
    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, as transformers' apply_chat_template(tokenize=False) renders it. Raises
        ChatTemplateError when the template refuses them, fails, or runs past RENDER_SECONDS or its size budget."""
        if self._template_src is None:
            # no template: plain "role: content" lines, so base models still work
            body = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return body + ("assistant: " if add_generation_prompt else "")
        budget = _Budget(RENDER_SECONDS, RENDER_CHARS + 4 * _text_size(messages))
        _active.budget = budget
        try:
            if self._template is None:  # compiled under the budget too (constant folding runs template code)
                self._template = _environment().from_string(self._template_src)
            out, n = [], 0
            for piece in self._template.generate(
                    messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                    bos_token=self.token_text(self.bos) if self.bos is not None else "",
                    eos_token=self.token_text(self.eos[0]) if self.eos else ""):
                n += len(piece)
                if n > budget.chars:
                    raise _OverBudget(f"rendered more than {budget.chars} characters")
                budget.tick()
                out.append(piece)
            return "".join(out)
        except Exception as e:  # a template is code from the model's files: any error in it is the template's
            raise _template_error(e) from None
        finally:
            _active.budget = None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    special_tokens_in_content: bool = False) -> list[int]:
        """The chat template's token ids for `messages`. Message text (every string in the messages: content,
        names, tool calls) is encoded as text: a control token's string in it becomes ordinary tokens, so only the
        template itself places control tokens. Where no message holds such a string the ids are exactly those of
        the rendered prompt encoded whole (what transformers' apply_chat_template(tokenize=True) gives).
        `special_tokens_in_content=True`: control-token strings in messages become control tokens too (the
        rendered prompt encoded whole, whatever it holds), for callers that write them on purpose."""
        if self._template_src is None:  # the plain "role: content" lines are a prompt as text
            return self.with_prefix(self._encode_chat(messages, add_generation_prompt, special_tokens_in_content))
        return self._encode_chat(messages, add_generation_prompt, special_tokens_in_content)

    def _encode_chat(self, messages, add_generation_prompt, special_tokens_in_content) -> list[int]:
        if special_tokens_in_content or not self._control:
            return self.encode(self.render(messages, add_generation_prompt))
        # each control token found in message text is swapped for a marker that the template passes on as text
        nonce, found = secrets.token_hex(8), []

        def mark(s: str) -> str:
            spans = self._control_spans(s)
            if not spans:
                return s
            out, pos = [], 0
            for a, b in spans:
                out += [s[pos:a], f"\ue000{nonce}.{len(found)}\ue001"]
                found.append(s[a:b])
                pos = b
            return "".join(out + [s[pos:]])

        marked = _map_strings(messages, mark)
        text = self.render(marked, add_generation_prompt)
        if not found:
            return self.encode(text)
        # the original text goes back where the markers landed; those spans must stay text
        parts, protected, pos, n = [], [], 0, 0
        for m in re.finditer(f"\ue000{nonce}\\.(\\d+)\ue001", text):
            parts.append(text[pos:m.start()])
            s = found[int(m.group(1))]
            n += m.start() - pos
            protected.append((n, n + len(s)))
            parts.append(s)
            n, pos = n + len(s), m.end()
        parts.append(text[pos:])
        return self._encode_protected("".join(parts), protected)

    def _control_spans(self, s: str) -> list[tuple[int, int]]:
        """Character spans of the control tokens the tokenizer finds in `s` (with any whitespace they strip)."""
        if not s:
            return []
        enc = self.tok.encode(valid_text(s), add_special_tokens=False)
        return [o for i, o in zip(enc.ids, enc.offsets) if i in self._control]

    def _encode_protected(self, text: str, protected: list[tuple[int, int]], force: bool = False) -> list[int]:
        """`text` encoded with control tokens matched everywhere except inside the `protected` spans. The tokenizer
        cuts text at control tokens before anything else, so each stretch between two of the template's own is
        encoded on its own: a stretch holding protected text is encoded again without control-token matching,
        every other one keeps its ids from the whole-text encoding. `force`: encode every stretch again (tests
        check that this gives the whole-text ids for ordinary text)."""
        text = valid_text(text)
        enc = self.tok.encode(text, add_special_tokens=False)
        ids, offsets = enc.ids, enc.offsets

        def inside(a: int, b: int) -> bool:
            return any(p < b and a < q for p, q in protected)

        out, start, first = [], 0, 0
        for i, (t, (a, b)) in enumerate(zip(ids, offsets)):
            if t in self._control and not inside(a, b):  # one of the template's own: a stretch ends here
                out += self._stretch(text, start, a, ids[first:i], force or inside(start, a))
                out.append(t)
                start, first = b, i + 1
        return out + self._stretch(text, start, len(text), ids[first:], force or inside(start, len(text)))

    def _stretch(self, text: str, a: int, b: int, ids: list[int], again: bool) -> list[int]:
        if not again or a >= b:
            return ids
        if not self._plain and isinstance(self.tok, CompactBpe):  # the same tables, control matching off
            self._plain = dict.fromkeys((True, False), self.tok.without_control())
        if not self._plain:  # one copy serves both unless the pre-tokenizer treats the prompt's start apart
            try:
                same = _file_identity(self._path) == self._stat
            except OSError:
                same = False
            if not same:  # read again below: it must be the file self.tok came from
                raise EngineError(f"{self._path} changed or went away since the model was loaded (re-exported?); "
                                  "load the model again")
            plain = _plain_tokenizer(self._path)
            later = _not_at_start(plain.pre_tokenizer)
            self._plain = {True: plain, False: plain if later is None else _plain_tokenizer(self._path, later)}
        return self._plain[a == 0].encode(text[a:b], add_special_tokens=False).ids


def _file_identity(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _plain_tokenizer(tokenizer_json: str, pre_tokenizer=None) -> Tokenizer:
    """A second copy of the tokenizer, read from its file, that encodes control tokens' strings as text (read
    again rather than copied through `to_str()` and json: Gemma 3's 262k-token vocabulary made that a ~500 MB
    peak), with `pre_tokenizer` in place of its own when given."""
    plain = Tokenizer.from_file(tokenizer_json)
    plain.encode_special_tokens = True
    if pre_tokenizer is not None:
        plain.pre_tokenizer = pre_tokenizer
    return plain


def _not_at_start(pre_tokenizer):
    """For text that does not start the prompt: `pre_tokenizer` with each Metaspace that puts "▁" before the first
    word only ("first") putting none, as it does after a control token when the whole prompt is encoded; None when
    it has no such step."""
    if pre_tokenizer is None:
        return None
    cfg = json.loads(pre_tokenizer.__getstate__())
    found = []

    def never_first(node):
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
                found.append(node)
            for v in node.values():
                never_first(v)
        elif isinstance(node, list):
            for v in node:
                never_first(v)

    never_first(cfg)
    if not found:
        return None
    later = pre_tokenizers.Metaspace()  # a holder: its state (any pre-tokenizer, a Sequence too) is set from JSON
    later.__setstate__(json.dumps(cfg).encode())
    return later


def _map_strings(x, f):
    """`x` (messages: dicts, lists, strings) with `f` applied to every string, dict keys included."""
    if isinstance(x, str):
        return f(x)
    if isinstance(x, dict):
        return {_map_strings(k, f): _map_strings(v, f) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_map_strings(v, f) for v in x)
    return x


def _text_size(x) -> int:
    """Characters of text in `x` (messages: dicts, lists, strings)."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, dict):
        return sum(_text_size(k) + _text_size(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return sum(_text_size(v) for v in x)
    return 0


_FIX = "fix chat_template in the model's tokenizer_config.json and re-export, or send a raw prompt (raw=True)"


def _template_error(e: Exception) -> ChatTemplateError:
    """One line for whatever went wrong inside a chat template."""
    from jinja2 import TemplateSyntaxError

    if isinstance(e, ChatTemplateError):
        return e
    if isinstance(e, _Refusal):
        return ChatTemplateError(f"{e} (a rule of this model's chat template)")
    if isinstance(e, _OverBudget):
        return ChatTemplateError(f"the model's chat template {e}; {_FIX}")
    if isinstance(e, TemplateSyntaxError):
        return ChatTemplateError(f"the model's chat template has a syntax error on line {e.lineno}: {e.message}; "
                                 f"{_FIX}")
    if isinstance(e, RecursionError):
        return ChatTemplateError(f"the model's chat template recurses too deep; {_FIX}")
    if isinstance(e, MemoryError):
        return ChatTemplateError(f"the model's chat template ran out of memory; {_FIX}")
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return ChatTemplateError(f"the model's chat template failed on these messages: {type(e).__name__}"
                             + (f": {first}" if first else ""))


# ----------------------------------------------------------------------------- the template environment

class _Budget:
    __slots__ = ("seconds", "deadline", "chars")

    def __init__(self, seconds: float, chars: int):
        self.seconds, self.deadline, self.chars = seconds, time.monotonic() + seconds, chars

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"took more than {self.seconds:g} s to render (a loop or recursion that runs too "
                              "long)")


_active = threading.local()  # the budget of the render running in this thread
_MAX_INT_BITS = 1 << 16


class _OverBudget(Exception):
    pass


class _Refusal(Exception):
    """raise_exception() in a template: the template refuses these messages."""


def _tick() -> None:
    b = getattr(_active, "budget", None)
    if b is not None:
        b.tick()


def _limit() -> int:
    b = getattr(_active, "budget", None)
    return b.chars if b is not None else RENDER_CHARS


def _refuse_size(n: int) -> None:
    if n > _limit():
        raise _OverBudget(f"would build a value of {n} characters or items (more than {_limit()})")


def _sized(x):
    if isinstance(x, (str, list, tuple, dict)):
        _refuse_size(len(x))
    return x


_PRINTF_WIDTH = re.compile(r"%[#0 +\-]*(\d*)(?:\.(\d+))?")
_FORMAT_FIELD = re.compile(r"\{[^{}]*\}")


def _format_width(fmt: str) -> int:
    """The largest width or precision in a printf-style or str.format format string."""
    nums = [int(d) for m in _PRINTF_WIDTH.finditer(fmt) for d in m.groups() if d]
    nums += [int(d) for f in _FORMAT_FIELD.findall(fmt) if ":" in f for d in re.findall(r"\d+", f.split(":", 1)[1])]
    return max(nums, default=0)


def _replace_size(s: str, old, new, count=-1) -> int:
    if not (isinstance(old, str) and isinstance(new, str)):
        return len(s)
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * len(new)


def _str_method_size(s: str, name: str, args: tuple, kwargs: dict) -> int:
    """An upper bound of the size of s.name(*args) for the str methods that can grow text a lot."""
    a = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(a, int):
        return a
    if name == "replace" and len(args) >= 2:
        return _replace_size(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
    if name == "expandtabs":
        size = a if isinstance(a, int) else kwargs.get("tabsize", 8)
        return len(s) + s.count("\t") * (size if isinstance(size, int) else 8)
    if name == "join" and hasattr(a, "__len__"):
        return len(s) * len(a)
    return 0


def _filter_size(name: str, value, args: tuple, kwargs: dict) -> int:
    """An upper bound of the size of value|name(*args) for the filters that can grow text a lot."""
    a = args[0] if args else None
    if name == "center":
        w = a if a is not None else kwargs.get("width", 80)
        return w if isinstance(w, int) else 0
    if name == "indent" and isinstance(value, str):
        w = a if a is not None else kwargs.get("width", 4)
        return len(value) + (value.count("\n") + 1) * (w if isinstance(w, int) else len(str(w)))
    if name == "replace" and isinstance(value, str) and len(args) >= 2:
        return _replace_size(value, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
    if name == "format" and isinstance(value, str):
        return _format_width(value)
    if name == "join" and hasattr(value, "__len__"):
        d = a if a is not None else kwargs.get("d", "")
        return len(d) * len(value) if isinstance(d, str) else 0
    if name == "tojson":  # an indent repeats on every line: taken as 1024 lines
        indent = args[1] if len(args) > 1 else kwargs.get("indent")
        return indent * 1024 if isinstance(indent, int) else len(indent) * 1024 if isinstance(indent, str) else 0
    return 0


def _checked_filter(name: str, f):
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # a context/environment argument first

    @functools.wraps(f)
    def run(*args, **kwargs):
        _tick()
        if len(args) > skip:
            _refuse_size(_filter_size(name, args[skip], args[skip + 1:], kwargs))
        return _sized(f(*args, **kwargs))

    return run


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: json.dumps as it is, without jinja's HTML escaping of < > & '
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise _Refusal(message)


def _strftime_now(fmt):
    if isinstance(fmt, str) and _format_width(fmt) > 256:
        raise _OverBudget("asked strftime_now for a field wider than 256 characters")
    return datetime.now().strftime(fmt)


def _environment():
    """transformers' chat-template environment (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop
    controls, {% generation %}, tojson, raise_exception, strftime_now) with every loop iteration, call, operator,
    filter and output piece checked against the render budget."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import generate_lorem_ipsum
    from jinja2.visitor import NodeTransformer

    class Generation(Extension):
        """transformers' {% generation %}…{% endgeneration %} (it marks assistant text for training): its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Budgeted(NodeTransformer):
        """Every for loop iterates through env.budget_iter, every ~ concatenation goes through env.call (checked);
        template code cannot rebind an environment attribute."""

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = nodes.Call(nodes.EnvironmentAttribute("budget_iter"), [node.iter], [], None, None)
            node.iter.set_lineno(node.lineno)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            return nodes.Call(nodes.EnvironmentAttribute("budget_value"), [node], [], None, None).set_lineno(
                node.lineno)

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])  # (also keeps them from being folded at compile time)

        def __init__(self):
            super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
            self.filters["tojson"] = _tojson
            self.filters = {k: _checked_filter(k, f) for k, f in self.filters.items()}
            self.globals["raise_exception"] = _raise_exception
            self.globals["strftime_now"] = _strftime_now

            def lipsum(n=5, html=True, min=20, max=100):
                if isinstance(n, int) and isinstance(max, int):
                    _refuse_size(n * max * 12)
                return generate_lorem_ipsum(n, html, min, max)

            self.globals["lipsum"] = lipsum

        def _parse(self, source, name, filename):
            tree = Budgeted().visit(super()._parse(source, name, filename))
            tree.set_environment(self)
            return tree

        @staticmethod
        def budget_iter(iterable):
            for x in iterable:
                _tick()
                yield x

        @staticmethod
        def budget_value(x):
            return x  # env.call checks it

        def call_binop(self, context, operator, left, right):
            _tick()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and not isinstance(n, bool):
                        _refuse_size(len(seq) * n)
                if isinstance(left, int) and isinstance(right, int):
                    self._refuse_bits(left.bit_length() + right.bit_length())
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                self._refuse_bits(max(left.bit_length() - 1, 0) * right)
            elif operator == "%" and isinstance(left, str):
                _refuse_size(_format_width(left))
            return _sized(super().call_binop(context, operator, left, right))

        @staticmethod
        def _refuse_bits(bits: int) -> None:
            if bits > _MAX_INT_BITS:
                raise _OverBudget(f"would compute an integer of {bits} bits")

        def call(__self, __context, __obj, *args, **kwargs):
            _tick()
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                _refuse_size(_str_method_size(owner, getattr(__obj, "__name__", ""), args, kwargs))
            return _sized(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):
            f = super().wrap_str_format(value)
            if f is not None:
                _refuse_size(_format_width(value.__self__))
            return f

    return Env()


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: printable bytes stand for themselves, the others for 256 + n."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = _unicode_to_byte()


def _decodes_bytewise(tok: Tokenizer) -> bool:
    """`TextCodec.byte_level`."""
    dec = json.loads(tok.decoder.__getstate__()) if tok.decoder is not None else {}
    steps = dec.get("decoders", []) if dec.get("type") == "Sequence" else [dec]
    kinds = [d.get("type") for d in steps]
    if kinds[-1:] != ["ByteLevel"] or set(kinds[:-1]) - {"ByteFallback", "Fuse", "Replace"}:
        return False
    vocab = tok.get_vocab(with_added_tokens=True)
    if not set("".join(vocab)) <= _UNICODE_TO_BYTE.keys():
        return False
    for d in steps[:-1]:
        pattern = (d.get("pattern") or {}).get("String") if d["type"] == "Replace" else None
        if d["type"] == "Replace" and (pattern is None or set(pattern) <= _UNICODE_TO_BYTE.keys()):
            return False  # a regex, or a string that tokens could spell
        if d["type"] == "ByteFallback" and any(t.startswith("<0x") for t in vocab):
            return False
    return True


class StreamDecoder:
    """Turns a growing list of token ids into text deltas that are always whole characters.

    A byte-level BPE token can end in the middle of a multi-byte UTF-8 character; the tokenizer then decodes the tail
    to U+FFFD. We hold those tokens back until the character completes: for byte-level tokenizers by feeding each
    token's bytes to an incremental UTF-8 decoder, otherwise the vLLM / HF TextStreamer way (re-decode a short
    window and emit only the stable suffix)."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # start of the window re-decoded each time
        self.read = 0  # tokens whose text has been emitted
        # byte-level tokenizers: each token's bytes through an incremental UTF-8 decoder, which holds an incomplete
        # trailing character back and replaces invalid bytes as the tokenizer does (one Rust decode per push
        # otherwise; this runs every decode step)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if codec.byte_level else None

    def push(self, token_ids) -> str:
        if self._utf8 is not None:
            return self._utf8.decode(b"".join([self.codec.token_bytes(int(t)) for t in token_ids]))
        self.ids.extend(int(t) for t in token_ids)
        prev = self.codec.decode(self.ids[self.prefix : self.read])
        new = self.codec.decode(self.ids[self.prefix :])
        if new.endswith("\ufffd") or len(new) <= len(prev):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return new[len(prev) :]

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character stays as U+FFFD, never half bytes)."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        prev = self.codec.decode(self.ids[self.prefix : self.read])
        new = self.codec.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return new[len(prev) :] if len(new) > len(prev) else ""
