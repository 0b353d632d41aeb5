"""Model-directory faults: each one is a single ModelDirError raised by `edge.load` (never mid-answer) that names
the damaged file and the command that rebuilds the directory. A private copy of the session export is damaged."""
from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest

import edge
from conftest import VOCAB
from edge import ModelDirError
from edge.manifest import FORMAT_VERSION, MANIFEST_NAME


def expect_load_error(d, file_part: str, **kw) -> str:
    """edge.load fails with one message naming `file_part` and a re-export command for this directory."""
    with pytest.raises(ModelDirError) as ei:
        edge.load(d, drafter="none", context=128, **kw)
    msg = str(ei.value)
    assert "\n" not in msg and file_part in msg, msg
    if "upgrade edgespec" not in msg:
        assert re.search(rf"edge-export \S+ -o {re.escape(str(d))}", msg), msg
    return msg


def rewrite_listed(d, rel: str) -> None:
    """Make the manifest agree with a file we replaced (an export that was built that way, not a damaged one)."""
    raw = json.loads((d / MANIFEST_NAME).read_text())
    p = d / rel
    for f in raw["files"]:
        if f["path"] == rel:
            f.update(bytes=p.stat().st_size, sha256=hashlib.sha256(p.read_bytes()).hexdigest())
    (d / MANIFEST_NAME).write_text(json.dumps(raw))


def edit_drafter(d, **changes) -> None:
    raw = json.loads((d / MANIFEST_NAME).read_text())
    raw["graphs"][1].update(changes)
    (d / MANIFEST_NAME).write_text(json.dumps(raw))


def test_intact_copy_loads(model_copy):
    e = edge.load(model_copy, drafter="model", context=128)
    assert e.generate("hello", max_tokens=3).token_ids


@pytest.mark.parametrize("rel", ["target/model.onnx", "target/model.onnx.data", "drafter-l1-v128/model.onnx"])
def test_missing_onnx_file(model_copy, rel):
    (model_copy / rel).unlink()
    msg = expect_load_error(model_copy, rel)
    assert "missing" in msg


@pytest.mark.parametrize("rel", ["target/model.onnx", "target/model.onnx.data"])
def test_truncated_onnx_file(model_copy, rel):
    p = model_copy / rel
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    assert "truncated" in expect_load_error(model_copy, rel)


def flip_middle_byte(p) -> None:
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only a digest can see it
    p.write_bytes(bytes(raw))


@pytest.mark.parametrize("rel", ["target/model.onnx", "tokenizer.json", "drafter-l1-v128/id_map.npy"])
def test_sha256_mismatch_of_a_small_file_is_caught_by_default(model_copy, rel):
    flip_middle_byte(model_copy / rel)
    assert "sha256" in expect_load_error(model_copy, rel)


def test_sha256_mismatch_of_a_weights_file(model_copy, monkeypatch):
    """Weights files above FAST_HASH_BYTES are only sized by default (hashing 216 MB costs 0.5 s per load);
    verify="sha256" hashes them too."""
    from edge import manifest

    monkeypatch.setattr(manifest, "FAST_HASH_BYTES", 1 << 16)  # the tiny export's weights count as large here
    flip_middle_byte(model_copy / "target" / "model.onnx.data")
    edge.load(model_copy, drafter="none", context=128, verify="size")  # a size check cannot see it
    assert "sha256" in expect_load_error(model_copy, "target/model.onnx.data", verify="sha256")


def test_manifest_from_a_newer_format(model_copy):
    raw = json.loads((model_copy / MANIFEST_NAME).read_text())
    raw["format_version"] = FORMAT_VERSION + 1
    (model_copy / MANIFEST_NAME).write_text(json.dumps(raw))
    msg = expect_load_error(model_copy, MANIFEST_NAME)
    assert f"format {FORMAT_VERSION + 1}" in msg and "upgrade edgespec" in msg


def test_tokenizer_missing(model_copy):
    (model_copy / "tokenizer.json").unlink()
    assert "missing" in expect_load_error(model_copy, "tokenizer.json")


def test_drafter_id_map_out_of_range(model_copy):
    rel = "drafter-l1-v128/id_map.npy"
    ids = np.load(model_copy / rel)
    ids[-1] = VOCAB + 7  # a token the target does not have
    np.save(model_copy / rel, ids)
    rewrite_listed(model_copy, rel)
    msg = expect_load_error(model_copy, rel)
    assert f"[0, {VOCAB})" in msg and str(VOCAB + 7) in msg


