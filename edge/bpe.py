"""A compact tokenizer for SentencePiece-style BPE vocabularies (Gemma 3's kind), equal to the `tokenizers` library's
reading of the same tokenizer.json, in a tenth of its memory.

The `tokenizers` library holds Gemma 3's 262,144-token vocabulary and 514k merges in about 93 MB (and parses them
through a larger peak): a third of what the rest of the runtime holds. The same vocabulary fits in ~12 MB of arrays:
the pieces as one UTF-8 blob with offsets, the merges as sorted int64 pair keys with their rank and result. The
exporter writes those arrays beside tokenizer.json (`write_tables`, checked there against `tokenizers` on text), and
`TextCodec` reads them in place of the library when they are present and were made from that very file.

What it reproduces of a tokenizer.json, and `tables_for` refuses anything else:
- added tokens matched on the raw text, leftmost-longest (none normalized, stripped or single-word); special ones
  left as text when `encode_special_tokens` is set, as the library does (a special match still hides what it
  overlaps);
- the normalizer: spaces as "▁", after an optional "▁" prepended to each stretch between added tokens;
- no pre-tokenizer: each stretch is one word, merged by the library's algorithm (lowest-ranked adjacent pair first,
  leftmost among equals; a character outside the vocabulary spelled as `<0xNN>` byte tokens);
- decoding: "▁" as a space, byte tokens joined and read as UTF-8 (U+FFFD per byte when invalid), an optional single
  leading space stripped;
- the post-processor's tokens before and after a single sequence."""
from __future__ import annotations

import bisect
import copy
import heapq
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memory.footprint import TOKENIZER_TABLES as TABLES_NAME  # the footprint model counts the file by this name

from .manifest import sha256_file

SPACE = "\u2581"
TABLES_FORMAT = 1


@dataclass(frozen=True)
class AddedToken:
    content: str
    special: bool


@dataclass(frozen=True)
class Encoding:
    ids: list[int]
    offsets: list[tuple[int, int]]


