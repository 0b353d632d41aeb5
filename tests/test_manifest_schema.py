"""Tampered model directories: an `edge_model.json` edited by hand or by an attacker, symbolic links out of the
directory, a damaged graph. Each is refused when the directory is loaded, with one ModelDirError naming the field (or
file) and the command that rebuilds the directory; never another directory's files, never the size of a file outside
it, never a raw TypeError, MemoryError or RecursionError, and never a model that loads and then refuses every prompt.
A private copy of the session export is tampered with."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

import edge
from edge import ModelDirError
from edge.manifest import MANIFEST_NAME, MAX_DEPTH, MAX_MANIFEST_BYTES, load_manifest

DELETE = object()


def read(d) -> dict:
    return json.loads((d / MANIFEST_NAME).read_text())


def write(d, raw) -> None:
    (d / MANIFEST_NAME).write_text(json.dumps(raw))


def tamper(d, dotted: str, value) -> None:
    """Set (or with DELETE remove) one field of d's manifest: "graphs.0.max_len", "files.3.path"."""
    raw = read(d)
    *parents, last = dotted.split(".")
    node = raw
    for k in parents:
        node = node[int(k)] if isinstance(node, list) else node[k]
    key = int(last) if isinstance(node, list) else last
    if value is DELETE:
        del node[key]
    else:
        node[key] = value
    write(d, raw)


def refused(d, needle: str, verify: str = "none", load=load_manifest) -> str:
    """Loading d fails with one line naming `needle` and the command that rebuilds d."""
    with pytest.raises(ModelDirError) as ei:
        load(d, verify=verify)
    msg = str(ei.value)
    assert "\n" not in msg and needle in msg, msg
    assert re.search(rf"edge-export \S+ -o {re.escape(str(d))}", msg), msg
    return msg


def full_arch(**changes) -> dict:
    return {"family": "llama", "hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "head_dim": 16,
            "intermediate": 128, "vocab": 384, **changes}


