"""One memory measurement in a fresh process: `python -m edge.tools.memprobe '{json}'` (or the JSON on stdin) loads a model with a KV cache sized
to the run, fills it to `context` tokens, decodes with a fixed draft length, and prints one JSON line with its own
peak RSS (ru_maxrss of this process only, so every point is isolated) next to the footprint model's prediction for
exactly this run. `edge-profile` runs one of these per (context, K) point.

With "prompts" (a JSONL prompt file, as edge-bench reads it) it replays a workload instead (`replay`): what an app
running one drafter holds over those requests, in a process of its own, as edge-bench measures each peer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..measure import peak_rss_bytes, rss_bytes


# a unit of ordinary prose, well over 64 tokens, for when no prompt file is given
DEFAULT_UNIT = ("Speculative decoding drafts several tokens cheaply and lets the large model check them all in one "
                "call. When the draft agrees with what the model would have said, many tokens are produced for the "
                "price of one forward pass; when it does not, the first disagreeing token is replaced by the "
                "model's own choice and nothing is lost. The extra memory it needs comes from the draft tokens' "
                "cache slots, their logits, and whatever state the drafter keeps, and on a small device that "
                "memory decides whether the model runs at all. ")


def filler_text(codec, n: int, unit: str) -> str:
    """Text that encodes to about n tokens: `unit` repeated (BPE merges across the seams, so the cut is refined
    on the re-encoded text)."""
    ids = codec.encode(unit) or [codec.bos or 0]
    want = n
    for _ in range(4):
        reps = -(-want // len(ids))
        text = codec.decode((ids * reps)[:want])
        got = len(codec.encode(text))
        if got == n:
            break
        want = max(1, want + n - got)
    return text


def measure(model_dir: str, context: int, k: int, drafter: str = "lookup", decode: int = 16, threads: int = 2,
            text: str = "", calibration: dict | None = None) -> dict:
    """Peak RSS of: load → prefill a raw prompt of about `context` tokens → `decode` new tokens with chains of up
    to `k` draft tokens (k = 0: plain decoding); and the prediction of memory.predict_peak for the same run.
    `text`: the unit the prompt repeats; longer than k tokens, so prompt lookup finds spans of k tokens to draft."""
    from memory import Calibration, Speculation, predict_peak

    from ..engine import Engine

    after_imports = rss_bytes()
    kind = drafter if k else "none"
    rows = k + 1
    decode += k  # the draft budget is capped by the tokens left to generate: leave room for k-token drafts
    capacity = context + decode + rows + 8  # the KV buffer sized to the run: the model then predicts what is used
    t0 = time.perf_counter()
    engine = Engine(model_dir, drafter="none", threads=threads, context=capacity)
    after_load = rss_bytes()
    # only as much text as the context needs (≈ 4 characters a token): tokenizing all of a long prompt file would
    # itself raise this process's peak by tens of MB
    prompt = filler_text(engine.codec, context, (text or DEFAULT_UNIT)[: 8 * context + 4096])
    st = engine.generate(prompt, raw=True, max_tokens=decode, drafter=kind, draft_len=k if k else None).stats
    widest = max(engine.policy.call_widths(), default=1)  # widths of the decode calls actually made
    m = engine.manifest
    cal = Calibration.from_dict((calibration or {}).get("memory"), "cpu")
    spec = Speculation(kind, k)  # drafter "model": the graph the engine runs (memory.footprint.drafter_graph)
    # the KV arrays as the run left them (edge.kv.KVCache allocates the slots in use, rounded up)
    pred = predict_peak(m, spec, max(1, engine.target.cache.length), cal, min_call=engine.target.min_call,
                        capacity=engine.target.cache.slots)
    return {"context": context, "k": k, "drafter": kind, "decode": decode, "capacity": capacity,
            "prompt_tokens": st.prompt_tokens, "reused_tokens": st.reused_tokens, "generated": st.generated,
            "drafted": st.drafted, "accepted": st.accepted, "widest_call": widest, "min_call": engine.target.min_call,
            "peak_rss_mb": peak_rss_bytes() / 2**20, "rss_after_imports_mb": after_imports / 2**20,
            "rss_after_load_mb": after_load / 2**20,
            "predicted_mb": pred.total_mb, "predicted_components_mb": pred.to_dict()["components_mb"],
            "seconds": round(time.perf_counter() - t0, 2)}


def replay(model_dir: str, prompts: str, context: int = 4096, reps: int = 1, max_tokens: int = 128,
           drafter: str = "auto", threads: int = 2, limit: int = 0, categories: str | None = None,
           draft_len: int | None = None) -> dict:
    """Peak RSS of one process that loads `model_dir` at `context` and answers the first turn of each item of
    `prompts` `reps` times in a row with `drafter`, greedy, in edge-bench's order (by category, up to `limit` items
    of each, 0: all; only `categories`, comma-separated, if given): raw text on a model without a chat template,
    else a chat's first turn; `draft_len`: a fixed draft length (None: the adaptive one). The engine is reset between
    requests and keeps what drafting learned, as edge-bench runs it."""
    from ..engine import Engine
    from .bench import _first_ids, _select_items, completes_raw, read_workload

    items = _select_items(read_workload(prompts), prompts, limit, categories)
    t0 = time.perf_counter()
    engine = Engine(model_dir, drafter=drafter, threads=threads, context=context)
    after_load, load_peak = rss_bytes(), peak_rss_bytes()
    raw = completes_raw(engine)
    requests = skipped = 0
    for it in items:
        fits = len(_first_ids(engine, it)) < engine.context  # as edge-bench skips a prompt that does not fit
        for _ in range(reps):
            if not fits:
                skipped += 1
                continue
            engine.reset(keep_drafter_state=True)
            text = it["turns"][0]
            if raw:
                engine.generate(text, raw=True, max_tokens=max_tokens, draft_len=draft_len)
            else:
                engine.chat().ask(text, max_tokens=max_tokens, draft_len=draft_len)
            requests += 1
    return {"prompts": prompts, "context": context, "drafter": drafter, "requests": requests, "skipped": skipped,
            "max_tokens": max_tokens, "rss_after_load_mb": after_load / 2**20, "load_peak_rss_mb": load_peak / 2**20,
            "rss_end_mb": rss_bytes() / 2**20, "peak_rss_mb": peak_rss_bytes() / 2**20,
            "seconds": round(time.perf_counter() - t0, 2)}


def in_fresh_process(args: dict, timeout: float = 600) -> dict:
    """`measure(**args)` (or `replay`, with "prompts") in a new Python process → its JSON; RuntimeError with the
    probe's last error line when it fails."""
    r = subprocess.run([sys.executable, "-m", "edge.tools.memprobe"], input=json.dumps(args), capture_output=True,
                       text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]  # its error leads the message
        raise RuntimeError(f"{last}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = json.loads(argv[0] if argv else sys.stdin.read())  # stdin: the prompt text can exceed argv limits
    print(json.dumps(replay(**args) if "prompts" in args else measure(**args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
