"""export/spm.py: the tokenizer.json built from a GGUF's SentencePiece-BPE vocabulary (Gemma 3's kind) tokenizes as
llama.cpp's SPM tokenizer does. A small vocabulary with scores, byte tokens, control and user-defined tokens is
written to a GGUF here; `llama_spm` below restates llama.cpp's algorithm and is the reference."""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from export.gguf_read import read_gguf
from export.spm import BYTE, CONTROL, NORMAL, USER_DEFINED, spm_merges, spm_tokenizer

CONTROLS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
USER = ["\n", "\n\n", "\t", "  ", "   ", "<b>", "</b>", "<bbox>"]
CHARS = list("▁abcdeghilnoprstuwxyzT.,!?'<>/_") + ["ö"]
# normal pieces, best first; "é", "中", "😀", digits and capitals but "T" are left out: they need byte fallback
PIECES = ["▁t", "he", "wx", "in", "▁the", "bc", "ng", "ing", "▁a", "er", "on", "xy", "re", "an", "yz", "ab", "▁s",
          "it", "al", "ca", "ap", "▁ca", "▁cap", "ital", "▁capital", "xyz", "▁w", "or", "ld", "▁wor", "▁world", "Th",
          "The", "is", "▁is", "▁on", "st", "art", "▁T", "▁The", "ar", "ur", "rn", "urn", "_o", "▁x", "aa", "aaa", "ww",
          "www", "wwww", "<s", "tab", "le", "öl", "▁öl"]
BOS, EOS, UNK = 2, 1, 3


def vocab():
    tokens = CONTROLS + USER + [f"<0x{b:02X}>" for b in range(256)] + CHARS + PIECES
    types = ([CONTROL] * len(CONTROLS) + [USER_DEFINED] * len(USER) + [BYTE] * 256
             + [NORMAL] * (len(CHARS) + len(PIECES)))
    # as in Gemma's GGUF: control and user-defined -1000, bytes 0, normal pieces minus their rank (single
    # characters rank after the pieces)
    normal = [-float(i + 1) for i in range(len(PIECES) + len(CHARS))]
    scores = [-1000.0] * (len(CONTROLS) + len(USER)) + [0.0] * 256 + normal[len(PIECES):] + normal[:len(PIECES)]
    return tokens, np.asarray(scores, np.float32), np.asarray(types, np.int32)


def test_the_vocabulary_is_like_a_real_one():
    """Every character of a piece is a piece and every piece but a character has a split into two pieces, as in
    a trained SentencePiece vocabulary (and in Gemma 3's): BPE merges then reach what llama.cpp's merging does."""
    tokens, _, types = vocab()
    normal = {t for t, k in zip(tokens, types) if k == NORMAL}
    assert {c for t in normal for c in t} <= normal
    assert all(any(t[:k] in normal and t[k:] in normal for k in range(1, len(t))) for t in normal if len(t) > 1)


def write_spm_gguf(path: Path, arch="gemma3", add_bos=True, add_eos=False, space_prefix=False, drop=(),
                   template="{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                            "{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n") -> Path:
    import gguf

    tokens, scores, types = vocab()
    keep = [i for i, t in enumerate(tokens) if t not in drop]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([tokens[i] for i in keep])
    w.add_token_scores(scores[keep].tolist())
    w.add_token_types(types[keep].tolist())
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(UNK)
    w.add_pad_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    w.add_add_space_prefix(space_prefix)
    if template:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_spm(fields: dict, text: str, parse_special: bool = True) -> list[int]:
    """llama.cpp's SPM tokenization (llm_tokenizer_spm with its special-token partition), restated plainly."""
    tokens = fields["tokenizer.ggml.tokens"]
    scores = fields["tokenizer.ggml.scores"]
    types = fields["tokenizer.ggml.token_type"]
    ids = {t: i for i, t in enumerate(tokens)}
    kinds = (USER_DEFINED, CONTROL) if parse_special else (USER_DEFINED,)
    # the partition: each special token, longest first, cut out of the text fragments left
    frags: list = [text] if text else []
    for s in sorted((i for i in range(len(tokens)) if types[i] in kinds), key=lambda i: -len(tokens[i])):
        new = []
        for f in frags:
            while isinstance(f, str) and tokens[s] in f:
                j = f.index(tokens[s])
                new += [f[:j], s] if j else [s]
                f = f[j + len(tokens[s]):]
            if f != "":
                new.append(f)
        frags = new
    out = [fields["tokenizer.ggml.bos_token_id"]] if fields["tokenizer.ggml.add_bos_token"] else []
    prev_special = True
    for f in frags:
        if isinstance(f, int):
            out.append(f)
            prev_special = True
            continue
        f = ((" " if fields["tokenizer.ggml.add_space_prefix"] and prev_special else "") + f).replace(" ", "▁")
        prev_special = False
        sym = list(f)
        while True:  # merge the best-scoring concatenation, leftmost first among equals
            best = None
            for i in range(len(sym) - 1):
                j = ids.get(sym[i] + sym[i + 1])
                if j is not None and (best is None or scores[j] > best[0]):
                    best = (scores[j], i)
            if best is None:
                break
            i = best[1]
            sym[i:i + 2] = [sym[i] + sym[i + 1]]
        for s in sym:
            out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    if fields["tokenizer.ggml.add_eos_token"]:
        out.append(fields["tokenizer.ggml.eos_token_id"])
    return out


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """(fields, tokenizer, the same tokenizer with control-token matching off) for the default GGUF."""
    path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "v.gguf")
    fields = read_gguf(path, tensors=False).fields
    tok = spm_tokenizer(fields)
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    return fields, tok, plain


def pieces(tok, text, **kw) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text, **kw).ids]