# the session export's manifest: graphs[0] the target, graphs[1] the drafter; files sorted by path, so files[3] is
# target/model.onnx and files[5] tokenizer.json
TAMPERED = [
    # (field, tampered value, what the message names)
    ("name", 5, "name"),
    ("arch", "llama", "arch"),
    ("arch", DELETE, "arch is missing"),
    ("arch.hidden", "64", "arch.hidden"),
    ("arch.hidden", -64, "arch.hidden"),
    ("arch.hidden", 10 ** 12, "arch.hidden"),
    ("arch.layers", 3.0, "arch.layers"),
    ("arch.layers", 0, "arch.layers"),
    ("arch.layers", 10 ** 6, "arch.layers"),
    ("arch.heads", None, "arch.heads"),
    ("arch.heads", -4, "arch.heads"),
    ("arch.heads", 1 << 20, "arch.heads"),
    ("arch.kv_heads", True, "arch.kv_heads"),
    ("arch.kv_heads", -2, "arch.kv_heads"),
    ("arch.kv_heads", 1_000_000, "arch.kv_heads"),  # was a 57.2 TiB KV buffer: MemoryError
    ("arch.kv_heads", 3, "a divisor of arch.heads"),
    ("arch.kv_heads", DELETE, "arch.kv_heads is missing"),
    ("arch.head_dim", "16", "arch.head_dim"),
    ("arch.head_dim", 0, "arch.head_dim"),
    ("arch.head_dim", 1 << 20, "arch.head_dim"),
    ("arch.head_dim", 1024, "arch.heads × arch.head_dim"),  # 4096 query dims from a 64-wide model
    ("arch.intermediate", [128], "arch.intermediate"),
    ("arch.intermediate", -1, "arch.intermediate"),
    ("arch.vocab", "384", "arch.vocab"),
    ("arch.vocab", 0, "arch.vocab"),
    ("arch.vocab", 1 << 40, "arch.vocab"),
    ("graphs", {}, "graphs"),
    ("graphs", [], "graphs"),
    ("graphs.0", "target", "graphs[0]"),
    ("graphs.0.role", "boss", "graphs[0].role"),
    ("graphs.0.role", "drafter", "no graph with role 'target'"),
    ("graphs.1.role", "target", "graphs[1].role"),
    ("graphs.0.name", 7, "graphs[0].name"),
    ("graphs.1.name", "target", "graphs[1].name"),
    ("graphs.0.file", "/etc/passwd", "graphs[0].file"),
    ("graphs.0.file", "../other/target/model.onnx", "graphs[0].file"),
    ("graphs.0.file", "target/../../other/target/model.onnx", "graphs[0].file"),
    ("graphs.0.file", "..\\other\\target\\model.onnx", "graphs[0].file"),
    ("graphs.0.file", "C:/models/target/model.onnx", "graphs[0].file"),
    ("graphs.0.file", "", "graphs[0].file"),
    ("graphs.0.file", 7, "graphs[0].file"),
    ("graphs.0.file", DELETE, "graphs[0].file"),
    ("graphs.0.layers", "3", "graphs[0].layers"),
    ("graphs.0.layers", 3.0, "graphs[0].layers"),
    ("graphs.0.layers", 4, "graphs[0].layers"),
    ("graphs.1.layers", 0, "graphs[1].layers"),
    ("graphs.1.layers", 4, "graphs[1].layers"),  # more layers than the model has
    ("graphs.0.vocab", -1, "graphs[0].vocab"),
    ("graphs.0.vocab", 10 ** 9, "graphs[0].vocab"),
    ("graphs.1.vocab", "128", "graphs[1].vocab"),
    ("graphs.1.vocab", 1 << 40, "graphs[1].vocab"),
    ("graphs.0.precision", "fp64", "graphs[0].precision"),
    ("graphs.0.precision", 4, "graphs[0].precision"),
    ("graphs.0.block_size", -32, "graphs[0].block_size"),
    ("graphs.0.block_size", "32", "graphs[0].block_size"),
    ("graphs.0.accuracy_level", 9, "graphs[0].accuracy_level"),
    ("graphs.0.lm_head_bits", -1, "graphs[0].lm_head_bits"),
    ("graphs.0.w8a8_kernel", "s8s8", "graphs[0].w8a8_kernel"),
    ("graphs.0.embedding_bits", 99, "graphs[0].embedding_bits"),
    ("graphs.0.block_min", "yes", "graphs[0].block_min"),
    ("graphs.0.max_len", -1, "graphs[0].max_len"),  # loaded, then refused every prompt
    ("graphs.0.max_len", 0, "graphs[0].max_len"),
    ("graphs.0.max_len", "256", "graphs[0].max_len"),
    ("graphs.0.max_len", 1 << 40, "graphs[0].max_len"),
    ("graphs.0.max_len", DELETE, "graphs[0].max_len is missing"),
    ("graphs.1.max_len", -1, "graphs[1].max_len"),
    ("graphs.0.kv_dtype", "int4", "graphs[0].kv_dtype"),
    ("graphs.0.tree_capable", 1, "graphs[0].tree_capable"),
    ("graphs.0.io", "tensorrt", "graphs[0].io"),
    ("graphs.0.weight_bytes", -1, "graphs[0].weight_bytes"),
    ("graphs.0.stats", [], "graphs[0].stats"),
    ("graphs.1.id_map", "/etc/passwd", "graphs[1].id_map"),
    ("graphs.1.id_map", "../other/drafter-l1-v128/id_map.npy", "graphs[1].id_map"),
    ("graphs.1.id_map", 5, "graphs[1].id_map"),
    ("graphs.1.arch", "big", "graphs[1].arch"),
    ("graphs.1.arch", full_arch(kv_heads=1_000_000), "graphs[1].arch.kv_heads"),
    ("graphs.1.arch", full_arch(vocab=-1), "graphs[1].arch.vocab"),
    ("files", "everything", "files"),
    ("files.3", "target/model.onnx", "files[3]"),
    ("files.3.path", "/etc/shadow", "files[3].path"),
    ("files.3.path", "../../../etc/shadow", "files[3].path"),
    ("files.3.path", None, "files[3].path"),
    ("files.3.bytes", -1, "files[3].bytes"),
    ("files.3.bytes", "11289", "files[3].bytes"),
    ("files.3.sha256", "0" * 63, "files[3].sha256"),
    ("files.3.sha256", 5, "files[3].sha256"),
    ("tokenizer", "/etc/passwd", "tokenizer"),
    ("tokenizer", "../other/tokenizer.json", "tokenizer"),
    ("tokenizer", None, "tokenizer"),
    ("tokenizer", DELETE, "tokenizer is missing"),
    ("chat_template", 5, "chat_template"),
    ("special_tokens", [], "special_tokens"),
    ("special_tokens.bos", "1", "special_tokens.bos"),
    ("special_tokens.bos", -1, "special_tokens.bos"),
    ("special_tokens.bos", 10 ** 6, "special_tokens.bos"),
    ("special_tokens.eos", 2, "special_tokens.eos"),
    ("special_tokens.eos", ["2"], "special_tokens.eos[0]"),
    ("special_tokens.eos", [2, 10 ** 6], "special_tokens.eos[1]"),
    ("special_tokens.pad", "x", "special_tokens.pad"),
    ("source", "x", "source"),
    ("source.path", "/src\nedge-export --evil", "source.path"),
    ("converter", 5, "converter"),
    ("parity", [], "parity"),
]


@pytest.mark.parametrize("field,value,named", TAMPERED,
                         ids=[f"{f}={'DELETE' if v is DELETE else repr(v)[:30]}" for f, v, _ in TAMPERED])
