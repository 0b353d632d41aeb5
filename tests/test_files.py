"""edge/files.py: output paths are checked before the work that writes them."""
from __future__ import annotations


def test_output_checks_probe_the_file_system(tmp_path, monkeypatch):
    """edge.files: a directory that refuses new files (a read-only mount; root passes permission checks, so the
    refusal is simulated) is named with the file system's reason, for an output file and for a directory."""
    import errno
    import tempfile

    from edge.files import unwritable, unwritable_dir

    assert unwritable(tmp_path / "new" / "o.json") is None and (tmp_path / "new").is_dir()
    assert "is a directory" in unwritable(tmp_path)
    (tmp_path / "f").write_text("x")  # a file where a directory is wanted: said so, not "File exists"
    assert unwritable_dir(tmp_path / "f") == f"{tmp_path / 'f'} is a file, not a directory"
    assert unwritable(tmp_path / "f" / "o.json") == f"{tmp_path / 'f'} is a file, not a directory"

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    assert unwritable(tmp_path / "o.json") == f"cannot write in {tmp_path} (Read-only file system)"
    assert unwritable_dir(tmp_path / "d") == f"cannot write in {tmp_path / 'd'} (Read-only file system)"
