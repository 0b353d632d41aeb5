"""A full disk during export: edge-export prints one line naming the problem and the fix, exits 2, and leaves no
directory that loads (nor a .partial one). Other interruptions (KeyboardInterrupt, SIGKILL, a crash between the
swap renames) and clean re-runs are covered in test_export_atomic.py."""
from __future__ import annotations

import errno

import pytest

from conftest import MAX_LEN
from edge.manifest import ModelDirError, load_manifest
from export import cli, pipeline

ARGS = ["--precision", "fp32", "--drafter-layers", "1", "--drafter-vocab", "64", "--calib-tokens", "4",
        "--max-len", str(MAX_LEN), "--no-parity", "-q"]


def half_written_then_full(real):
    """A writer that gets half of its bytes onto the disk, then ENOSPC (what a full disk does mid-file)."""

    def save(model, path, *a, **k):
        real(model, path, *a, **k)
        for f in (path, path + ".data"):
            try:
                with open(f, "r+b") as fh:
                    fh.truncate(max(1, fh.seek(0, 2) // 2))
            except FileNotFoundError:
                pass
        raise OSError(errno.ENOSPC, "No space left on device", path)

    return save


def write_manifest_full(self, model_dir):
    raise OSError(errno.ENOSPC, "No space left on device", str(model_dir) + "/edge_model.json.tmp")


@pytest.mark.parametrize("where", ["target graph", "manifest"])
def test_disk_full_is_one_clear_line(tiny_llama_dir, tmp_path, monkeypatch, capsys, where):
    out = tmp_path / "m"
    if where == "target graph":
        monkeypatch.setattr(pipeline, "save_model", half_written_then_full(pipeline.save_model))
    else:
        monkeypatch.setattr(pipeline.Manifest, "write", write_manifest_full)
    code = cli.main([str(tiny_llama_dir), "-o", str(out), *ARGS])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("edge-export: error: disk full while writing") and "free space and re-run" in err
    assert ("model.onnx" if where == "target graph" else "edge_model.json") in err
    with pytest.raises(ModelDirError):
        load_manifest(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no half directory, loadable or not
