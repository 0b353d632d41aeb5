"""Memory soak: many short chat turns on one engine, RSS against the planner's prediction, drafter state bounds.

    python -m edge.tools.soak --turns 500 --json soak.json          # the embedded default model

Workload (why this shape): chats of `--group` turns (default 20) with short answers (`--max-tokens`, default 12),
then `Chat.reset(keep_drafter_state=True)`. Each turn prefills only its new message (prefix reuse), so 500 turns
take minutes, while the KV cache sweeps from empty to a few hundred tokens 25 times and the drafter state
(Token Recycling's matrix, prompt-lookup history) lives through the whole soak: growth anywhere would show. Every
`--interrupt-every` turns an answer is closed after its first chunk (the interrupted-stream path, with rollback).

Reported: RSS at turn 1, 100, 500 (and every `--every` turns), the process's peak RSS, the planner's predicted peak
for the full context (memory.planner through edge.planning, the plan `edge.load(device="host")` makes), and the
drafter state sizes against their bounds. MB are 2**20 bytes, as in the footprint model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from memory.footprint import recycling_bytes

from ..args import add_model_arg, add_version, non_negative_int, positive_int
from ..drafters import DRAFTER_CHOICES
from ..files import unwritable
from ..measure import peak_rss_mb, rss_bytes

QUESTIONS = [
    "Name a river in Europe.", "What is 7 times 8?", "Give me a synonym for quick.", "Who wrote Hamlet?",
    "What colour is the sky on a clear day?", "Translate 'good morning' into French.", "Name a prime number.",
    "What is the capital of Japan?", "Say hello in Spanish.", "What is water made of?", "Name a planet.",
    "How many legs does a spider have?", "What is the opposite of cold?", "Name a programming language.",
    "What do bees make?", "Spell the word 'cat' backwards.", "What is 12 minus 5?", "Name a fruit that is yellow.",
    "What season comes after winter?", "Name a musical instrument.",
]


def rss_mb() -> float:
    return rss_bytes() / 2**20


def drafter_state(engine) -> dict:
    """Sizes of the state that outlives a request, with the bounds each must stay within."""
    lk, rc = engine.lookup, engine.recycling
    return {
        "recycling_bytes": rc.nbytes, "recycling_bytes_bound": sum(recycling_bytes(rc.vocab, rc.k)),  # fixed size
        "recycling_templates": len(rc._templates), "recycling_templates_bound": 65,  # one per budget 0..64
        "lookup_history": len(lk.history), "lookup_history_bound": lk.max_history,
        "lookup_index": len(lk.index),
        "lookup_index_bound": (lk.max_ngram - lk.min_ngram + 1) * len(lk.history),  # ≤ one entry per n per token
        "cached_tokens": len(engine.cached), "cached_tokens_bound": engine.context,
        "call_widths": len(engine.policy.call_widths()), "call_widths_bound": 65,  # widths 1..65 (a draft of up to 64 + 1)
        "call_time_contexts": len(engine.policy.calls_at), "call_time_contexts_bound": engine.context.bit_length() + 1,
    }


def within_bounds(state: dict) -> list[str]:
    return [k for k in state if not k.endswith("_bound") and k + "_bound" in state and state[k] > state[k + "_bound"]]


def predicted_mb(engine) -> dict:
    """The planner's predicted peak for this engine at its full context (and for plain decoding)."""
    from memory.planner import fullest, plain_call_rows

    from ..planning import make_plan, profile_for

    profile = engine.profile or profile_for(None)
    context = fullest(engine.context, plain_call_rows(profile, engine.target.min_call))  # the engine's end of chat
    p = make_plan(engine.manifest, profile, context, None, min_call=engine.target.min_call,
                  capacity=engine.context, tree_exact=engine.target.tree_exact, drafter=engine._configured)
    return {"drafter": p.drafter, "context": context, "peak_mb": round(p.peak_mb, 1),
            "plain_peak_mb": round(p.plain_peak_mb, 1)}


