"""An interrupted export never leaves a model directory that loads, and the next run recovers.

Interruptions: an exception injected into a pipeline step (KeyboardInterrupt, OSError), a crash between the two
renames that swap a finished export into place, and a real `python -m export.cli` killed with SIGKILL midway.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, tiny_export_options
from edge.manifest import ModelDirError, load_manifest
from export import pipeline
from export.pipeline import export_model


def siblings(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name))


def interrupt(monkeypatch, name: str, exc: BaseException):
    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(pipeline, name, boom)


@pytest.mark.parametrize("step,exc", [
    ("rank_vocabulary", KeyboardInterrupt()),  # after the target graph is on disk
    ("save_model", OSError(28, "No space left on device")),  # while writing the first graph
    ("source_digest", KeyboardInterrupt()),  # while the manifest is being assembled
])
def test_interrupted_export_leaves_nothing_that_loads(tiny_llama_dir, tmp_path, monkeypatch, step, exc):
    out = tmp_path / "m"
    interrupt(monkeypatch, step, exc)
    with pytest.raises(type(exc)):
        export_model(tiny_llama_dir, out, tiny_export_options(), progress=False)
    with pytest.raises(ModelDirError):
        load_manifest(out)
    assert siblings(out) == []  # the .partial directory was cleared on the way out
    monkeypatch.undo()
    m = export_model(tiny_llama_dir, out, tiny_export_options(), progress=False)
    assert load_manifest(out, verify="sha256") == m
    assert siblings(out) == ["m"]


def test_interrupted_reexport_keeps_the_old_directory(exported_llama, tmp_path, monkeypatch, tiny_llama_dir):
    d, old = exported_llama
    out = tmp_path / "m"
    shutil.copytree(d, out)
    interrupt(monkeypatch, "rank_vocabulary", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        export_model(tiny_llama_dir, out, tiny_export_options(drafters=((2, 64),)), progress=False)
    assert load_manifest(out, verify="sha256") == old
    monkeypatch.undo()
    new = export_model(tiny_llama_dir, out, tiny_export_options(drafters=((2, 64),)), progress=False)
    assert [g.name for g in load_manifest(out, verify="sha256").drafters] == ["drafter-l2-v64"]
    assert new.drafters[0].layers == 2 and not (out / "drafter-l1-v128").exists()
    assert siblings(out) == ["m"]


def test_crash_between_the_swap_renames(exported_llama, tmp_path, monkeypatch, tiny_llama_dir):
    """The old directory is moved aside, then the process dies before the new one is moved in: nothing loads
    (no half-old directory), and the next run recovers and cleans both leftovers."""
    d, _ = exported_llama
    out = tmp_path / "m"
    shutil.copytree(d, out)
    real = os.replace
    calls = []

    def replace(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(pipeline.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        export_model(tiny_llama_dir, out, tiny_export_options(), progress=False)
    monkeypatch.undo()
    with pytest.raises(ModelDirError):
        load_manifest(out)
    with pytest.raises(ModelDirError):
        load_manifest(tmp_path / "m.old")  # the old export lost its manifest before it was moved
    export_model(tiny_llama_dir, out, tiny_export_options(), progress=False)
    load_manifest(out, verify="sha256")
    assert siblings(out) == ["m"]


def test_cleanup_cut_short_still_restarts_cleanly(tiny_llama_dir, tmp_path, monkeypatch):
    """A second interrupt while the failed export deletes its .partial directory (the user presses Ctrl-C again),
    after any number of deleted files: the marker goes last, so what is left is always recognized as ours and the
    next run clears it."""
    out = tmp_path / "m"
    opts = tiny_export_options(drafters=(), parity=False)
    real = os.unlink
    for cut in range(1, 12):
        interrupt(monkeypatch, "rank_vocabulary", KeyboardInterrupt())  # the export fails after the target graph
        calls = []

        def unlink(*a, **k):
            if ".partial" not in str(a[0]):  # the lock file beside OUT is not the cleanup's
                return real(*a, **k)
            calls.append(a)
            if len(calls) == cut:  # ... and its cleanup is interrupted after deleting cut - 1 files
                raise KeyboardInterrupt
            return real(*a, **k)

        monkeypatch.setattr(os, "unlink", unlink)
        with pytest.raises(KeyboardInterrupt):
            export_model(tiny_llama_dir, out, opts, progress=False)
        monkeypatch.undo()
        part = tmp_path / "m.partial"
        if len(calls) < cut:  # the cleanup finished before the cut: nothing left
            assert not part.exists()
            break
        assert (part / pipeline.PARTIAL_MARKER).is_file(), (cut, sorted(p.name for p in part.iterdir()))
        export_model(tiny_llama_dir, out, opts, progress=False)  # recognized and cleared
        load_manifest(out, verify="sha256")
        assert siblings(out) == ["m"]
        shutil.rmtree(out)
    else:
        pytest.fail("the cleanup never finished within 11 deletions")


def test_work_directory_marker_is_deleted_last_whatever_the_listing_order(tmp_path, monkeypatch):
    """The guarantee behind the test above, independent of the file system's listing order: even when the marker is
    listed first, an interrupt after the first deletion leaves it in place."""
    from pathlib import Path

    d = tmp_path / "m.partial"
    (d / "sub").mkdir(parents=True)
    for name in ("a.bin", "sub/b.bin", pipeline.PARTIAL_MARKER):
        (d / name).write_text("x")
    listing = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(sorted(listing(self), key=lambda p: not p.name.startswith("."))))

    real, calls = os.unlink, []

    def unlink(*a, **k):  # the first deletion happens, the second is interrupted
        calls.append(a)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt):
        pipeline._remove_ours(d, pipeline.PARTIAL_MARKER)
    monkeypatch.undo()
    assert (d / pipeline.PARTIAL_MARKER).is_file()
    pipeline._remove_ours(d, pipeline.PARTIAL_MARKER)
    assert not d.exists()


def test_full_vocab_drafter(tmp_path, tiny_llama_dir, tiny_llama):
    """vocab 0 = full: an identity id map and a graph without trimming."""
    from export import reference
    from export.distill import read_adapter
    from export.evaluate import GraphRunner

    m = export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(drafters=((2, 0),), parity=False),
                     progress=False)
    (g,) = m.drafters
    id_map = np.load(tmp_path / "m" / g.id_map)
    assert g.vocab == tiny_llama.config.vocab and np.array_equal(id_map, np.arange(tiny_llama.config.vocab))
    assert m.parity == {"export_seconds": m.parity["export_seconds"]}
    ids = np.arange(5, 25)
    c = tiny_llama.config
    got = GraphRunner(str(tmp_path / "m" / g.file), 2, c.kv_heads, c.head_dim).logits(ids)
    adapter = read_adapter(tmp_path / "m" / g.file)  # the self-distilled correction, if the export fitted one
    np.testing.assert_allclose(got, reference.forward(tiny_llama, ids, layers=2, adapter=adapter), atol=1e-4, rtol=0)


def test_drafter_vocab_above_model_vocab_is_clamped(tmp_path, tiny_llama_dir):
    import onnx

    m = export_model(tiny_llama_dir, tmp_path / "m", tiny_export_options(drafters=((1, 1000),), parity=False),
                     progress=False)
    (g,) = m.drafters
    width = onnx.load(str(tmp_path / "m" / g.file), load_external_data=False).graph.output[0]
    assert g.vocab == width.type.tensor_type.shape.dim[-1].dim_value == m.arch["vocab"] < 1000


# ----------------------------------------------------------------------------- a real process, killed

CLI_ARGS = ["--precision", "fp32", "--drafter-layers", "1", "--drafter-vocab", "128", "--calib-tokens", "32",
            "--max-len", "256", "-q"]


def start_cli(src, out, *extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "export.cli", str(src), "-o", str(out), *CLI_ARGS, *extra],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kill_midway(proc, out, marker: str = "tokenizer.json", timeout: float = 60):
    """SIGKILL the export as soon as its .partial directory holds `marker` (so it is truly midway)."""
    part = out.with_name(out.name + ".partial")
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and not (part / marker).exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert proc.poll() is None, f"export finished before it could be killed: {proc.stderr.read()}"
        assert (part / marker).exists(), "export never reached the marker"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stderr.close()
    return part


def test_sigkill_midway_then_rerun(tiny_llama_dir, tmp_path, run_export_cli):
    out = tmp_path / "killed"
    part = kill_midway(start_cli(tiny_llama_dir, out), out)
    assert part.is_dir() and not out.exists()
    with pytest.raises(ModelDirError):
        load_manifest(out)
    with pytest.raises(ModelDirError):
        load_manifest(part)  # the leftover itself never loads: no manifest yet
    r = run_export_cli(tiny_llama_dir, "-o", out, *CLI_ARGS)
    assert r.returncode == 0, r.stderr
    load_manifest(out, verify="sha256")
    assert siblings(out) == ["killed"]


def test_sigkill_during_reexport_keeps_old(exported_llama, tiny_llama_dir, tmp_path):
    d, old = exported_llama
    out = tmp_path / "m"
    shutil.copytree(d, out)
    kill_midway(start_cli(tiny_llama_dir, out, "--force"), out, marker="target/model.onnx")
    assert load_manifest(out, verify="sha256") == old


# ----------------------------------------------------------------------------- one export at a time per OUT

def test_second_export_into_the_same_directory_is_refused_while_one_runs(tiny_llama_dir, tmp_path, run_export_cli):
    out = tmp_path / "m"
    with pipeline.export_lock(out):
        r = run_export_cli(tiny_llama_dir, "-o", out, *CLI_ARGS)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"another edge-export is writing {out}" in r.stderr, r.stderr
    assert siblings(out) == []  # refused before any work; the lock file left with its holder
    r = run_export_cli(tiny_llama_dir, "-o", out, *CLI_ARGS)
    assert r.returncode == 0, r.stderr
    assert siblings(out) == ["m"]


def test_two_exports_started_together_never_clash(tiny_llama_dir, tmp_path):
    """Two `edge-export SRC -o OUT` at once (two terminals): one builds OUT, the other either finds it busy or
    already built and says so, or runs after it; never a half-deleted work directory or an `[Errno 17] File
    exists`."""
    out = tmp_path / "m"
    procs = [start_cli(tiny_llama_dir, out) for _ in range(2)]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    for p, err in zip(procs, errs):
        assert p.returncode == 0 or (p.returncode == 2 and ("another edge-export is writing" in err
                                                            or "already holds an edgespec export" in err)), err
    assert any(p.returncode == 0 for p in procs)
    load_manifest(out, verify="sha256")
    assert siblings(out) == ["m"]


def test_lock_waiter_gets_it_when_the_holder_releases(tmp_path):
    """`export_lock(wait=True)` (how a second first run of the embedded default waits for the first) blocks, says
    so, and gets the lock once the holder releases it (the holder removes the file: the waiter re-locks the new
    one)."""
    import threading

    out = tmp_path / "m"
    got, said, waiting = [], [], threading.Event()

    def notify(msg):
        said.append(msg)
        waiting.set()

    def waiter():
        with pipeline.export_lock(out, wait=True, notify=notify):
            got.append(time.monotonic())
            time.sleep(0.05)

    with pipeline.export_lock(out):
        t = threading.Thread(target=waiter)
        t.start()
        assert waiting.wait(30)
        assert not got and said == [f"another edge-export is writing {out}; waiting for it to finish"]
        released = time.monotonic()
    t.join(30)
    assert got and got[0] >= released
    assert not pipeline.lock_path(out).exists()
    with pipeline.export_lock(out):  # free again
        pass


def test_lock_is_released_even_if_an_interrupt_hits_its_cleanup(tmp_path, monkeypatch):
    out = tmp_path / "m"
    real = os.unlink

    def unlink(path, *a, **k):
        if str(path).endswith(".m.edge-export.lock"):
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt):
        with pipeline.export_lock(out):
            pass
    monkeypatch.undo()
    with pipeline.export_lock(out):  # not still held through a leaked descriptor
        pass


def test_two_first_runs_of_the_default_build_it_once(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """Two first runs at once (two terminals, or an app and the CLI): the second waits for the first's export of the
    embedded model and reuses it instead of racing it. The embedded GGUF is stood in for by the tiny checkpoint."""
    import threading

    import export.cli as cli
    from export import catalog

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(catalog.Model, "gguf_path", lambda self: tiny_llama_dir)
    opts = tiny_export_options(name="SmolLM2-135M-Instruct")
    built, errors = [], []

    def first_run():
        try:
            built.append(cli.export_named(catalog.MODELS[catalog.DEFAULT], progress=True, opts=opts))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    runs = [threading.Thread(target=first_run) for _ in range(2)]
    for t in runs:
        t.start()
    for t in runs:
        t.join(240)
    err = capsys.readouterr().err
    assert not errors and len(built) == 2, errors
    assert err.count("building SmolLM2-135M-Instruct") == 1 and "reusing it" in err, err
    assert "waiting for it to finish" in err, err  # the runs overlapped (a build takes seconds)
    assert built[0].files == built[1].files


def test_lock_never_touches_other_files_beside_out(tmp_path):
    """The lock file has a name of its own: a `uv.lock` beside an OUT named `uv` survives; something that is not
    a regular file at the lock's own path is refused in one line, never followed or deleted."""
    (tmp_path / "uv.lock").write_text("keep")
    with pipeline.export_lock(tmp_path / "uv"):
        assert pipeline.lock_path(tmp_path / "uv").is_file()
    assert (tmp_path / "uv.lock").read_text() == "keep" and not pipeline.lock_path(tmp_path / "uv").exists()
    target = tmp_path / "elsewhere"
    pipeline.lock_path(tmp_path / "a").symlink_to(target)
    with pytest.raises(ValueError, match="cannot open the export lock"):
        with pipeline.export_lock(tmp_path / "a"):
            pass
    assert not target.exists() and pipeline.lock_path(tmp_path / "a").is_symlink()
    pipeline.lock_path(tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match="cannot open the export lock .*Is a directory"):
        with pipeline.export_lock(tmp_path / "b"):
            pass
    with pytest.raises(ValueError, match="is not a directory"):
        with pipeline.export_lock(tmp_path / "uv.lock" / "m"):
            pass


