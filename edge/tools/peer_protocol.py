"""The line protocol every edge-bench worker speaks (edge/tools/peer_genai.py, peer_llama.py, peer_hf.py): the same
command line, and one JSON object per line on a private copy of stdout, so whatever a library prints goes to
stderr instead of into the protocol. Standard library only: the workers run in other Pythons."""
from __future__ import annotations  # the peer's Python may be older than ours

import argparse
import json
import os
import sys


def worker_args(doc: str, source: str, context_help: str, context: int = 0) -> argparse.Namespace:
    """`WORKER SOURCE [--threads N] [--context N]`."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument(source)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=context, help=context_help)
    return ap.parse_args()


def open_protocol():
    """Take stdout for the protocol (stdout itself then writes to stderr) and return `say(msg: dict)`."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def say(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    return say


def serve(say, answer, who: str, peak=None) -> int:
    """Answer every request line on stdin with `answer(request) -> dict` until stdin closes. A failed request is
    one {"error": "WHO failed: ..."} line (edge-bench stops with it); Ctrl-C, which reaches the whole process group,
    ends quietly (edge-bench summarizes what ran). `peak` = (reset_peak_rss, peak_rss_bytes): each answer carries
    this process's peak RSS since its request began."""
    try:
        for line in sys.stdin:
            req = json.loads(line)
            try:
                if peak:
                    peak[0]()
                out = answer(req)
                if peak:
                    out["peak_rss_mb"] = round(peak[1]() / 2**20, 1)
                say(out)
            except Exception as e:  # noqa: BLE001 - reported per request
                say({"error": f"{who} failed: {e}"})
    except KeyboardInterrupt:
        pass
    return 0
