"""`edge_model.json` (edge/manifest.py): what the exporter writes, the write → load round trip, and the load-time
checks that make a stale, modified, truncated or foreign model directory fail with the file and the fix named: what
is (and is not) an export, the rebuild command, a drafter's vocabulary and id map."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from conftest import BOS, CHAT_TEMPLATE, EOS, MAX_LEN, TINY_EXPORT_DRAFTER, VOCAB
from edge.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, ModelDirError, load_manifest


def edit_manifest(d, **changes):
    raw = json.loads((d / MANIFEST_NAME).read_text())
    raw.update(changes)
    (d / MANIFEST_NAME).write_text(json.dumps(raw))
    return raw


# ----------------------------------------------------------------------------- what the exporter writes

def test_manifest_contents(exported_llama, tiny_llama_dir):
    d, m = exported_llama
    a = m.arch
    assert m.format_version == 1 < FORMAT_VERSION  # nothing format 2 adds: older edgespec versions can load it
    assert (a["layers"], a["heads"], a["kv_heads"], a["head_dim"], a["hidden"], a["vocab"]) == (3, 4, 2, 16, 64, VOCAB)
    assert [g.role for g in m.graphs] == ["target", "drafter"]
    t = m.target
    assert (t.layers, t.vocab, t.precision, t.max_len, t.kv_dtype, t.lm_head_bits) == (3, VOCAB, "fp32", MAX_LEN,
                                                                                      "float32", 0)
    assert m.drafters[0].vocab == TINY_EXPORT_DRAFTER[1] and m.drafters[0].id_map.endswith("id_map.npy")
    assert m.kv_bytes_per_token(t) == 2 * 3 * 2 * 16 * 4
    assert m.tokenizer == "tokenizer.json" and (d / m.tokenizer).is_file()
    assert m.chat_template == CHAT_TEMPLATE
    assert m.special_tokens["bos"] == BOS and m.special_tokens["eos"] == [EOS]
    assert m.source["format"] == "hf" and m.source["path"] == str(tiny_llama_dir.resolve())
    assert {"onnx", "onnxruntime", "numpy"} <= set(m.converter)
    # the parity report: fp32 must agree on every top-1 and within 1e-3
    assert m.parity["top1_agreement"] == 1.0 and m.parity["max_abs_diff"] <= 1e-3 and m.parity["positions"] > 0


def test_files_listed_with_true_sizes_and_digests(exported_llama):
    d, m = exported_llama
    on_disk = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert {f.path for f in m.files} == on_disk
    for f in m.files:
        p = d / f.path
        assert p.stat().st_size == f.bytes
        assert hashlib.sha256(p.read_bytes()).hexdigest() == f.sha256, f.path
    for g in m.graphs:
        assert g.weight_bytes == (d / g.file).stat().st_size + (d / (g.file + ".data")).stat().st_size
    assert not list(d.parent.glob(d.name + ".partial")) and not list(d.parent.glob(d.name + ".old"))


def test_round_trip_write_load(exported_llama, tmp_path):
    d, m = exported_llama
    assert load_manifest(d, verify="sha256") == m
    m.write(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
    back = load_manifest(tmp_path, verify="none")
    assert back == m
    assert Manifest.from_dict(json.loads(m.to_json())) == m


def test_unknown_keys_are_ignored(model_copy):
    """A manifest from a newer exporter with the same format version may add fields."""
    edit_manifest(model_copy, future_field={"x": 1})
    assert load_manifest(model_copy).name
    doc = json.loads((model_copy / MANIFEST_NAME).read_text())  # in every file entry too
    for f in doc["files"]:
        f["mode"] = "0644"
    (model_copy / MANIFEST_NAME).write_text(json.dumps(doc))
    assert load_manifest(model_copy).files


@pytest.mark.parametrize("graphs", [["x"], [1], [None]])
def test_a_graph_entry_that_is_not_an_object_is_a_clear_error(model_copy, graphs):
    """It was an AttributeError traceback out of edge-chat."""
    edit_manifest(model_copy, graphs=graphs)
    with pytest.raises(ModelDirError, match="malformed manifest"):
        load_manifest(model_copy, verify="none")


# ----------------------------------------------------------------------------- load-time checks

def test_sha256_catches_a_modified_file(model_copy):
    data = model_copy / "target" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, different content
    data.write_bytes(bytes(raw))
    load_manifest(model_copy, verify="size")  # a size check cannot see it
    with pytest.raises(ModelDirError, match=r"model\.onnx\.data.*sha256.*re-run edge-export"):
        load_manifest(model_copy, verify="sha256")


def test_size_check_catches_truncation(model_copy):
    data = model_copy / "drafter-l1-v128" / "model.onnx.data"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 1)
    with pytest.raises(ModelDirError, match=r"model\.onnx\.data.*bytes.*truncated"):
        load_manifest(model_copy, verify="size")


def test_missing_listed_file(model_copy):
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelDirError, match=r"tokenizer\.json.*missing"):
        load_manifest(model_copy)


@pytest.mark.parametrize("version,fix", [(FORMAT_VERSION + 1, "upgrade edgespec"), (0, "re-export"),
                                         ("1", "re-export"), (None, "re-export")])
def test_format_version_mismatch(model_copy, version, fix):
    edit_manifest(model_copy, format_version=version)
    with pytest.raises(ModelDirError, match=f"manifest format.*{fix}"):
        load_manifest(model_copy, verify="none")


def test_missing_manifest_names_reexport(model_copy, tmp_path):
    """No manifest: an empty directory (or one an interrupted swap left) can be exported into again; one holding
    other files would be refused by edge-export, so the advice is a new directory."""
    (model_copy / MANIFEST_NAME).unlink()
    with pytest.raises(ModelDirError, match=r"edge_model\.json: missing.*new directory.*damaged export"):
        load_manifest(model_copy)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelDirError, match=r"edge_model\.json: missing.*re-run edge-export into it"):
        load_manifest(empty)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelDirError, match="no such model directory.*edge-export"):
        load_manifest(tmp_path / "nope")


@pytest.mark.parametrize("damage", ["not json", "no graphs", "graph without role", "files not a list"])
def test_malformed_manifest(model_copy, damage):
    path = model_copy / MANIFEST_NAME
    raw = json.loads(path.read_text())
    if damage == "not json":
        path.write_text("{ truncated")
    else:
        if damage == "no graphs":
            del raw["graphs"]
        elif damage == "graph without role":
            del raw["graphs"][0]["role"]
        else:
            raw["files"] = [["tokenizer.json", 1, "x"]]
        path.write_text(json.dumps(raw))
    with pytest.raises(ModelDirError, match="re-run edge-export"):
        load_manifest(model_copy)


@pytest.mark.parametrize("block_min", [True, False])
def test_int4_manifest_records_block_minimums_and_the_footprint_explains_the_file(tmp_path, tiny_llama_dir, block_min):
    """The manifest says whether 4-bit layers keep their float block minimums, and memory.footprint's prediction
    from that entry explains the target file (no unexplained bytes beyond the graph structure's estimate)."""
    from conftest import tiny_export_options
    from export.pipeline import export_model
    from memory.footprint import predict_weight_bytes

    m = export_model(tiny_llama_dir, tmp_path / "out", tiny_export_options(precision="int4", block_min=block_min,
                                                                          parity=False), progress=False)
    for g in m.graphs:
        assert g.block_min is block_min
    t = m.target

    def off(flag):  # bytes the prediction from this entry, with that flag, does not explain
        return abs(predict_weight_bytes(m.arch_of(t), layers=t.layers, vocab=t.vocab, precision="int4",
                                        lm_head_bits=t.lm_head_bits, max_len=t.max_len,
                                        embedding_bits=t.embedding_bits, block_min=flag,
                                        head_rescore=t.head_rescore, kv_int8=t.kv_dtype == "int8").total
                   - t.weight_bytes)

    # right flag: only the graph structure's estimate is off; the other one misses or invents the residual blocks
    assert t.head_rescore > 0  # the tied 8-bit head is two-stage, and the prediction follows it
    assert off(block_min) < off(not block_min) / 10  # measured: 3.6 KB (the proto estimate) against 60 KB


# ----------------------------------------------------------------------------- bad directories, the rebuild command

def test_directory_with_only_a_config_json_is_not_called_a_checkpoint(tmp_path):
    """A directory holding only a config.json (or only safetensors) is no checkpoint: it gets the "not a complete
    edgespec export" message, not the advice to export it as a checkpoint."""
    d = tmp_path / "stuff"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(ModelDirError) as ei:
        load_manifest(d)
    assert "holds a model checkpoint" not in str(ei.value) and "not a complete edgespec export" in str(ei.value)


def test_a_file_given_as_the_model_dir_says_so(tmp_path):
    """A model directory that is a file (model.onnx, the manifest itself) is called a file, not "no such model
    directory"."""
    f = tmp_path / "model.onnx"
    f.write_bytes(b"x")
    with pytest.raises(ModelDirError, match="is a file, not a model directory"):
        load_manifest(f)
    g = tmp_path / "model.Q4_1.gguf"  # a GGUF: the fix is to export it
    g.write_bytes(b"GGUF")
    with pytest.raises(ModelDirError, match=r"export it first: edge-export .*model.Q4_1.gguf -o DIR"):
        load_manifest(g)


def test_reexport_command_names_the_recorded_source_checkpoint(model_copy):
    """The fix every load error names is a runnable command with the checkpoint the export was built from (the
    manifest's source path), not a CHECKPOINT placeholder."""
    raw = json.loads((model_copy / MANIFEST_NAME).read_text())
    src = raw["source"]["path"]
    assert src
    victim = model_copy / raw["files"][0]["path"]
    victim.write_bytes(victim.read_bytes()[:-1])  # truncated
    with pytest.raises(ModelDirError) as ei:
        load_manifest(model_copy, verify="size")
    assert f"edge-export {src} -o {model_copy}" in str(ei.value), str(ei.value)


def test_a_boolean_format_version_is_not_format_1(model_copy):
    """JSON `true` is an int in Python (== 1) but not format 1: the manifest is damaged and refused with the
    re-export command."""
    raw = json.loads((model_copy / MANIFEST_NAME).read_text())
    raw["format_version"] = True
    (model_copy / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(ModelDirError, match="manifest format True"):
        load_manifest(model_copy, verify="none")


# ----------------------------------------------------------------------------- a drafter's vocabulary and id map

def test_zero_logit_drafter_with_an_empty_id_map_is_refused(tiny_dir, tmp_path):
    """A drafter with no logits (and an empty id map, which every later check passes vacuously) is refused at load
    time, not at its first draft."""
    import dataclasses

    import numpy as np

    from edge.manifest import check_drafter

    m = load_manifest(tiny_dir, verify="none")
    np.save(tmp_path / "empty.npy", np.zeros(0, np.int64))
    g = dataclasses.replace(m.drafters[0], vocab=0, id_map="empty.npy")
    with pytest.raises(ModelDirError, match="0-token vocabulary"):
        check_drafter(tmp_path, m, g)
    check_drafter(tiny_dir, m, m.drafters[0])  # the real one passes


@pytest.mark.parametrize("ids, why", [
    (lambda m, g: np.arange(g.vocab - 1, dtype=np.int64), "shorter than the drafter's logits"),
    (lambda m, g: np.arange(m.arch["vocab"] - g.vocab + 1, m.arch["vocab"] + 1, dtype=np.int64), "id == vocab"),
    (lambda m, g: np.arange(g.vocab, dtype=np.float64), "float ids"),
    (lambda m, g: np.arange(-1, g.vocab - 1, dtype=np.int64), "id -1"),
])
def test_id_map_off_by_one_is_refused(tiny_dir, tmp_path, ids, why):
    """Each of these id maps is refused: one entry short (logit index g.vocab - 1 has no token), one naming token id
    == vocab (one past the target's table), float ids (which cannot index token ids), and id -1 (which numpy would
    silently read as the last token)."""
    import dataclasses

    from edge.manifest import check_drafter

    m = load_manifest(tiny_dir, verify="none")
    g = m.drafters[0]
    np.save(tmp_path / "map.npy", ids(m, g))
    with pytest.raises(ModelDirError, match="drafter id map"):
        check_drafter(tmp_path, m, dataclasses.replace(g, id_map="map.npy"))
