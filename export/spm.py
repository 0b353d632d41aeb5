"""A `tokenizers` tokenizer for a GGUF whose vocabulary is SentencePiece BPE (`tokenizer.ggml.model` "llama"),
built to tokenize exactly as llama.cpp's SPM tokenizer does.

llama.cpp tokenizes such a vocabulary in three steps:

1. the text is cut at user-defined tokens (type 4: "\\n", runs of spaces or tabs, html tags…) and, when special
   tokens are parsed, at control tokens (type 3); those pieces become their tokens whole;
2. each remaining stretch gets a leading space if `add_space_prefix` says so, has its spaces replaced by "▁" and is
   split into characters, then the adjacent pair whose concatenation is a vocabulary piece with the highest score
   is merged, again and again;
3. a piece left over that is not in the vocabulary is spelled as its UTF-8 bytes, `<0xNN>` tokens.

The Hugging Face equivalent is a BPE model whose merges are every split (a, b) of a vocabulary piece p with a and b
in the vocabulary, ranked by p's score, best first (merging the best-ranked pair is merging the best-scoring
concatenation), with byte fallback; user-defined tokens become non-special added tokens matched on the raw text,
control tokens special ones (`encode_special_tokens` turns their matching off, as llama.cpp's `parse_special`).

The two agree when every character of a piece is itself a piece and every longer piece splits into two pieces, as
in a trained SentencePiece vocabulary (Gemma 3's included): llama.cpp could otherwise merge a character it would
spell as bytes, which a BPE model cannot. llama.cpp also retypes a few tokens by their text (Gemma 3's user-defined
"</s>" becomes a control token there); the tokenizer here keeps the GGUF's types."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # "▁", SentencePiece's visible space


class SpmVocabError(ValueError):
    """The GGUF's tokenizer fields do not describe a usable SentencePiece vocabulary."""


def spm_merges(tokens: Sequence[str], scores) -> list[tuple[str, str]]:
    """Every split (a, b) of a vocabulary piece with both halves in the vocabulary, ordered by the piece's score,
    highest first (ties: lower id first); the splits of one piece by ascending (id of a, id of b). When two splits
    of one piece could apply at once (x+y and y+z both spelling it) llama.cpp merges the leftmost, which no fixed
    ranking gives in every case; on Gemma 3's vocabulary no text tried has met such a case."""
    ids = {t: i for i, t in enumerate(tokens)}
    scores = np.asarray(scores, dtype=np.float64)
    lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    # stable sort on -score: equal scores keep id order
    order = np.argsort(-scores, kind="stable")
    order = order[lengths[order] > 1]
    merges: list[tuple[str, str]] = []
    get = ids.get
    for i in order.tolist():
        p = tokens[i]
        local = []
        for k in range(1, len(p)):
            a = get(p[:k])
            if a is None:
                continue
            b = get(p[k:])
            if b is not None:
                local.append((a, b))
        if local:
            if len(local) > 1:
                local.sort()
            merges.extend((tokens[a], tokens[b]) for a, b in local)
    return merges


def spm_tokenizer(fields: dict):
    """A `tokenizers.Tokenizer` from a GGUF's metadata (as `export.gguf_read.read_gguf(...).fields` gives it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise SpmVocabError("the GGUF has no tokenizer.ggml.tokens")
    tokens = list(tokens)
    n = len(tokens)
    scores = fields.get("tokenizer.ggml.scores")
    scores = np.zeros(n, np.float32) if scores is None else np.asarray(scores, np.float32)
    types = fields.get("tokenizer.ggml.token_type")
    types = np.full(n, NORMAL, np.int32) if types is None else np.asarray(types, np.int32)
    if len(scores) != n or len(types) != n:
        raise SpmVocabError(f"{n} tokens but {len(scores)} scores and {len(types)} token types")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated piece maps to its first id, as llama.cpp's text → token map does
    if len(vocab) != n:
        raise SpmVocabError(f"{n - len(vocab)} duplicated tokens: the tokenizer.json vocabulary needs unique pieces")
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise SpmVocabError(f"no byte tokens {', '.join(missing[:4])}…: text outside the vocabulary cannot be spelled")

    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < n else None
    # the normalizer below turns every space into "▁" before BPE runs, so a merge with a space in either half (a
    # split of a user-defined run of spaces) never applies; leaving those out lets the merges be saved as "a b" strings
    # (export.tokenizer.compact_merges), which load in less memory
    merges = [(a, b) for a, b in spm_merges(tokens, scores) if " " not in a and " " not in b]
    model = BPE(vocab, merges, unk_token=unk, byte_fallback=True, fuse_unk=True,
                ignore_merges=False)
    tok = Tokenizer(model)

    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)

    control = [tokens[i] for i in np.flatnonzero((types == CONTROL) | (types == UNKNOWN)).tolist()]
    user = [tokens[i] for i in np.flatnonzero(types == USER_DEFINED).tolist()]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    tok.post_processor = _post_processor(fields, tokens, processors)
    return tok


def _post_processor(fields: dict, tokens: list[str], processors):
    def special(key: str, add_key: str, default: bool):
        i = fields.get(key)
        if i is None or not fields.get(add_key, default) or not 0 <= int(i) < len(tokens):
            return None
        return tokens[int(i)], int(i)

    # llama.cpp adds BOS to an SPM vocabulary unless the GGUF says not to, and EOS only when it says to
    bos = special("tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", True)
    eos = special("tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_eos_token", False)
    if bos is None and eos is None:
        return None
    def template(seq: str, type_id: int) -> list[str]:
        return ([f"{bos[0]}:{type_id}"] if bos else []) + [f"{seq}:{type_id}"] + ([f"{eos[0]}:{type_id}"] if eos else [])

    return processors.TemplateProcessing(single=template("$A", 0), pair=template("$A", 0) + template("$B", 1),
                                         special_tokens=[t for t in (bos, eos) if t])
