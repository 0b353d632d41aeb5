"""edge/text.py's decoding: which tokenizers may stream token bytes directly (byte-level BPE with known decoder
steps) and which re-decode, and that both paths give decode()'s text, special tokens included."""
from __future__ import annotations

import json

from edge.manifest import load_manifest


def _codec(tmp_path, vocab: dict, decoder: dict | None):
    from tokenizers import Tokenizer, models

    from edge.text import TextCodec

    spec = json.loads(Tokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab)))).to_str())
    spec["decoder"] = decoder
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return TextCodec(tmp_path / "tokenizer.json", None, None, ())


def _streamed(codec, ids, cuts=()):
    from edge.text import StreamDecoder

    dec, out, prev = StreamDecoder(codec), [], 0
    for c in list(cuts) + [len(ids)]:
        out.append(dec.push(ids[prev:c]))
        prev = c
    return out + [dec.flush()]


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}


def test_an_unknown_decoder_step_before_byte_level_takes_the_redecoding_path(tmp_path):
    """Only the decoder steps known to keep the text may come before ByteLevel on the byte-streaming path: a Strip
    step changes the text (streaming token bytes would print "ab ba" where the tokenizer decodes "b b"), so such a
    tokenizer streams by re-decoding."""
    codec = _codec(tmp_path, {"a": 0, "Ġb": 1, "ab": 2}, {"type": "Sequence", "decoders": [
        {"type": "Strip", "content": "a", "start": 1, "stop": 0}, BYTE_LEVEL]})
    assert not codec.byte_level
    assert "".join(_streamed(codec, [2, 1, 0], [1])) == codec.decode([2, 1, 0])


def test_special_tokens_are_decoded_the_same_on_both_streaming_paths(tiny_dir):
    """A special token the model emits mid-answer (<|im_start|>) is kept by decode() and by both streaming paths
    (token bytes and re-decoding), so an answer streams the same whatever the tokenizer."""
    import copy

    from edge.text import TextCodec

    m = load_manifest(tiny_dir, verify="none")
    codec = TextCodec(tiny_dir / m.tokenizer, None, None, ())
    hi = codec.encode("hi")
    ids = hi + [1] + hi
    assert codec.decode(ids) == "hi<|im_start|>hi"
    slow = copy.copy(codec)
    slow._byte_level = False
    for c in (codec, slow):
        assert "".join(_streamed(c, ids, [len(hi)])) == "hi<|im_start|>hi"