def test_merges_are_every_split_ranked_by_the_pieces_score():
    tokens, scores, _ = vocab()
    merges = spm_merges(tokens, scores)
    assert merges[:4] == [("▁", "t"), ("h", "e"), ("w", "x"), ("i", "n")]
    # "xyz" has two splits, both kept, next to each other: which one applies depends on the pairs merged before
    i = merges.index(("x", "yz"))
    assert merges[i + 1] == ("xy", "z")
    assert ("<", "s") in merges and not any("".join(m).startswith("<0x") for m in merges)
    # "www" splits as w+ww and ww+w, both kept; "wwww" as ww+ww, w+www and www+w
    assert {m for m in merges if "".join(m) == "wwww"} == {("w", "www"), ("ww", "ww"), ("www", "w")}


def test_merge_order_follows_scores_not_position(spm):
    _, tok, _ = spm
    assert pieces(tok, "abc", add_special_tokens=False) == ["a", "bc"]  # "bc" outranks "ab"
    assert pieces(tok, "xyz", add_special_tokens=False) == ["xyz"]  # via xy + z
    assert pieces(tok, "wxyz", add_special_tokens=False) == ["wx", "yz"]  # wx first leaves y, z: then yz
    assert pieces(tok, "The capital of the world", add_special_tokens=False) == [
        "The", "▁capital", "▁", "o", "<0x66>", "▁the", "▁world"]
    assert pieces(tok, "wwwwwww", add_special_tokens=False) == ["wwww", "www"]


def test_byte_fallback_and_its_decoding(spm):
    _, tok, _ = spm
    enc = tok.encode("é中😀 7", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in enc.ids] == ["<0xC3>", "<0xA9>", "<0xE4>", "<0xB8>", "<0xAD>", "<0xF0>",
                                                      "<0x9F>", "<0x98>", "<0x80>", "▁", "<0x37>"]
    assert tok.decode(enc.ids) == "é中😀 7"
    assert pieces(tok, " öl", add_special_tokens=False) == ["▁öl"]  # a non-ASCII character in the vocabulary


def test_user_defined_tokens_are_matched_whole_before_bpe(spm):
    _, tok, plain = spm
    for t in (tok, plain):  # control-token matching off or on, user-defined tokens are always matched
        assert pieces(t, "a\n\nb", add_special_tokens=False) == ["a", "\n\n", "b"]
        # four spaces: the three-space token, then a space that starts the next word
        assert pieces(t, "a    the", add_special_tokens=False) == ["a", "   ", "▁the"]
        assert pieces(t, "<b>it</b>\t<bbox>", add_special_tokens=False) == ["<b>", "it", "</b>", "\t", "<bbox>"]
        assert pieces(t, "\n\n\n", add_special_tokens=False) == ["\n\n", "\n"]


def test_control_tokens_only_when_special_tokens_are_parsed(spm):
    fields, tok, plain = spm
    text = "<start_of_turn>user\nhi<end_of_turn>"
    assert pieces(tok, text, add_special_tokens=False) == [
        "<start_of_turn>", "u", "s", "er", "\n", "h", "i", "<end_of_turn>"]
    spelled = pieces(plain, text, add_special_tokens=False)
    assert spelled[:5] == ["<", "st", "art", "_o", "<0x66>"] and not set(spelled) & set(CONTROLS)
    assert tok.encode(text).ids == llama_spm(fields, text)
    assert plain.encode(text).ids == llama_spm(fields, text, parse_special=False)
    assert {t.content for t in tok.get_added_tokens_decoder().values() if t.special} == set(CONTROLS)
    assert {t.content for t in tok.get_added_tokens_decoder().values() if not t.special} == set(USER)


