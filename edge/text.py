"""Tokenizer, chat template and UTF-8-safe incremental detokenization (runtime side: `tokenizers` + jinja2 only)."""
from __future__ import annotations

import re
from pathlib import Path

from tokenizers import Tokenizer

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class TextCodec:
    def __init__(self, tokenizer_json: str | Path, chat_template: str | None, bos: int | None, eos: tuple[int, ...]):
        self.tok = Tokenizer.from_file(str(tokenizer_json))
        self.vocab_size = self.tok.get_vocab_size()
        self.bos, self.eos = bos, tuple(eos)
        self._template_src = chat_template
        self._template = None

    def encode(self, text: str) -> list[int]:
        # a lone UTF-16 surrogate (JSON "\\ud800", a bad clipboard) is not text: U+FFFD, as a UTF-8 decoder would
        return self.tok.encode(_LONE_SURROGATE.sub("\ufffd", text), add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_text(self, i: int) -> str:
        return self.tok.id_to_token(i) or ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template_src is None:
            # no template: plain "role: content" lines, so base models still work
            body = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return body + ("assistant: " if add_generation_prompt else "")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise ValueError(f"chat template: {msg}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self._template_src)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.token_text(self.bos) if self.bos is not None else "",
            eos_token=self.token_text(self.eos[0]) if self.eos else "",
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt))


class StreamDecoder:
    """Turns a growing list of token ids into text deltas that are always whole characters.

    A byte-level BPE token can end in the middle of a multi-byte UTF-8 character; the tokenizer then decodes the tail
    to U+FFFD. We hold those tokens back until the character completes (the vLLM / HF TextStreamer approach:
    re-decode a short window and emit only the stable suffix)."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # start of the window re-decoded each time
        self.read = 0  # tokens whose text has been emitted

    def push(self, token_ids) -> str:
        self.ids.extend(int(t) for t in token_ids)
        prev = self.codec.decode(self.ids[self.prefix : self.read])
        new = self.codec.decode(self.ids[self.prefix :])
        if new.endswith("\ufffd") or len(new) <= len(prev):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return new[len(prev) :]

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character stays as U+FFFD, never half bytes)."""
        prev = self.codec.decode(self.ids[self.prefix : self.read])
        new = self.codec.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return new[len(prev) :] if len(new) > len(prev) else ""