def test_drafter_id_map_for_another_vocabulary_size(model_copy):
    rel = "drafter-l1-v128/id_map.npy"
    np.save(model_copy / rel, np.arange(200, dtype=np.int64))  # 200 ids for a 128-logit drafter
    rewrite_listed(model_copy, rel)
    msg = expect_load_error(model_copy, rel)
    assert "(200,)" in msg and "128" in msg


def test_drafter_id_map_with_repeats(model_copy):
    rel = "drafter-l1-v128/id_map.npy"
    np.save(model_copy / rel, np.zeros(128, dtype=np.int64))
    rewrite_listed(model_copy, rel)
    assert "repeats" in expect_load_error(model_copy, rel)


def test_drafter_built_for_a_larger_tokenizer(model_copy):
    edit_drafter(model_copy, vocab=VOCAB * 2, id_map=None)
    msg = expect_load_error(model_copy, "drafter-l1-v128/model.onnx")
    assert "another tokenizer" in msg and str(VOCAB * 2) in msg


def test_full_vocabulary_drafter_of_another_model(model_copy):
    edit_drafter(model_copy, vocab=VOCAB - 1, id_map=None)
    assert "another vocabulary" in expect_load_error(model_copy, "drafter-l1-v128/model.onnx")


def test_default_model_names_its_own_rebuild_command(tmp_path, monkeypatch):
    from edge.manifest import reexport_command

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    assert reexport_command(edge.default_model_dir()) == "edge-export --default --force"
    assert reexport_command(tmp_path / "m", "/src/ck") == f"edge-export /src/ck -o {tmp_path / 'm'}"
    (tmp_path / "m").mkdir()  # an export still there (damaged, or from another host): edge-export needs --force
    (tmp_path / "m" / "edge_model.json").write_text("{}")
    assert reexport_command(tmp_path / "m", "/src/ck") == f"edge-export /src/ck -o {tmp_path / 'm'} --force"


def test_unwritable_cache_is_one_clear_error_before_any_export(tmp_path, monkeypatch):
    """EDGESPEC_HOME under a file (or anywhere the cache cannot be created) names the variable to set, instead of
    an export error followed by advice to re-export."""
    import subprocess

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "afile" / "home"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("no export should start"))
    with pytest.raises(ModelDirError, match="set EDGESPEC_HOME to a writable directory"):
        edge.resolve_model(progress=False)
    # a directory that exists but cannot be written (a read-only mount; root passes permission checks, so the
    # file system's refusal is simulated)
    import errno
    import tempfile

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(ModelDirError, match=r"\(Read-only file system\): .* set EDGESPEC_HOME"):
        edge.resolve_model(progress=False)


def test_default_model_is_built_in_a_child_and_rebuilt_when_older(exported_llama, tmp_path, monkeypatch,
                                                                   child_exports):
    """edge.resolve_model() (the default): a current cache is used as is; a missing one, or one an older graph
    builder wrote, is rebuilt by `python -m export.cli --model smollm2-135m` in a child process (its memory never
    stays in ours); a failed build is a ModelDirError naming the re-export command."""
    import json
    import shutil

    from edge.manifest import GRAPH_VERSION, MANIFEST_NAME

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    calls = child_exports.calls
    assert edge.resolve_model(progress=False) == edge.default_model_dir()  # missing: built
    assert calls[-1][1:] == ["-m", "export.cli", "--model", "smollm2-135m", "--quiet"]
    d = edge.default_model_dir()
    shutil.copytree(exported_llama[0], d)
    raw = json.loads((d / MANIFEST_NAME).read_text())
    assert raw["source"]["graph_version"] == GRAPH_VERSION
    n = len(calls)
    edge.resolve_model(progress=False)  # current: used as is
    assert len(calls) == n
    raw["source"]["graph_version"] = GRAPH_VERSION - 1
    (d / MANIFEST_NAME).write_text(json.dumps(raw))
    child_exports.rc = 2
    with pytest.raises(ModelDirError, match="edge-export --default --force"):
        edge.resolve_model(progress=False)  # older: rebuilt (and this build fails)
    assert len(calls) == n + 1