def test_a_tampered_manifest_field_is_refused_naming_it(model_copy, field, value, named):
    """verify="none" (what edge-chat --plan reads with): the manifest alone is refused, before any file is opened."""
    tamper(model_copy, field, value)
    refused(model_copy, named)


def test_the_intact_export_passes_the_same_checks(model_copy, exported_llama):
    assert load_manifest(model_copy, verify="sha256") == exported_llama[1]


@pytest.mark.parametrize("rel", ["target/model.onnx", "drafter-l1-v128/id_map.npy", "tokenizer.json"])
def test_a_file_the_manifest_loads_must_be_listed_so_it_is_verified(model_copy, rel):
    raw = read(model_copy)
    raw["files"] = [f for f in raw["files"] if f["path"] != rel]
    write(model_copy, raw)
    assert "not listed in files" in refused(model_copy, rel)


def test_another_directorys_graph_and_tokenizer_are_not_loaded(model_copy, tmp_path, exported_llama):
    """A manifest pointing into a sibling export (its files listed with their true sizes and digests) was loaded
    and answered from it."""
    shutil.copytree(exported_llama[0], tmp_path / "other")
    raw = read(model_copy)
    raw["graphs"][0]["file"] = "../other/target/model.onnx"
    raw["tokenizer"] = "../other/tokenizer.json"
    for f in raw["files"]:
        if f["path"] in ("target/model.onnx", "target/model.onnx.data", "tokenizer.json"):
            f["path"] = "../other/" + f["path"]
    write(model_copy, raw)
    refused(model_copy, "graphs[0].file", verify="fast", load=edge.load)


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_files_outside_the_directory_are_never_sized(model_copy, tmp_path, how):
    """A `files` entry reaching outside the directory made the size check an oracle (`/etc/shadow: 631 bytes`)."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 631)
    raw = read(model_copy)
    rel = {"absolute": str(secret), "dotdot": "../secret", "symlink": "notes.txt"}[how]
    if how == "symlink":
        (model_copy / "notes.txt").symlink_to(secret)
    raw["files"].append({"path": rel, "bytes": 1, "sha256": "0" * 64})
    write(model_copy, raw)
    msg = refused(model_copy, "files[6].path", verify="size")
    assert "631" not in msg


@pytest.mark.parametrize("link,named", [
    ("target/model.onnx", "graphs[0].file"),
    ("target/model.onnx.data", "graphs[0].file's external data"),
    ("target", "graphs[0].file"),  # a directory on the way
    ("drafter-l1-v128/id_map.npy", "graphs[1].id_map"),
    ("tokenizer.json", "tokenizer"),
])
def test_a_symbolic_link_out_of_the_directory_is_refused(model_copy, tmp_path, link, named):
    """The same bytes (size and digest agree) reached through a link to another directory are refused at every
    verification level."""
    outside = tmp_path / "elsewhere" / link
    outside.parent.mkdir(parents=True)
    shutil.move(model_copy / link, outside)
    (model_copy / link).symlink_to(outside, target_is_directory=outside.is_dir())
    for verify in ("none", "sha256"):
        assert "outside the model directory" in refused(model_copy, named, verify=verify)


def test_a_manifest_that_is_a_link_out_of_the_directory_is_refused(model_copy, tmp_path):
    outside = tmp_path / "elsewhere.json"
    shutil.move(model_copy / MANIFEST_NAME, outside)
    (model_copy / MANIFEST_NAME).symlink_to(outside)
    refused(model_copy, MANIFEST_NAME)


def test_links_that_stay_inside_the_directory_still_load(model_copy, tmp_path):
    (model_copy / "shared").mkdir()
    shutil.move(model_copy / "tokenizer.json", model_copy / "shared" / "tokenizer.json")
    (model_copy / "tokenizer.json").symlink_to(model_copy / "shared" / "tokenizer.json")
    (tmp_path / "link").symlink_to(model_copy, target_is_directory=True)  # the directory itself reached by a link
    e = edge.load(tmp_path / "link", drafter="none", context=64)
    assert e.generate("hello", max_tokens=2).token_ids


# ----------------------------------------------------------------------------- the manifest's JSON itself

def test_deeply_nested_json_is_refused_without_a_recursion_error(model_copy):
    (model_copy / MANIFEST_NAME).write_text("[" * 100_000 + "]" * 100_000)
    assert "nested" in refused(model_copy, MANIFEST_NAME)


def test_nesting_within_json_limits_but_beyond_any_manifest_is_refused(model_copy):
    """Deep enough to load, and to exhaust the recursion limit later (asdict, json.dumps)."""
    deep: dict = {}
    for _ in range(MAX_DEPTH + 1):
        deep = {"x": deep}
    tamper(model_copy, "graphs.0.stats", deep)
    assert "nested" in refused(model_copy, MANIFEST_NAME)


def test_a_manifest_larger_than_any_export_writes_is_refused(model_copy):
    text = json.dumps(read(model_copy))
    (model_copy / MANIFEST_NAME).write_text(text[:-1] + " " * MAX_MANIFEST_BYTES + "}")  # valid JSON, all padding
    assert "larger than any manifest" in refused(model_copy, MANIFEST_NAME)


# ----------------------------------------------------------------------------- the graph behind the manifest

def test_a_damaged_graph_with_its_size_intact_names_the_file(model_copy):
    """verify="size" cannot see same-size damage; ONNX Runtime's InvalidProtobuf was the error."""
    p = model_copy / "target" / "model.onnx"
    p.write_bytes(b"\xff" * p.stat().st_size)
    msg = refused(model_copy, "target/model.onnx", verify="size", load=edge.load)
    assert "ONNX Runtime cannot load" in msg


