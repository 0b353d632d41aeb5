"""What every export records about where it came from: the converter's package versions, the source checkpoint's
digest, and how wide the recorded latency calls are. Shared by the native exporter and the optimum route."""
from __future__ import annotations

import os
import platform
from pathlib import Path

from edge.manifest import sha256_file

VERIFY_SIZES = 8  # the target's one-call latency is recorded for S = 1..8 (chain verification costs)


def converter_versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("edgespec", "onnx", "onnxruntime", "gguf", "transformers", "numpy"):
        try:
            from importlib.metadata import version

            out[mod] = version(mod)
        except Exception:
            pass
    return out


def source_digest(path: str | os.PathLike) -> str:
    p = Path(path)
    if p.is_file():
        return sha256_file(p)
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p.glob("*.safetensors")) + [p / "config.json"]:
        h.update(f.name.encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()
