"""A bounded load test for a running edge-serve on this machine: C concurrent clients × N chat requests each.

    python -m edge.tools.serve_load --url http://127.0.0.1:8080 --concurrency 4 --requests 20 --max-tokens 16 --json out.json

Prints one JSON object: status counts (200 answered, 503 rejected by the bounded queue, anything else), lost
requests (no HTTP answer at all), and latency percentiles of the answered ones. Clients start together and stop
after their N requests; only loopback addresses are accepted (the server is local).

    python -m edge.tools.serve_load --turns 10      # one chat resending its history: prompt tokens prefilled per turn
"""
from __future__ import annotations

import argparse
import collections
import http.client
import ipaddress
import json
import math
import sys
import threading
import time
import urllib.parse

from ..args import add_version

PROMPTS = ["Name three rivers.", "What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a KV cache is in one sentence.", "List two prime numbers.", "Say hello in Spanish."]


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list, else None."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(len(s) * q / 100) - 1))]


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _target(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    if not _loopback(host):
        raise ValueError(f"{url}: only loopback addresses (127.0.0.0/8, localhost, ::1) are load-tested")
    return host, port


def _post(host: str, port: int, body: dict, timeout: float) -> tuple[int, dict | None]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        try:
            return r.status, json.loads(data)
        except ValueError:
            return r.status, None
    finally:
        conn.close()


def run_load(url: str, concurrency: int = 4, requests: int = 20, max_tokens: int = 16,
             timeout: float = 120.0) -> dict:
    """Run the load and return the summary (see the module docstring); raises ValueError for a non-local url."""
    host, port = _target(url)
    lock = threading.Lock()
    status: collections.Counter = collections.Counter()
    latency: dict[int, list[float]] = collections.defaultdict(list)
    lost, malformed = [], 0
    start = threading.Barrier(concurrency)

    def client(c: int) -> None:
        nonlocal malformed
        start.wait()
        for i in range(requests):
            body = {"model": "edgespec", "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": PROMPTS[(c + i) % len(PROMPTS)]}]}
            t = time.perf_counter()
            try:
                code, obj = _post(host, port, body, timeout)
            except (OSError, http.client.HTTPException) as e:  # no complete HTTP answer
                with lock:
                    lost.append(f"client {c} request {i}: {type(e).__name__}: {e}")
                continue
            dt = time.perf_counter() - t
            ok = isinstance(obj, dict) and (("choices" in obj) if code == 200 else ("error" in obj))
            with lock:
                status[code] += 1
                latency[code].append(dt)
                malformed += not ok

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0

    def ms(xs, q):
        v = percentile(xs, q)
        return None if v is None else round(1000 * v, 1)

    ok = latency[200]
    return {"url": url, "concurrency": concurrency, "requests_per_client": requests, "max_tokens": max_tokens,
            "sent": concurrency * requests, "status": {str(k): v for k, v in sorted(status.items())},
            "answered_200": status[200], "rejected_503": status[503], "lost": len(lost), "lost_detail": lost[:5],
            "malformed_bodies": malformed, "wall_s": round(wall, 2),
            "latency_ms_200": {"p50": ms(ok, 50), "p90": ms(ok, 90), "p99": ms(ok, 99), "max": ms(ok, 100)},
            "latency_ms_503": {"p50": ms(latency[503], 50), "p99": ms(latency[503], 99)}}


TURNS = ["Hi! Can you help me plan a picnic?", "What food should I bring?", "And drinks?",
         "How many sandwiches for six people?", "Any ideas for games?", "What if it rains?",
         "Which park features matter most?", "What should I pack for the kids?", "How early should we arrive?",
         "Thanks! Can you summarize the plan in three bullet points?"]


def run_conversation(url: str, turns: int = 10, max_tokens: int = 48, timeout: float = 120.0) -> dict:
    """One chat that resends its whole history each turn, as desktop clients do → per turn: prompt tokens, how
    many of them the server reused from its KV cache, how many it prefilled, and its prefill time."""
    host, port = _target(url)
    messages, rows = [{"role": "system", "content": "You are a helpful assistant."}], []
    for i in range(turns):
        messages.append({"role": "user", "content": TURNS[i % len(TURNS)]})
        code, obj = _post(host, port, {"messages": messages, "max_tokens": max_tokens, "temperature": 0}, timeout)
        if code != 200:
            raise RuntimeError(f"turn {i + 1}: HTTP {code}: {obj}")
        usage, ext = obj["usage"], obj["edgespec"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        rows.append({"turn": i + 1, "prompt_tokens": usage["prompt_tokens"], "reused": cached,
                     "prefilled": usage["prompt_tokens"] - cached, "prefill_ms": ext["prefill_ms"]})
        messages.append({"role": "assistant", "content": obj["choices"][0]["message"]["content"]})
    return {"url": url, "turns": rows, "prefilled_total": sum(r["prefilled"] for r in rows),
            "prompt_tokens_total": sum(r["prompt_tokens"] for r in rows),
            "prefill_ms_total": round(sum(r["prefill_ms"] for r in rows), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edge.tools.serve_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080",
                    help="edge-serve base URL, loopback only (default http://127.0.0.1:8080)")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--requests", type=int, default=20, help="requests per client (default 20)")
    ap.add_argument("--max-tokens", type=int, help="max_tokens per request (default 16; 48 with --turns)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds per request before it counts as lost (default 120)")
    ap.add_argument("--turns", type=int, default=0,
                    help="instead of the load: one conversation of this many turns, reporting prompt tokens "
                         "reused / prefilled per turn (compare a server started with --no-reuse)")
    ap.add_argument("--json", metavar="FILE", help="also write the summary to FILE")
    add_version(ap)
    a = ap.parse_args(argv)
    if a.concurrency < 1 or a.requests < 1 or a.requests > 1000:
        print("serve_load: error: --concurrency >= 1 and --requests in [1, 1000]", file=sys.stderr)
        return 2
    try:
        if a.turns > 0:
            out = run_conversation(a.url, a.turns, a.max_tokens or 48, a.timeout)
        else:
            out = run_load(a.url, a.concurrency, a.requests, a.max_tokens or 16, a.timeout)
    except (ValueError, RuntimeError, OSError, http.client.HTTPException) as e:  # e.g. no server on --url
        print(f"serve_load: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0 if out.get("lost", 0) == 0 and out.get("malformed_bodies", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