def test_truncated_external_data_unverified_names_the_file(model_copy):
    p = model_copy / "target" / "model.onnx.data"
    p.write_bytes(p.read_bytes()[:1000])
    refused(model_copy, "target/model.onnx", verify="none", load=edge.load)


def test_a_damaged_drafter_graph_is_refused_on_first_use(model_copy):
    p = model_copy / "drafter-l1-v128" / "model.onnx"
    p.write_bytes(b"\xff" * p.stat().st_size)
    e = edge.load(model_copy, drafter="model", context=64, verify="size")
    with pytest.raises(ModelDirError, match=r"drafter-l1-v128/model\.onnx: ONNX Runtime cannot load.*edge-export"):
        e.generate("hello", max_tokens=2)


@pytest.mark.parametrize("changes,named", [
    ({"arch.kv_heads": 4}, "arch.kv_heads"),  # consistent in itself (4 heads), but the graph has 2
    ({"arch.head_dim": 32}, "arch.head_dim"),
    ({"arch.layers": 4, "graphs.0.layers": 4}, "graphs[0].layers"),
    ({"arch.vocab": 400, "graphs.0.vocab": 400}, "graphs[0].vocab"),
    ({"graphs.0.kv_dtype": "int8"}, "graphs[0].kv_dtype"),  # a float-cache graph said to hold int8 codes
])
def test_a_manifest_that_does_not_describe_its_graph_is_refused_before_allocating(model_copy, changes, named):
    for field, value in changes.items():
        tamper(model_copy, field, value)
    msg = refused(model_copy, named, verify="none", load=edge.load)
    assert "does not describe this graph" in msg


def test_a_damaged_tokenizer_with_its_size_intact_names_the_file(model_copy):
    p = model_copy / "tokenizer.json"
    p.write_bytes(b"\xff" * p.stat().st_size)
    assert "tokenizer unreadable" in refused(model_copy, "tokenizer.json", verify="size", load=edge.load)


# ----------------------------------------------------------------------------- what still loads

OPTIONAL_GRAPH_KEYS = ("block_size", "accuracy_level", "lm_head_bits", "w8a8_kernel", "embedding_bits", "block_min",
                       "kv_dtype", "tree_capable", "io", "arch", "weight_bytes", "stats")


def test_a_manifest_from_before_the_optional_fields_still_loads(model_copy):
    """A format-1 manifest an older exporter wrote, without the fields added since (their defaults apply)."""
    raw = read(model_copy)
    for g in raw["graphs"]:
        for key in OPTIONAL_GRAPH_KEYS:
            del g[key]
    raw["arch"] = {k: raw["arch"][k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate",
                                               "vocab")}
    raw["special_tokens"] = {"bos": 1, "eos": [2]}
    del raw["parity"]
    write(model_copy, raw)
    e = edge.load(model_copy, drafter="model", context=64)
    assert e.generate("hello", max_tokens=3).token_ids


def test_an_optimum_export_without_hidden_sizes_passes_the_schema(model_copy):
    """--via optimum reads hidden and intermediate off config.json, which may not name them (written as 0)."""
    raw = read(model_copy)
    raw["graphs"] = raw["graphs"][:1]
    raw["graphs"][0].update(io="optimum", tree_capable=False)
    raw["arch"].update(hidden=0, intermediate=0)
    write(model_copy, raw)
    assert load_manifest(model_copy, verify="none").target.io == "optimum"
    tamper(model_copy, "graphs.0.io", "edgespec")  # our own graphs always know them
    refused(model_copy, "arch.hidden")


def test_a_missing_file_is_no_escape_when_files_are_not_verified(model_copy):
    """verify="none" tolerates a missing file (edge-chat --plan reads the manifest alone); it is not an escape."""
    os.unlink(model_copy / "target" / "model.onnx.data")
    assert load_manifest(model_copy, verify="none").target.file == "target/model.onnx"
