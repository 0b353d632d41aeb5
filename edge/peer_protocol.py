"""The line protocol every edge-bench worker speaks (edge/peer_genai.py, peer_llama.py, peer_hf.py): the same
command line, and one JSON object per line on a private copy of stdout, so whatever a library prints goes to
stderr instead of into the protocol. Standard library only: the workers run in other Pythons."""
from __future__ import annotations  # the peer's Python may be older than ours

import argparse
import json
import os


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
