"""edge-bench: decode speed of several drafter modes on one loaded model, over a JSONL prompt file.

Modes alternate per prompt (so drift of the machine's speed hits every mode alike), each prompt is repeated
--reps times, and figures are medians. Every run of a prompt starts from the drafter state the earlier prompts
left (Token Recycling's tables, acceptance statistics), never from one that has seen this prompt's own answer.
Every mode's greedy output is compared token for token with `none`. With --temp > 0 the modes sample instead (a
prompt's repeat r uses seed --seed + r in every mode); speculative sampling draws the target's distribution, not
its sample, so outputs are not compared.
Writes JSON (per prompt and per category) and a markdown table; asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from .cli import non_negative_int, positive_int
from .files import unwritable

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "workloads" / "public.jsonl"


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The prompt file, model and thread flags edge-bench and edge-profile share."""
    ap.add_argument("prompts", nargs="?", default=str(DEFAULT_PROMPTS),
                    help="JSONL file of {id, category, turns: [...]} (default: ../shared/workloads/public.jsonl)")
    ap.add_argument("--model", metavar="DIR", help="exported model directory (default: embedded model)")
    ap.add_argument("--threads", type=positive_int, default=2, help="CPU threads for ONNX Runtime (default 2)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edge-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--modes", default="none,lookup,recycling,hybrid", help="comma-separated drafter modes (default none,lookup,recycling,hybrid)")
    ap.add_argument("--reps", type=positive_int, default=3, help="repetitions per prompt and mode (default 3)")
    ap.add_argument("--max-tokens", type=positive_int, default=128, help="new tokens per answer (default 128)")
    ap.add_argument("--limit", type=non_negative_int, default=0, help="prompts per category (default 0: all)")
    ap.add_argument("--categories", help="comma-separated categories to run (default: all)")
    ap.add_argument("--second-turn", metavar="TEXT",
                    help="after each first answer, send TEXT as a second turn (e.g. a rewrite request); measured "
                         "under category '<cat>+turn2'")
    ap.add_argument("--draft-len", type=non_negative_int, help="draft length override (0-64)")
    ap.add_argument("--temp", type=float, default=0.0,
                    help="sampling temperature (default 0: greedy, every mode's output compared with none's)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    ap.add_argument("--top-k", type=non_negative_int, default=0,
                    help="sample among the k most likely tokens (default 0: off)")
    ap.add_argument("--seed", type=int, default=0,
                    help="base seed when sampling: repeat r of a prompt uses seed + r in every mode (turn t of a chat "
                         "adds 1000·t) (default 0)")
    ap.add_argument("--cold", action="store_true",
                    help="every prompt starts from a fresh drafter state — Token Recycling's tables and the acceptance "
                         "statistics, as in a new process (the verify-latency measurements carry over) — instead of "
                         "what the earlier prompts taught (a long-running assistant)")
    ap.add_argument("--out", default="bench-out/edge-bench.json", help="JSON output (default bench-out/edge-bench.json)")
    ap.add_argument("--quiet", action="store_true")
    return ap


ITEM_SHAPE = "expected {'id', 'category', 'turns': [str, ...]}"


def read_workload(path: str | Path) -> list[dict]:
    """Every item of a JSONL prompt file, checked: an object with an "id", a non-empty list of string "turns" and
    an optional string "category"; a bad line raises ValueError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file {p} not found; pass a JSONL file of "
                                '{"id": ..., "category": ..., "turns": ["..."]} as the first argument')
    items = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            it = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{p}:{n}: not JSON ({e})") from None
        ok = isinstance(it, dict) and "id" in it and isinstance(it.get("category", "?"), str) \
            and isinstance(it.get("turns"), list) and it["turns"] and all(isinstance(t, str) for t in it["turns"])
        if not ok:
            raise ValueError(f"{p}:{n}: {ITEM_SHAPE}")
        items.append(it)
    return items


def _load_items(path: str, limit: int, cats: str | None) -> list[dict]:
    items = read_workload(path)
    want = set(cats.split(",")) if cats else None
    by: dict[str, list] = {}
    for it in items:
        c = it.get("category", "?")
        if want and c not in want:
            continue
        if not limit or len(by.get(c, [])) < limit:
            by.setdefault(c, []).append(it)
    return [it for c in sorted(by) for it in by[c]]


def _run_one(engine, it: dict, mode: str, a, rep: int = 0) -> list[dict]:
    """One item through one mode: each turn of the item (plus --second-turn) as a chat; one record per turn."""
    engine.reset(keep_drafter_state=True)  # a long-running assistant keeps Token Recycling's matrix
    chat = engine.chat()
    turns = list(it["turns"]) + ([a.second_turn] if a.second_turn else [])
    recs = []
    for t, text in enumerate(turns):
        r = chat.ask(text, max_tokens=a.max_tokens, drafter=mode, draft_len=a.draft_len, temperature=a.temp,
                     top_p=a.top_p, top_k=a.top_k, seed=a.seed + rep + 1000 * t)
        st = r.stats
        recs.append({"id": it["id"], "category": it.get("category", "?") + (f"+turn{t + 1}" if t else ""),
                     "mode": mode, "turn": t, "tokens": r.token_ids, "n_gen": st.generated,
                     "prompt_tokens": st.prompt_tokens, "reused_tokens": st.reused_tokens,
                     "prefill_ms": 1000 * st.prefill_s, "decode_s": st.decode_s, "decode_tok_s": st.decode_tok_s,
                     "steps": st.steps, "drafted": st.drafted, "accepted": st.accepted,
                     "mean_accepted": st.mean_accepted, "target_s": st.target_s, "draft_s": st.draft_s,
                     "overhead_ms_per_step": st.overhead_ms_per_step})
    return recs


def _add_learned(total: dict, before: dict, after: dict) -> None:
    """Add one run's share (after - before) of accepted/tested tokens per label to `total`."""
    for x, (h, n) in after.items():
        h0, n0 = before.get(x, (0.0, 0.0))
        if n > n0:
            th, tn = total.get(x, (0.0, 0.0))
            total[x] = (th + h - h0, tn + n - n0)


