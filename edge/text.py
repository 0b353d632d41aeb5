"""Tokenizer, chat template and UTF-8-safe incremental detokenization (runtime side: `tokenizers` + jinja2 only)."""
from __future__ import annotations

import codecs
import json
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
        self._byte_level: bool | None = None
        self._bytes: dict[int, bytes] = {}

    def encode(self, text: str) -> list[int]:
        # a lone UTF-16 surrogate (JSON "\\ud800", a bad clipboard) is not text: U+FFFD, as a UTF-8 decoder would
        return self.tok.encode(_LONE_SURROGATE.sub("\ufffd", text), add_special_tokens=False).ids

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
            self._byte_level = _decodes_bytewise(self.tok)
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
