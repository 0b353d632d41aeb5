"""export/tokenizer.py: the tokenizer files an export writes, with the end tokens and chat template a checkpoint's
config files give."""
from __future__ import annotations

import json
import shutil

from tokenizers import Tokenizer

from export.checkpoint import load_hf_dir


def test_generation_config_eos_ids_win_over_config(tmp_path, tiny_llama_dir):
    """Like transformers' generate(): generation_config.json's eos_token_id (here a list, as Llama 3 ships it)
    replaces config.json's; a chat template given as named templates takes the 'default' one."""
    from export.tokenizer import write_tokenizer

    src = tmp_path / "src"
    shutil.copytree(tiny_llama_dir, src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    ck = load_hf_dir(src)
    out = tmp_path / "out"
    out.mkdir()
    tf = write_tokenizer(ck, out)
    assert tf.eos == (2, 0) and tf.chat_template == "DEFAULT"
    # the same tokenizer, its merges written as "a b" strings (compact_merges)
    assert Tokenizer.from_file(str(out / "tokenizer.json")).to_str() == Tokenizer.from_file(
        str(src / "tokenizer.json")).to_str()


def test_merges_become_strings_unless_a_half_has_a_space():
    """compact_merges keeps every merge, in order, and leaves alone what only the pair form can spell."""
    from export.tokenizer import compact_merges

    cfg = {"model": {"type": "BPE", "merges": [["a", "b"], ["ab", "c"]]}}
    assert compact_merges(cfg) and cfg["model"]["merges"] == ["a b", "ab c"]
    spaced = {"model": {"type": "BPE", "merges": [["a", "b"], [" ", " "]]}}
    assert not compact_merges(spaced) and spaced["model"]["merges"] == [["a", "b"], [" ", " "]]
    assert not compact_merges({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}})


def test_a_compacted_tokenizer_encodes_as_the_original(tmp_path, tiny_llama_dir):
    """Written back with its merges as strings, a tokenizer gives the same ids and text."""
    from export.tokenizer import compact_merges, write_tokenizer_json

    cfg = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
    assert compact_merges(cfg)
    write_tokenizer_json(cfg, tmp_path / "t.json")
    a, b = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")), Tokenizer.from_file(str(tmp_path / "t.json"))
    for text in ["Hello world", "  spaces\tand\nlines ", "ünïcødé 中文 🙂", "<|im_start|>user"]:
        assert a.encode(text).ids == b.encode(text).ids
        assert a.decode(a.encode(text).ids) == b.decode(b.encode(text).ids)
