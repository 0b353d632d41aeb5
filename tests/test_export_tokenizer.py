"""export/tokenizer.py: the tokenizer files an export writes, with the end tokens and chat template a checkpoint's
config files give."""
from __future__ import annotations

import json
import shutil

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
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