def soak(engine, turns: int, max_tokens: int = 12, group: int = 20, interrupt_every: int = 10,
         every: int = 10, marks=(1, 100, 500), log=None) -> dict:
    """Run the soak on a loaded engine; → the report dict (see module docstring)."""
    chat = engine.chat(system="You are a helpful assistant. Answer in a few words.")
    rows, errors, t0 = [], [], time.perf_counter()
    generated = interrupted = 0
    for turn in range(1, turns + 1):
        q = QUESTIONS[(turn - 1) % len(QUESTIONS)]
        stream = chat.send(q, max_tokens=max_tokens)
        if interrupt_every and turn % interrupt_every == 0:
            for ch in stream:
                generated += len(ch.token_ids)
                break
            stream.close()
            interrupted += 1
        else:
            generated += sum(len(ch.token_ids) for ch in stream)
        if engine.target.cache.length != len(engine.cached):
            errors.append(f"turn {turn}: KV cache holds {engine.target.cache.length} tokens, engine thinks "
                          f"{len(engine.cached)}")
        state = drafter_state(engine)
        over = within_bounds(state)
        if over:
            errors.append(f"turn {turn}: beyond bounds: {over}")
        if turn in marks or turn % every == 0 or turn == turns:
            row = {"turn": turn, "rss_mb": round(rss_mb(), 1), "peak_rss_mb": round(peak_rss_mb(), 1),
                   "context_tokens": engine.target.cache.length, "seconds": round(time.perf_counter() - t0, 1),
                   **state}
            rows.append(row)
            if log:
                print(json.dumps(row), file=log, flush=True)
        if turn % group == 0:
            chat.reset(keep_drafter_state=True)
    at = {r["turn"]: r["rss_mb"] for r in rows}
    pred = predicted_mb(engine)
    first = rows[0]["rss_mb"]
    report = {
        "model": engine.manifest.name, "drafter": engine.default_drafter, "turns": turns, "max_tokens": max_tokens,
        "group": group, "interrupted_turns": interrupted, "generated_tokens": generated,
        "seconds": round(time.perf_counter() - t0, 1),
        "rss_mb_at": {str(m): at[m] for m in marks if m in at},
        "rss_mb_last": rows[-1]["rss_mb"], "rss_growth_mb": round(rows[-1]["rss_mb"] - first, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1), "predicted": pred,
        "within_prediction": peak_rss_mb() <= pred["peak_mb"],
        "drafter_state_last": drafter_state(engine), "errors": errors, "series": rows,
    }
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edge.tools.soak", description=__doc__.split("\n\n")[0])
    add_model_arg(ap, "--model", "--model-dir")
    ap.add_argument("--turns", type=positive_int, default=500, help="chat turns in all (default 500)")
    ap.add_argument("--max-tokens", type=positive_int, default=12, help="new tokens per answer (default 12)")
    ap.add_argument("--group", type=positive_int, default=20,
                    help="turns per chat before a reset (drafter state kept; default 20)")
    ap.add_argument("--interrupt-every", type=non_negative_int, default=10,
                    help="close every N-th answer after one chunk (0: never; default 10)")
    ap.add_argument("--every", type=positive_int, default=10, help="record RSS every N turns (default 10)")
    ap.add_argument("--context", type=positive_int, default=None,
                    help="context window in tokens (default 4096, or the export's maximum if that is smaller)")
    ap.add_argument("--drafter", default="auto", choices=DRAFTER_CHOICES, help="drafter, as edge-chat's (default auto)")
    ap.add_argument("--threads", type=positive_int, default=2, help="CPU threads for ONNX Runtime (default 2)")
    ap.add_argument("--json", metavar="FILE", help="also write the full report (with the RSS series) to FILE")
    add_version(ap)
    a = ap.parse_args(argv)
    import edge

    if a.json:
        problem = unwritable(Path(a.json))
        if problem:  # found before the soak, not after it
            ap.error(f"--json {a.json}: {problem}")
    try:
        engine = edge.load(a.model, drafter=a.drafter, threads=a.threads, context=a.context, device="host")
    except edge.EngineError as e:  # a ModelDirError too
        print(f"edge.tools.soak: error: {e}", file=sys.stderr)
        return 2
    r = soak(engine, a.turns, a.max_tokens, a.group, a.interrupt_every, a.every, log=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    summary = {k: v for k, v in r.items() if k != "series"}
    print(json.dumps(summary, indent=2))
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
