"""Tokenizer files for an export: a `tokenizer.json` the runtime's `tokenizers` can read, plus chat template and
special token ids. From a Hugging Face directory it is copied; from a GGUF it is built from the GGUF's vocabulary:
a SentencePiece-BPE vocabulary of an architecture in `SPM_BPE_ARCHS` by `export.spm` (tokenizing as llama.cpp
does), any other by transformers' GGUF tokenizer converter (tokenizer only: no torch, no hub)."""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import Checkpoint, CheckpointError
from .gguf_read import GGUFFormatError, read_gguf

# GGUF architectures whose "llama" (SentencePiece) vocabulary is BPE: transformers' converter builds a Unigram model
# from their scores, which splits words into near-characters; export.spm builds the BPE model llama.cpp runs
SPM_BPE_ARCHS = frozenset({"gemma3"})
# GGUF architectures transformers' GGUF loader keeps as the model type (its converter table is keyed by model type)
_SAME_NAME_ARCHS = frozenset({"llama", "qwen2"})


@dataclass(frozen=True)
class TokenizerFiles:
    chat_template: str | None
    bos: int | None
    eos: tuple[int, ...]
    pad: int | None


def _hf_chat_template(d: Path) -> str | None:
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(t, list):  # named templates: take "default"
            t = next((x["template"] for x in t if x.get("name") == "default"), None)
        return t
    return None


def hf_tokenizer_files(src: Path, out_dir: Path, cfg: dict) -> TokenizerFiles:
    """Copy a Hugging Face directory's tokenizer.json; chat template and special ids from its config files."""
    tj = src / "tokenizer.json"
    if not tj.is_file():
        raise CheckpointError(f"{src}: no tokenizer.json (the runtime reads fast-tokenizer files only; "
                              "save one with AutoTokenizer.from_pretrained(...).save_pretrained(dir))")
    cfg_tok = json.loads(tj.read_text(encoding="utf-8"))
    if compact_merges(cfg_tok):
        write_tokenizer_json(cfg_tok, out_dir / "tokenizer.json")
    else:
        shutil.copyfile(tj, out_dir / "tokenizer.json")
        write_compact_tables(out_dir / "tokenizer.json", cfg_tok)
    eos = cfg.get("eos_token_id")
    gen = src / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        if e is not None:
            eos = e
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return TokenizerFiles(_hf_chat_template(src), cfg.get("bos_token_id"), eos, cfg.get("pad_token_id"))


def compact_merges(cfg: dict) -> bool:
    """Rewrite a parsed tokenizer.json's BPE merges from ["a", "b"] pairs to "a b" strings, the older form
    `tokenizers` still reads: the same merges in the same order, parsed with less than half the transient memory
    (Gemma 3's 515k merges: a 340 MB peak above the process becomes 160 MB; the tokenizer then holds the same
    ~96 MB). Not when a merge has a space in either half (only the pair form can spell it). Returns whether it did."""
    model = cfg.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not merges or not all(isinstance(m, list) and len(m) == 2 for m in merges):
        return False
    if any(" " in a or " " in b for a, b in merges):
        return False
    model["merges"] = [f"{a} {b}" for a, b in merges]
    return True