def test_agrees_with_llama_cpp_algorithm_on_random_text(spm):
    fields, tok, plain = spm
    alphabet = (CHARS + list("abcdefxyzw   éT09中😀") + ["the", " the", "ing", "capital", "world", "xyz"] + USER
                + CONTROLS + ["<start_of", "turn>", "<0x41>"])
    rng = random.Random(0)
    texts = ["", " ", "  ", "\n", "the", " the", "wwwwwwwwwww", "aaaaaaa", "▁▁"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 25))) for _ in range(400)]
    for text in texts:
        assert tok.encode(text).ids == llama_spm(fields, text), text
        assert plain.encode(text).ids == llama_spm(fields, text, parse_special=False), text
        if "▁" not in text:  # a literal "▁" decodes as a space, in llama.cpp too
            assert plain.decode(plain.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text
            assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_merges_with_a_space_are_left_out_and_change_nothing():
    """With a user-defined " " (Gemma 3 has runs of spaces as tokens) the runs of spaces split into pieces with a
    space; the normalizer replaces every space before BPE runs, so those merges are left out, and the ids stay
    llama.cpp's."""
    tokens, scores, types = vocab()
    fields = {"tokenizer.ggml.tokens": tokens + [" "], "tokenizer.ggml.scores": np.append(scores, -1000.0),
              "tokenizer.ggml.token_type": np.append(types, USER_DEFINED), "tokenizer.ggml.bos_token_id": BOS,
              "tokenizer.ggml.eos_token_id": EOS, "tokenizer.ggml.add_bos_token": True,
              "tokenizer.ggml.add_eos_token": False, "tokenizer.ggml.add_space_prefix": False}
    assert ("  ", " ") in spm_merges(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"])
    tok = spm_tokenizer(fields)
    assert not any(" " in m for pair in json.loads(tok.to_str())["model"]["merges"] for m in pair)
    rng = random.Random(1)
    for _ in range(200):
        text = "".join(rng.choice([" ", "  ", "\t", "a", "the", "▁", "xy", "<b>"]) for _ in range(rng.randrange(1, 20)))
        assert tok.encode(text).ids == llama_spm(fields, text), text


@pytest.mark.parametrize("add_bos,add_eos,space_prefix", [(True, False, False), (False, False, False),
                                                          (True, True, False), (True, False, True),
                                                          (False, False, True)])
def test_bos_eos_and_space_prefix_follow_the_gguf(tmp_path, add_bos, add_eos, space_prefix):
    path = write_spm_gguf(tmp_path / "v.gguf", add_bos=add_bos, add_eos=add_eos, space_prefix=space_prefix)
    fields = read_gguf(path, tensors=False).fields
    tok = spm_tokenizer(fields)
    for text in ("the world", "a\nthe\n\nworld", "<start_of_turn>user\nhi", "", "  the", "é"):
        assert tok.encode(text).ids == llama_spm(fields, text), text
    # llama.cpp puts the space prefix on every stretch after a special token: only a text without those decodes
    # back exactly when there is one
    for text in ("the world", "", " the", "é"):
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text
    ids = tok.encode("the").ids
    assert (ids[0] == BOS) == add_bos and (ids[-1] == EOS) == add_eos
    assert tok.id_to_token(ids[1 if add_bos else 0]) == ("▁the" if space_prefix else "t")
    if add_bos:
        assert tok.encode("the", "world").ids.count(BOS) == 2


def test_write_tokenizer_from_a_gemma3_gguf(tmp_path):
    """The export's GGUF path: a gemma3 vocabulary goes through export.spm (no transformers needed), with the
    special ids and chat template from the metadata; the runtime's TextCodec reads the result."""
    from edge.text import TextCodec
    from export.tokenizer import write_tokenizer

    path = write_spm_gguf(tmp_path / "g.gguf")
    tf = write_tokenizer(SimpleNamespace(source=str(path), source_format="gguf"), tmp_path)
    assert (tf.bos, tf.eos, tf.pad) == (BOS, (EOS,), 0) and tf.chat_template.startswith("{{ bos_token }}")
    raw = (tmp_path / "tokenizer.json").read_text()
    model = json.loads(raw)["model"]
    assert model["type"] == "BPE" and "\n  " not in raw  # compact
    assert all(isinstance(m, str) for m in model["merges"])  # "a b" strings (export.tokenizer.compact_merges)
    codec = TextCodec(tmp_path / "tokenizer.json", tf.chat_template, tf.bos, tf.eos)
    assert codec.prefix == [BOS]
    fields = read_gguf(path, tensors=False).fields
    assert codec.encode_prompt("the capital") == llama_spm(fields, "the capital")
    msgs = [{"role": "user", "content": "hi<end_of_turn>"}]
    ids = codec.encode_chat(msgs)
    # the template's control tokens are tokens, the message's "<end_of_turn>" is text
    assert ids[:2] == [BOS, 4] and ids.count(5) == 1
    assert codec.decode(ids) == codec.render(msgs)


def test_a_vocabulary_without_byte_tokens_is_refused(tmp_path):
    from export.checkpoint import CheckpointError
    from export.tokenizer import write_tokenizer

    path = write_spm_gguf(tmp_path / "g.gguf", drop=("<0x41>",))
    with pytest.raises(CheckpointError, match="byte tokens <0x41>"):
        write_tokenizer(SimpleNamespace(source=str(path), source_format="gguf"), tmp_path)
