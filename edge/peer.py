"""edge-bench's side of a peer runtime: onnxruntime-genai in its own Python process (edge/peer_genai.py), fed the
token ids edgespec's own template gives, so both runtimes answer the same prompts in one interleaved run."""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

# edge-bench mode name -> the worker's mode (peer_genai.py)
PEER_MODES = {"genai": "greedy", "genai-ngram": "ngram"}
# whose output each peer mode must reproduce to count as lossless: its own greedy decoding
PEER_REFERENCE = {"genai-ngram": "genai"}
WORKER = Path(__file__).with_name("peer_genai.py")


class PeerError(RuntimeError):
    pass


def model_dir_problem(model_dir: str) -> str | None:
    """Why `model_dir` cannot be a peer model folder, found before a worker starts (its first complaint would be
    whatever fails first there, e.g. a missing onnxruntime_genai); None when it is a folder."""
    p = Path(model_dir)
    fix = "pass the folder onnxruntime-genai's model builder wrote (../shared/peers/README.md)"
    if not p.exists():
        return f"no such folder, so onnxruntime-genai cannot load it; {fix}"
    if not p.is_dir():
        return f"not a folder, so onnxruntime-genai cannot load it; {fix}"
    return None


class Peer:
    """One worker process; `run` answers one prompt greedily, plainly or with the peer's n-gram speculation."""

    def __init__(self, python: str, model_dir: str, threads: int):
        self._err = tempfile.TemporaryFile(mode="w+")  # read back only when the worker fails
        try:
            self._p = subprocess.Popen([python, str(WORKER), model_dir, "--threads", str(threads)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
        except OSError as e:
            raise PeerError(f"cannot start {python}: {e}") from None
        try:
            ready = self._read().get("ready")
            if ready is None:
                raise PeerError("the peer worker did not say it was ready")
        except BaseException:  # a PeerError or Ctrl-C: no worker or temporary file left behind
            self.close()
            raise
        self.version = ready

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
            raise PeerError(f"the peer worker printed {line.strip()[:200]!r}, not edge/peer_genai.py's protocol")
        if "error" in msg:
            raise PeerError(msg["error"])
        return msg

    def run(self, ids: list[int], max_new: int, mode: str) -> dict:
        """{"tokens", "n_gen", "prefill_s", "decode_s"} for one greedy answer of up to `max_new` tokens to `ids`."""
        try:
            self._p.stdin.write(json.dumps({"ids": ids, "max_new": max_new, "mode": PEER_MODES[mode]}) + "\n")
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
