"""Where edgespec keeps its files ($EDGESPEC_HOME), and can we write there? Asked before long work (an export, an
hour of benchmark runs), so the answer is one line at the start instead of a traceback at the end."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def home() -> Path:
    """Where edgespec keeps exported models and calibrations: $EDGESPEC_HOME, else ~/.cache/edgespec."""
    return Path(os.environ.get("EDGESPEC_HOME") or Path.home() / ".cache" / "edgespec")


def default_model_dir() -> Path:
    """Where the embedded default model is exported on first use."""
    return home() / "models" / DEFAULT_MODEL_NAME


def unwritable_dir(d: Path) -> str | None:
    """Why files cannot be created in directory `d` (made if missing), or None. Probed by creating a temporary
    file: os.access says yes to root on a read-only mount and to many network file systems that then refuse."""
    if d.exists() and not d.is_dir():
        return f"{d} is a file, not a directory"
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        return f"cannot write in {d} ({e.strerror or e})"
    return None


def unwritable(path: Path) -> str | None:
    """Why file `path` cannot be written (creating its directory if needed), or None."""
    if path.is_dir():
        return f"{path} is a directory; give a file name"
    problem = unwritable_dir(path.parent)
    if problem is None and path.exists() and not os.access(path, os.W_OK):
        problem = f"{path} is not writable"
    return problem


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it, synced, then renamed over it: an interrupted
    write (Ctrl-C, a full disk) leaves the old file whole, or none."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