def test_an_output_location_that_cannot_be_written_is_named_not_its_lock(tiny_llama_dir, tmp_path, monkeypatch,
                                                                          run_export_cli):
    """A parent directory that takes no new files (a read-only mount, /proc) was reported as a lock to delete that
    did not exist; now the directory and the OS reason are named. The lock advice stays for a lock that is there."""
    import errno
    import re

    real = os.open

    def read_only(path, *a, **k):
        if str(path).endswith(".edge-export.lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ValueError, match=rf"^cannot write in {re.escape(str(tmp_path))}, the output directory's parent \(Read-only "
                                         r"file system\); choose an output directory in a writable location$"):
        with pipeline.export_lock(tmp_path / "m"):
            pass
    pipeline.lock_path(tmp_path / "m").write_text("")  # a lock file that is there but cannot be opened
    with pytest.raises(ValueError, match="cannot open the export lock .*delete it"):
        with pipeline.export_lock(tmp_path / "m"):
            pass
    monkeypatch.undo()
    if os.path.isdir("/proc/self"):  # the audit's case: a real directory that refuses new files
        r = run_export_cli(tiny_llama_dir, "-o", "/proc/edgespec-export-test", "-q")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip() == ("edge-export: error: cannot write in /proc, the output directory's parent (No such "
                                    "file or directory); choose an output directory in a writable location"), r.stderr


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux's")
def test_a_finished_export_is_synced_and_dropped_from_the_page_cache(tiny_llama_dir, tmp_path, monkeypatch):
    """The large files an export wrote are synced, then dropped from the page cache before the directory is
    published, so the runtime later reads them back in small pages; small files are left alone, and an OS error
    on one file skips it without failing the export."""
    synced, dropped = [], []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def fadvise(fd, offset, length, advice):
        assert (offset, length, advice) == (0, 0, os.POSIX_FADV_DONTNEED)
        dropped.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(pipeline, "PAGE_CACHE_MIN_BYTES", 4096)
    out = tmp_path / "m"
    export_model(tiny_llama_dir, out, tiny_export_options(parity=False), progress=False)
    big = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.stat().st_size >= 4096}
    small = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.stat().st_size < 4096}
    part = str(out) + ".partial/"
    assert {d.removeprefix(part) for d in dropped} == big and any(b.endswith(".onnx.data") for b in big)
    assert set(dropped) <= set(synced) and small
    assert not {d.removeprefix(part) for d in dropped} & small

    def refuse(fd, *a):
        raise OSError("not supported here")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    assert pipeline.drop_from_page_cache(out) == 0