def summarize(runs: list[dict], modes: list[str], greedy: bool = True) -> dict:
    """Per category and mode: medians over prompts of each prompt's median over repeats; `identical_to_none` counts
    the prompts whose greedy output equals none's (None when sampling)."""
    med = statistics.median
    # per (prompt, turn, mode): median over reps
    cell: dict[tuple, list] = {}
    for r in runs:
        cell.setdefault((r["id"], r["turn"], r["category"], r["mode"]), []).append(r)
    per = {}
    for (pid, turn, cat, mode), rs in cell.items():
        per[(pid, turn, cat, mode)] = {
            "decode_tok_s": med(r["decode_tok_s"] for r in rs),
            "mean_accepted": med(r["mean_accepted"] for r in rs),
            "overhead_ms_per_step": med(r["overhead_ms_per_step"] for r in rs),
            "target_ms_per_step": med(1000 * r["target_s"] / max(1, r["steps"]) for r in rs),
            "draft_ms_per_step": med(1000 * r["draft_s"] / max(1, r["steps"]) for r in rs),
            "tokens": rs[0]["tokens"],
        }
    cats = sorted({k[2] for k in per})
    out = {}
    for c in cats:
        row = {}
        keys = sorted({(k[0], k[1]) for k in per if k[2] == c})
        for m in modes:
            vals = [per[(p, t, c, m)] for p, t in keys if (p, t, c, m) in per]
            if not vals:
                continue
            ref = [per.get((p, t, c, "none")) for p, t in keys]
            same = [per[(p, t, c, m)]["tokens"] == per[(p, t, c, "none")]["tokens"]
                    for p, t in keys if (p, t, c, m) in per and (p, t, c, "none") in per]
            ratios = [per[(p, t, c, m)]["decode_tok_s"] / r["decode_tok_s"]
                      for (p, t), r in zip(keys, ref) if r and (p, t, c, m) in per and r["decode_tok_s"] > 0]
            row[m] = {
                "decode_tok_s": round(med(v["decode_tok_s"] for v in vals), 1),
                "ratio_vs_none": round(med(ratios), 3) if ratios else None,
                "mean_accepted": round(med(v["mean_accepted"] for v in vals), 3),
                "target_ms_per_step": round(med(v["target_ms_per_step"] for v in vals), 2),
                "draft_ms_per_step": round(med(v["draft_ms_per_step"] for v in vals), 2),
                "overhead_ms_per_step": round(med(v["overhead_ms_per_step"] for v in vals), 3),
                "identical_to_none": f"{sum(same)}/{len(same)}" if same and greedy else None,
            }
        out[c] = row
    return out