def tables_for(cfg: dict) -> dict | None:
    """The arrays `CompactBpe` reads, for a parsed tokenizer.json, or None when it is not a tokenizer this module
    reproduces exactly (see the module docstring)."""
    model = cfg.get("model") or {}
    if (model.get("type") != "BPE" or not model.get("byte_fallback") or model.get("dropout")
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("ignore_merges")
            or cfg.get("pre_tokenizer") is not None):
        return None
    prepend = _normalizer(cfg.get("normalizer"))
    strip = _decoder(cfg.get("decoder"))
    if prepend is None or strip is None:
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    added = cfg.get("added_tokens") or []
    if any(t.get("normalized") or t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    size = max(list(vocab.values()) + [t["id"] for t in added] + [-1]) + 1
    pieces = [""] * size
    for s, i in vocab.items():
        pieces[i] = s
    for t in added:  # an added token's id decodes to its content
        pieces[t["id"]] = t["content"]
    if any(f"<0x{b:02X}>" not in vocab for b in range(256)):
        return None  # text outside the vocabulary could not be spelled
    affix = _post_processor(cfg.get("post_processor"), {t["content"]: t["id"] for t in added} | vocab)
    if affix is None:
        return None
    keys, ranks, results = [], [], []
    for rank, m in enumerate(model.get("merges") or []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        ia, ib, r = vocab.get(a), vocab.get(b), vocab.get(a + b)
        if ia is None or ib is None or r is None:
            return None  # the library refuses such a file
        keys.append(ia * size + ib)
        ranks.append(rank)
        results.append(r)
    keys = np.asarray(keys, np.int64)
    order = np.argsort(keys, kind="stable")
    keys, ranks, results = keys[order], np.asarray(ranks, np.int32)[order], np.asarray(results, np.int32)[order]
    last = np.ones(len(keys), bool)  # a pair listed twice: the library keeps its last rank
    last[:-1] = keys[1:] != keys[:-1]
    chars = sorted((s, i) for s, i in vocab.items() if len(s) == 1)
    blob = [p.encode("utf-8") for p in pieces]
    offsets = np.zeros(size + 1, np.int64)
    np.cumsum([len(b) for b in blob], out=offsets[1:])
    header = {"format": TABLES_FORMAT, "size": size, "prepend": prepend, "strip": strip,
              "prefix": affix[0], "suffix": affix[1],
              "added": [[t["id"], t["content"], bool(t.get("special"))] for t in added]}
    return {"header": np.frombuffer(json.dumps(header, ensure_ascii=False).encode(), np.uint8),
            "pieces": np.frombuffer(b"".join(blob), np.uint8), "offsets": offsets,
            "keys": keys[last], "ranks": ranks[last], "results": results[last],
            "chars": np.frombuffer("".join(c for c, _ in chars).encode("utf-8"), np.uint8),
            "char_ids": np.asarray([i for _, i in chars], np.int32),
            "byte_ids": np.asarray([vocab[f"<0x{b:02X}>"] for b in range(256)], np.int32)}


def write_tables(cfg: dict, source: Path, out: Path) -> bool:
    """Write `tables_for(cfg)` to `out`, tagged with the digest of `source` (the tokenizer.json `cfg` was read
    from); False when the tokenizer is not one this module reproduces."""
    t = tables_for(cfg)
    if t is None:
        return False
    t["source"] = np.frombuffer(sha256_file(source).encode(), np.uint8)
    with open(out, "wb") as f:
        np.savez(f, **t)
    return True


def tables_path(tokenizer_json: str | Path) -> Path:
    return Path(tokenizer_json).with_name(TABLES_NAME)


def load_beside(tokenizer_json: str | Path) -> CompactBpe | None:
    """The compact tokenizer written beside `tokenizer_json`, if there is one made from that file."""
    path = tables_path(tokenizer_json)
    if not path.is_file():
        return None
    try:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        header = json.loads(arrays.pop("header").tobytes())
        source = arrays.pop("source").tobytes().decode()
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None  # unreadable: the library reads tokenizer.json itself
    if header.get("format") != TABLES_FORMAT or source != sha256_file(tokenizer_json):
        return None
    return CompactBpe(header, arrays)


class CompactBpe:
    """The subset of `tokenizers.Tokenizer` that `TextCodec` uses, over `tables_for`'s arrays."""

    pre_tokenizer = None

    def __init__(self, header: dict, arrays: dict, encode_special_tokens: bool = False):
        self._h = header
        self.encode_special_tokens = encode_special_tokens
        self._size = header["size"]
        self._blob = arrays["pieces"].tobytes()
        self._off = memoryview(arrays["offsets"])
        self._keys = memoryview(arrays["keys"])
        self._ranks = memoryview(arrays["ranks"])
        self._results = memoryview(arrays["results"])
        self._added = {c: (i, s) for i, c, s in header["added"]}
        self._decoder = {i: AddedToken(c, s) for i, c, s in header["added"]}
        # leftmost-longest matching: candidate starts found by one regex over the tokens' first characters, then
        # each length that token start has, longest first
        lengths: dict[str, set[int]] = {}
        for c in self._added:
            if c:
                lengths.setdefault(c[0], set()).add(len(c))
        self._lengths = {k: sorted(v, reverse=True) for k, v in lengths.items()}
        self._starts = re.compile("[" + "".join(re.escape(c) for c in sorted(self._lengths)) + "]") \
            if self._lengths else None
        # the model's single-character pieces, and its byte tokens: where every word's BPE starts
        self._char = dict(zip(arrays["chars"].tobytes().decode("utf-8"), arrays["char_ids"].tolist()))
        self._byte = arrays["byte_ids"].tolist()
        self._byte_value = {i: b for b, i in enumerate(self._byte)}

    def without_control(self) -> CompactBpe:
        """The same tables (shared, not copied), with control tokens' strings encoded as text."""
        plain = copy.copy(self)
        plain.encode_special_tokens = True
        return plain

    # ------------------------------------------------------------------ the library's API, as TextCodec uses it
    def get_vocab_size(self) -> int:
        return self._size

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self._decoder)

    def max_token_chars(self) -> int:
        """No token stands for more characters of text than this: the longest piece's UTF-8 length, or the longest
        added token's (the normalizer only turns spaces into "▁" and may prepend one, so text never shrinks)."""
        pieces = int(np.diff(np.asarray(self._off)).max(initial=0))
        return max([pieces] + [len(c) for c in self._added])

    def id_to_token(self, i: int) -> str | None:
        return self._piece(i) if 0 <= i < self._size else None

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for tid, a, b in self._split(text):
            if tid is not None:
                ids.append(tid)
                offsets.append((a, b))
            elif b > a:
                self._word(text[a:b], a, ids, offsets)
        if add_special_tokens:
            pre, post = self._h["prefix"], self._h["suffix"]
            ids = pre + ids + post
            offsets = [(0, 0)] * len(pre) + offsets + [(0, 0)] * len(post)
        return Encoding(ids, offsets)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        pending = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self._size:
                continue
            if skip_special_tokens and i in self._decoder and self._decoder[i].special:
                continue
            b = self._byte_value.get(i)
            if b is not None:
                pending.append(b)
                continue
            if pending:
                out.append(_bytes_text(pending))
                pending = bytearray()
            out.append(self._piece(i).replace(SPACE, " "))
        if pending:
            out.append(_bytes_text(pending))
        s = "".join(out)
        return s[1:] if self._h["strip"] and s.startswith(" ") else s

    # ------------------------------------------------------------------ internals
    def _piece(self, i: int) -> str:
        return self._blob[self._off[i]:self._off[i + 1]].decode("utf-8")

    def _split(self, text: str) -> list[tuple[int | None, int, int]]:
        """(added token id or None, start, end) stretches of `text`: added tokens leftmost-longest."""
        out, start, pos, n = [], 0, 0, len(text)
        starts = self._starts
        while starts is not None:
            m = starts.search(text, pos)
            if m is None:
                break
            p = m.start()
            for length in self._lengths[text[p]]:
                hit = self._added.get(text[p:p + length]) if p + length <= n else None
                if hit is not None:
                    break
            else:
                pos = p + 1
                continue
            pos = p + length
            if self.encode_special_tokens and hit[1]:
                continue  # a special token left as text (and whatever it overlaps with it)
            if p > start:
                out.append((None, start, p))
            out.append((hit[0], p, pos))
            start = pos
        if start < n:
            out.append((None, start, n))
        return out

    def _word(self, s: str, base: int, ids: list[int], offsets: list[tuple[int, int]]) -> None:
        """BPE over one stretch of text, appending its ids and (start, end) character offsets in the text."""
        prepend = self._h["prepend"]
        s = (SPACE if prepend else "") + s.replace(" ", SPACE)
        shift = base - (1 if prepend else 0)
        c: list[int] = []
        start: list[int] = []
        char, byte = self._char, self._byte
        for k, ch in enumerate(s):
            i = char.get(ch)
            if i is not None:
                c.append(i)
                start.append(k)
            else:
                for b in ch.encode("utf-8"):
                    c.append(byte[b])
                    start.append(k)
        n = len(c)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        end = [k + 1 for k in start]  # a byte token spans its whole character, as in the library
        size, keys, ranks, results, nk = self._size, self._keys, self._ranks, self._results, len(self._keys)
        seen: dict[int, tuple[int, int] | None] = {}
        find = bisect.bisect_left

        def merge_of(a: int, b: int):  # (rank, result) of the pair, or None
            k = a * size + b
            r = seen.get(k, 0)
            if r == 0:
                j = find(keys, k)
                r = seen[k] = (ranks[j], results[j]) if j < nk and keys[j] == k else None
            return r

        queue = []
        for i in range(n - 1):
            r = merge_of(c[i], c[i + 1])
            if r is not None:
                queue.append((r[0], i, r[1], c[i], c[i + 1]))
        heapq.heapify(queue)
        pop, push = heapq.heappop, heapq.heappush
        while queue:
            _, i, new, a, b = pop(queue)
            j = nxt[i]
            if c[i] < 0 or j < 0:
                continue  # merged into its left neighbour, or the last symbol
            if c[i] != a or c[j] != b:  # stale, unless the pair there now merges into the same token
                now = merge_of(c[i], c[j])
                if now is None or now[1] != new:
                    continue
            c[i], end[i], c[j] = new, end[j], -1
            nj = nxt[j]
            nxt[i] = nj
            if nj >= 0:
                prev[nj] = i
            p = prev[i]
            if p >= 0 and (r := merge_of(c[p], new)) is not None:
                push(queue, (r[0], p, r[1], c[p], new))
            if nj >= 0 and (r := merge_of(new, c[nj])) is not None:
                push(queue, (r[0], i, r[1], new, c[nj]))
        i = 0
        while i >= 0:
            ids.append(c[i])
            offsets.append((max(base, shift + start[i]), max(base + 1, shift + end[i])))  # a prepended ▁ spans the first character
            i = nxt[i]


def _bytes_text(b: bytearray) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(b)


def _steps(node: dict | None, kind: str) -> list[dict] | None:
    if node is None:
        return []
    return list(node.get(f"{kind}s") or []) if node.get("type") == "Sequence" else [node]


def _normalizer(node: dict | None) -> bool | None:
    """Whether the normalizer prepends "▁", for Replace(" ", "▁") alone or after Prepend("▁"); None otherwise."""
    steps = _steps(node, "normalizer")
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    if steps == [replace]:
        return False
    if steps == [{"type": "Prepend", "prepend": SPACE}, replace]:
        return True
    return None


def _decoder(node: dict | None) -> bool | None:
    """Whether the decoder strips one leading space, for Replace("▁", " "), ByteFallback, Fuse (then an optional
    Strip(" ", 1, 0)); None otherwise."""
    steps = _steps(node, "decoder")
    base = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}]
    if steps == base:
        return False
    if steps[:3] == base and steps[3:] == [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]:
        return True
    return None


def _post_processor(node: dict | None, ids: dict[str, int]) -> tuple[list[int], list[int]] | None:
    """(ids before, ids after) a single sequence, for no post-processor or a TemplateProcessing; None otherwise."""
    if node is None:
        return [], []
    if node.get("type") != "TemplateProcessing":
        return None
    before, after, seen = [], [], False
    for step in node.get("single") or []:
        if "Sequence" in step:
            seen = True
        elif "SpecialToken" in step:
            name = step["SpecialToken"]["id"]
            special = (node.get("special_tokens") or {}).get(name)
            got = special["ids"] if special else ([ids[name]] if name in ids else None)
            if got is None:
                return None
            (after if seen else before).extend(int(i) for i in got)
        else:
            return None
    return before, after