def write_tokenizer_json(cfg: dict, out: Path) -> None:
    """`cfg` as one line of UTF-8 JSON, as `Tokenizer.save(pretty=False)` writes it, and the runtime's compact
    tables beside it where they apply."""
    out.write_text(json.dumps(cfg, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
    write_compact_tables(out, cfg)


def write_compact_tables(tokenizer_json: Path, cfg: dict) -> bool:
    """`edge.bpe`'s tables beside `tokenizer_json` (parsed as `cfg`), for a SentencePiece-style BPE vocabulary, kept
    only when they tokenize and decode the check texts exactly as the tokenizers library reads the file. The runtime
    then holds Gemma 3's vocabulary in ~12 MB instead of ~93. Returns whether they were written."""
    from tokenizers import Tokenizer

    from edge.bpe import load_beside, tables_path, write_tables

    out = tables_path(tokenizer_json)
    if out.exists():  # tables of an earlier tokenizer.json
        out.unlink()
    if not write_tables(cfg, tokenizer_json, out):
        return False
    compact, lib = load_beside(tokenizer_json), Tokenizer.from_file(str(tokenizer_json))
    plain = compact.without_control()

    def same(text: str) -> bool:
        lib.encode_special_tokens = False
        want, got = lib.encode(text, add_special_tokens=True), compact.encode(text, add_special_tokens=True)
        if got.ids != want.ids or got.offsets != want.offsets:
            return False
        if compact.decode(want.ids) != lib.decode(want.ids, skip_special_tokens=False):
            return False
        lib.encode_special_tokens = True
        return plain.encode(text, add_special_tokens=False).ids == lib.encode(text, add_special_tokens=False).ids

    for text in _check_texts(compact):
        if not same(text):
            out.unlink()
            print(f"note: {out.name} not written: it encodes {text[:40]!r} unlike tokenizer.json; the runtime reads "
                  "tokenizer.json with the tokenizers library", file=sys.stderr)
            return False
    return True


def _check_texts(tok) -> list[str]:
    """Prose, code, text outside the vocabulary and every added token inside text."""
    from .calibration import PARITY_TEXTS, PROMPTS

    added = [t.content for t in tok.get_added_tokens_decoder().values()]
    mixed = "Grüße, 世界! naïve café — ∑ x² 😀 \t\r\n  spaced   out\u00a0end"
    return (list(PROMPTS) + list(PARITY_TEXTS) + [mixed]
            + ["".join(f"a{t} {t}b" for t in added[k:k + 64]) for k in range(0, len(added), 64)])


def write_tokenizer(ck: Checkpoint, out_dir: Path) -> TokenizerFiles:
    out = out_dir / "tokenizer.json"
    src = Path(ck.source)
    if ck.source_format == "hf":
        return hf_tokenizer_files(src, out_dir, json.loads((src / "config.json").read_text()))

    try:
        f = read_gguf(src, tensors=False).fields  # metadata only: the vocabulary is read once, here
    except (OSError, GGUFFormatError) as e:
        raise CheckpointError(f"{src}: cannot read the GGUF's tokenizer ({e})") from e
    if f.get("general.architecture") in SPM_BPE_ARCHS and f.get("tokenizer.ggml.model") == "llama":
        from .spm import SpmVocabError, spm_tokenizer

        try:
            backend = spm_tokenizer(f)
        except SpmVocabError as e:
            raise CheckpointError(f"{src}: {e}") from e
    else:
        backend = _gguf_backend_tokenizer(src, f)
        if not f.get("tokenizer.ggml.add_bos_token", False):
            from tokenizers import processors

            # the GGUF says no BOS; transformers' converter adds one in its post-processor regardless
            backend.post_processor = processors.ByteLevel(trim_offsets=False)
    cfg_tok = json.loads(backend.to_str())
    compact_merges(cfg_tok)
    write_tokenizer_json(cfg_tok, out)
    eos = f.get("tokenizer.ggml.eos_token_id")
    return TokenizerFiles(
        chat_template=f.get("tokenizer.chat_template"),
        bos=f.get("tokenizer.ggml.bos_token_id"),
        eos=(int(eos),) if eos is not None else (),
        pad=f.get("tokenizer.ggml.padding_token_id"),
    )


def _gguf_backend_tokenizer(src: Path, fields: dict | None = None):
    """transformers' converter, called directly: `AutoTokenizer.from_pretrained(gguf_file=...)` refuses to run
    without torch although reading the metadata needs none, and the first-run export must not pull in torch.
    For an architecture whose transformers model type is its own name the converter is given the tokenizer fields
    read here (`fields`, or read now), renamed by transformers' own table, instead of letting transformers open the
    file again with `gguf.GGUFReader` (seconds more on a large vocabulary)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch not found" banner on a runtime install
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.integrations.ggml import convert_gguf_tokenizer
    except ImportError as e:
        raise CheckpointError("converting a GGUF tokenizer needs transformers: pip install 'transformers<5'") from e
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if fields is None:
        try:
            fields = read_gguf(src, tensors=False).fields
        except (OSError, GGUFFormatError) as e:
            raise CheckpointError(f"{src}: cannot read the GGUF's tokenizer ({e})") from e
    arch = fields.get("general.architecture")
    if arch in _SAME_NAME_ARCHS:
        tokenizer = {}
        for key, name in gguf_utils.GGUF_TO_TRANSFORMERS_MAPPING["tokenizer"]["tokenizer"].items():
            value = fields.get("tokenizer." + key)
            if value is None or name is None or name == -1:
                continue
            if isinstance(value, np.ndarray):
                value = value.tolist()
            if isinstance(value, list) and len(value) == 1:  # as transformers' reader unwraps one-item arrays
                value = value[0]
            tokenizer[name] = value
        return convert_gguf_tokenizer(arch, tokenizer)[0]
    real = gguf_utils.is_torch_available
    gguf_utils.is_torch_available = lambda: True  # only guards an import; return_tensors=False touches no torch
    try:
        meta = gguf_utils.load_gguf_checkpoint(str(src), return_tensors=False)
    finally:
        gguf_utils.is_torch_available = real
    arch = meta["config"].get("model_type", "llama")
    backend, _ = convert_gguf_tokenizer(arch, meta["tokenizer"])
    return backend
