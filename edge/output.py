"""The output side of one answer: which of the tokens a step produced are emitted (EOS, max_tokens, stop strings) and
their text as chunks that never split a UTF-8 character nor show part of a stop string; an answer cut off by
max_tokens or the context inside a character ends before it."""
from __future__ import annotations

from dataclasses import dataclass

from .text import StreamDecoder


@dataclass
class Chunk:
    """A piece of a streamed answer: its text (whole characters), the token ids it came from, how many of them were
    draft tokens the target accepted, and on the last chunk the finish_reason ("stop", "length" or "cancelled",
    as `GenerationResult`'s)."""
    text: str
    token_ids: list[int]
    drafted: int  # how many of token_ids were drafter tokens the target accepted
    finish_reason: str | None = None


class AnswerText:
    """Tokens in, chunks out. `ids` are the answer's emitted token ids: they end with the token that completes a stop
    string or with EOS (whose text is not shown), so they do not depend on how many tokens a step accepted."""

    def __init__(self, codec, eos: set[int], max_tokens: int, stop: tuple[str, ...]):
        self.decoder = StreamDecoder(codec)
        self.eos, self.max_tokens, self.stop = eos, max_tokens, stop
        self.hold = max((len(s) for s in stop), default=1) - 1  # chars held back while a stop string may complete
        self.text, self.sent = "", 0
        self.ids: list[int] = []

    def push(self, new: list[int], drafted: int, full: bool) -> Chunk:
        """The chunk for the tokens `new` a step produced, of which `drafted` are accepted draft tokens (the chunk's
        `drafted` counts only those emitted); `full`: the context has no room for another step. The chunk carries
        a finish_reason when the answer ends with it."""
        finish, verified = None, len(new)
        for j, t in enumerate(new):
            if t in self.eos:
                new, finish = new[: j + 1], "stop"
                break
        if len(self.ids) + len(new) >= self.max_tokens:
            new, finish = new[: self.max_tokens - len(self.ids)], finish or "length"
        cut = -1
        if self.stop:  # token by token: the ids end with the one that completes a stop string
            for j, t in enumerate(new):
                if t in self.eos:  # ids keep EOS; text does not
                    continue
                start = max(0, len(self.text) - self.hold)  # a new match ends in the text this token adds
                self.text += self.decoder.push([t])
                cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
                if cut >= 0:
                    new, self.text, finish = new[: j + 1], self.text[:cut], "stop"
                    break
        else:  # (an EOS in `new` has set finish)
            self.text += self.decoder.push(new if finish is None else [t for t in new if t not in self.eos])
        if len(new) < verified:  # drafts accepted past an EOS or a stop: verified, never emitted
            drafted = min(drafted, len(new))
        self.ids += new
        if cut < 0 and finish is None and full:
            finish = "length"  # context window full
        if finish is not None:
            if cut < 0:
                self._flush(cut_off=finish == "length")
            return Chunk(self.text[self.sent :], new, drafted, finish)
        safe = max(self.sent, len(self.text) - self.hold) if self.stop else len(self.text)  # never a negative end
        chunk = Chunk(self.text[self.sent : safe], new, drafted)
        self.sent = max(self.sent, safe)
        return chunk

    def end(self, reason: str) -> Chunk:
        """The last chunk of an answer ended from outside (`Engine.cancel`): the text held back so far (a possible
        stop string's start; a character's first bytes are dropped, as at a limit) and no new tokens."""
        self._flush(cut_off=True)
        return Chunk(self.text[self.sent :], [], 0, reason)

    def _flush(self, cut_off: bool) -> None:
        """Add what the decoder still holds. An answer cut off (a limit, a cancel) inside a character drops the
        character's first bytes rather than show U+FFFD (as llama.cpp's server does); an answer the model ended
        keeps what it wrote."""
        tail = self.decoder.flush()
        self.text += tail.rstrip("\ufffd") if cut_off else tail