def markdown(summary: dict, modes: list[str]) -> str:
    head = "| category | " + " | ".join(f"{m} tok/s (×none, acc/step, same as none)" for m in modes) + " |"
    lines = [head, "|" + "---|" * (len(modes) + 1)]
    for c, row in summary.items():
        cells = []
        for m in modes:
            v = row.get(m)
            cells.append("—" if not v else f"{v['decode_tok_s']} (×{v['ratio_vs_none']}, {v['mean_accepted']}, "
                                           f"{v['identical_to_none'] or 'sampled'})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    import edge
    from edge import EngineError, ModelDirError

    from .cli import peak_rss_mb

    from .engine import DRAFTERS, GenerationParams

    modes = list(dict.fromkeys(m.strip() for m in a.modes.split(",") if m.strip()))
    bad = [m for m in modes if m not in DRAFTERS or m == "auto"]
    if bad:
        known = ", ".join(d for d in DRAFTERS if d != "auto")
        print(f"edge-bench: error: --modes {','.join(bad)}: choose from {known}", file=sys.stderr)
        return 2
    if "none" not in modes:
        modes.insert(0, "none")  # the reference every other mode is compared with
    try:  # the engine's own bounds, checked before loading it
        GenerationParams(max_tokens=a.max_tokens, draft_len=a.draft_len, temperature=a.temp, top_p=a.top_p,
                         top_k=a.top_k, seed=a.seed).check(0)
    except EngineError as e:
        print(f"edge-bench: error: --draft-len / --max-tokens / --temp / --top-p / --top-k / --seed: {e}",
              file=sys.stderr)
        return 2
    out, md_out = _outputs(a.out)
    problem = unwritable(out) or unwritable(md_out)
    if problem:  # found now, not after an hour of runs
        print(f"edge-bench: error: --out {a.out}: {problem}", file=sys.stderr)
        return 2
    try:
        items = _load_items(a.prompts, a.limit, a.categories)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        print(f"edge-bench: error: cannot read prompts: {e}", file=sys.stderr)
        return 2
    if not items:
        print(f"edge-bench: error: no prompts selected from {a.prompts}", file=sys.stderr)
        return 2
    try:
        engine = edge.load(a.model, drafter="auto", threads=a.threads)
        for m in modes:  # a drafter this export cannot run is refused here, with the fix named
            engine._resolve(m)
    except (EngineError, ModelDirError) as e:
        print(f"edge-bench: error: {e}", file=sys.stderr)
        return 2
    bar = None
    if not a.quiet:
        try:
            from tqdm import tqdm

            bar = tqdm(total=a.reps * len(items) * len(modes), desc="edge-bench", file=sys.stderr)
        except ImportError:
            pass
    runs = []
    fresh = engine.drafter_state()
    _run_one(engine, items[0], "none", a)  # warm-up
    engine.set_drafter_state(fresh)
    learned: dict[str, tuple[float, float]] = {}  # label -> (accepted, tested) over every speculative run
    t0 = time.time()
    try:
        for i, it in enumerate(items):
            # every run of this prompt drafts from what the earlier prompts taught (a long-running assistant's
            # state), never from this prompt's own earlier answers: Token Recycling would recall them
            before, after = fresh if a.cold else engine.drafter_state(), None
            for rep in range(a.reps):
                k = (i + rep) % len(modes)
                for m in modes[k:] + modes[:k]:  # rotate: no mode always runs first
                    engine.set_drafter_state(before)
                    tested = engine.token_acceptance.tested()
                    for rec in _run_one(engine, it, m, a, rep):
                        rec["rep"] = rep
                        runs.append(rec)
                    after = after or engine.drafter_state()
                    _add_learned(learned, tested, engine.token_acceptance.tested())
                    if bar:
                        bar.update(1)
            engine.set_drafter_state(after)
    except KeyboardInterrupt:
        print("edge-bench: interrupted; summarizing what ran", file=sys.stderr)
    if bar:
        bar.close()
    summary = summarize(runs, modes, greedy=a.temp == 0)
    m = engine.manifest
    sampled = engine.head_hits + engine.head_misses
    doc = {"summary": summary, "modes": modes, "reps": a.reps, "max_tokens": a.max_tokens,
           "model": m.name, "precision": m.target.precision, "threads": a.threads,
           "peak_rss_mb": round(peak_rss_mb(), 1), "wall_s": round(time.time() - t0, 1),
           "min_call": engine.target.min_call, "cold": a.cold,
           "sampling": None if a.temp == 0 else {
               "temperature": a.temp, "top_p": a.top_p, "top_k": a.top_k, "seed": a.seed,
               # rows whose p the on-graph head gave (kernels/postprocess.py); the rest came from the logits
               "rows_from_head": round(engine.head_hits / sampled, 4) if sampled else None},
           "token_acceptance": {x: {"lifetime": round(h / n, 4), "n": int(n)} for x, (h, n) in
                                sorted(learned.items())},
           "runs": runs}
    md = markdown(summary, modes)
    if a.temp > 0:
        md += f"\n\nSampled at temperature {a.temp}, top-p {a.top_p}, top-k {a.top_k or 'off'}, seed {a.seed} + repeat."
    try:
        out.write_text(json.dumps(doc))
        md_out.write_text(md + "\n")
    except OSError as e:  # the runs are not lost: the results go to a temporary file instead
        import tempfile

        fd, spare = tempfile.mkstemp(prefix="edge-bench-", suffix=".json")
        with open(fd, "w") as f:
            f.write(json.dumps(doc))
        print(f"edge-bench: error: cannot write {out} ({e}); the results are in {spare}", file=sys.stderr)
        return 1
    print(json.dumps({"summary": summary, "peak_rss_mb": doc["peak_rss_mb"]}, indent=1))
    print(md)
    return 0


def _outputs(path: str) -> tuple[Path, Path]:
    """The JSON file and the markdown table beside it, never the same file (`--out r.md` writes r.json and r.md)."""
    out = Path(path)
    if out.suffix == ".md":
        out = out.with_suffix(".json")
    return out, out.with_suffix(".md")


if __name__ == "__main__":
    sys.exit(main())
