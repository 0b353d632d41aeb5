"""edge-bench: decode speed of several drafter modes on one loaded model, over a JSONL prompt file.

Modes alternate per prompt (so drift of the machine's speed hits every mode alike), each prompt is repeated
--reps times, and figures are medians. Every run of a prompt starts from the drafter state the earlier prompts
left (Token Recycling's tables, acceptance statistics), never from one that has seen this prompt's own answer.
Every mode's output is compared token for token with `none`'s in the same repeat. With --temp > 0 the modes sample
instead (a prompt's repeat r uses seed --seed + r in every mode, turn t of a chat adds 1000·t); seeded, a chain
drafter draws the very answer plain sampling draws (drafts are checked against one draw per emitted token; a seeded
model drafter drafts its argmax), so sampled outputs are compared too. On graphs that verify trees (fp32
activations), a tree call's logits differ from the path's in the last bits, which may move a sampled draw: sampled
tree modes are not compared there. Speed ratios pair each mode with `none` within a repeat.
With --peer-model, onnxruntime-genai (../shared/peers/) joins the rotation as modes `genai` (greedy) and
`genai-ngram` (its n-gram speculation), on the same token ids, first turns only; the JSON then compares every mode
with the peer's best mode per category (`versus_peer`) and counts the peer's n-gram answers that kept its own greedy
text.
Writes JSON (per category, per prompt, every run; each turn's own peak RSS where Linux can reset the peak) and a
markdown table; asserts nothing about speed. A prompt whose turn does not fit the context is left out in every
mode and listed under `skipped`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from .cli import int_at_least, non_negative_int, peak_rss_mb, positive_int, was_interrupted
from .engine import ContextFull, EngineError
from .files import unwritable, write_atomic
from .memprobe import reset_peak_rss
from .peer import PEER_MODES, PEER_REFERENCE, Peer, PeerError, model_dir_problem

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
    ap.add_argument("--modes", default="none,lookup,recycling,hybrid",
                    help="comma-separated drafter modes (default none,lookup,recycling,hybrid); with --peer-model also "
                         "genai and genai-ngram (both by default)")
    ap.add_argument("--reps", type=positive_int, default=3, help="repetitions per prompt and mode (default 3)")
    ap.add_argument("--max-tokens", type=int_at_least(2), default=128,
                    help="new tokens per answer, at least 2: decode speed starts at the second (default 128)")
    ap.add_argument("--limit", type=non_negative_int, default=0, help="prompts per category (default 0: all)")
    ap.add_argument("--categories", help="comma-separated categories to run (default: all)")
    ap.add_argument("--second-turn", metavar="TEXT",
                    help="after each item's last answer, send TEXT as one more turn (e.g. a rewrite request); "
                         "measured under category '<cat>+turnN', N = the item's turns + 1 (turn2 for single-turn "
                         "items, beside multi-turn items' real second turns)")
    ap.add_argument("--draft-len", type=non_negative_int,
                    help="draft up to this many tokens per step in every mode, 0-64, without the adaptive length "
                         "(default: none, each drafter's adaptive length)")
    ap.add_argument("--temp", type=float, default=0.0,
                    help="sampling temperature (default 0: greedy); greedy or seeded, every mode's output is compared "
                         "with none's")
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
    ap.add_argument("--peer-model", metavar="DIR",
                    help="an onnxruntime-genai model folder (its builder's output, ../shared/peers/README.md): time "
                         "it on the same prompts and token ids, greedy only, in the same rotation")
    ap.add_argument("--peer-python", metavar="PATH",
                    help="the Python that has onnxruntime-genai installed (default: this one)")
    ap.add_argument("--out", default="bench-out/edge-bench.json", help="JSON output (default bench-out/edge-bench.json)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


ITEM_SHAPE = "expected {'id': str or int, 'category': str, 'turns': [str, ...]}"


def read_workload(path: str | Path) -> list[dict]:
    """Every item of a JSONL prompt file, checked: an object with a unique string or integer "id", a non-empty list
    of string "turns" and an optional string "category"; a bad line raises ValueError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file {p} not found; pass a JSONL file of "
                                '{"id": ..., "category": ..., "turns": ["..."]} as the first argument')
    items, seen = [], {}
    for n, raw in enumerate(p.read_bytes().splitlines(), 1):
        try:
            line = raw.decode()
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                             "save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            it = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{p}:{n}: not JSON ({e})") from None
        ok = isinstance(it, dict) and isinstance(it.get("id"), (str, int)) and not isinstance(it["id"], bool) \
            and isinstance(it.get("category", "?"), str) and isinstance(it.get("turns"), list) and it["turns"] \
            and all(isinstance(t, str) for t in it["turns"])
        if not ok:
            raise ValueError(f"{p}:{n}: {ITEM_SHAPE}")
        if any(not t.strip() for t in it["turns"]):  # the engine refuses a blank question: found here, not mid-run
            raise ValueError(f"{p}:{n}: id {it['id']!r} has a blank turn; every turn needs text")
        if it["id"] in seen:  # results are grouped by id: a second prompt would pass for a repeat of the first
            raise ValueError(f"{p}:{n}: id {it['id']!r} is already used on line {seen[it['id']]}; give every "
                             "prompt its own id")
        seen[it["id"]] = n
        items.append(it)
    return items


def _select_items(items: list[dict], path: str, limit: int, cats: str | None) -> list[dict]:
    """Up to `limit` items of each wanted category (0: all), grouped by category; an unknown category raises
    ValueError naming the ones the file has."""
    want = {c.strip() for c in cats.split(",") if c.strip()} if cats else None
    have = sorted({it.get("category", "?") for it in items})
    unknown = sorted(want - set(have)) if want else []
    if unknown:
        raise ValueError(f"--categories {','.join(unknown)}: {path} has no such category; it has "
                         f"{', '.join(have)}")
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
        own_peak = reset_peak_rss()
        r = chat.ask(text, max_tokens=a.max_tokens, drafter=mode, draft_len=a.draft_len, temperature=a.temp,
                     top_p=a.top_p, top_k=a.top_k, seed=a.seed + rep + 1000 * t)
        st = r.stats
        recs.append({"id": it["id"], "category": it.get("category", "?") + (f"+turn{t + 1}" if t else ""),
                     "mode": mode, "turn": t, "tokens": r.token_ids, "n_gen": st.generated,
                     "prompt_tokens": st.prompt_tokens, "reused_tokens": st.reused_tokens,
                     "prefill_ms": 1000 * st.prefill_s, "decode_s": st.decode_s,
                     "decode_tok_s": st.decode_tok_s if st.generated > 1 else None,  # one token: nothing decoded
                     "steps": st.steps, "drafted": st.drafted, "accepted": st.accepted,
                     "mean_accepted": st.mean_accepted, "target_s": st.target_s, "draft_s": st.draft_s,
                     "overhead_ms_per_step": st.overhead_ms_per_step, "python_ms_per_step": st.python_ms_per_step,
                     "peak_rss_mb": peak_rss_mb() if own_peak else None})  # this turn's own peak
    return recs


def _run_peer(peer: Peer, engine, it: dict, mode: str, a) -> list[dict]:
    """The item's first turn through the peer, on the ids edgespec's template gives it (the same as a chat's first
    turn); one record shaped like _run_one's, without edgespec's step counters."""
    ids = engine.encode([{"role": "user", "content": it["turns"][0]}])
    r = peer.run(ids, a.max_tokens, mode)
    n, dec = r.get("n_gen", len(r["tokens"])), r["decode_s"]  # n_gen: its end token counted, as ours is
    return [{"id": it["id"], "category": it.get("category", "?"), "mode": mode, "turn": 0, "tokens": r["tokens"],
             "n_gen": n, "prompt_tokens": len(ids), "reused_tokens": 0, "prefill_ms": 1000 * r["prefill_s"],
             "decode_s": dec, "decode_tok_s": (n - 1) / dec if dec > 0 and n > 1 else None,  # as _run_one's
             "steps": None, "drafted": None, "accepted": None, "mean_accepted": None, "target_s": None,
             "draft_s": None, "overhead_ms_per_step": None, "python_ms_per_step": None,
             "peak_rss_mb": None}]  # the peer's process, not ours


def _add_learned(total: dict, before: dict, after: dict) -> None:
    """Add one run's share (after - before) of accepted/tested tokens per label to `total`."""
    for x, (h, n) in after.items():
        h0, n0 = before.get(x, (0.0, 0.0))
        if n > n0:
            th, tn = total.get(x, (0.0, 0.0))
            total[x] = (th + h - h0, tn + n - n0)


def loops(tokens: list[int], n: int = 8, times: int = 3) -> bool:
    """Does some n-token sequence occur `times` or more in the answer? A looping answer is what weaker quantization
    produces, and n-gram drafting copies it at several times the plain speed, so edge-bench counts them per mode."""
    seen: dict[tuple, int] = {}
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i:i + n])
        seen[g] = seen.get(g, 0) + 1
        if seen[g] >= times:
            return True
    return False


def _med(values, digits: int):
    """Rounded median of the values that exist (a peer's runs have no step counters), else None."""
    v = [x for x in values if x is not None]
    return round(statistics.median(v), digits) if v else None


def _per_prompt(runs: list[dict]) -> dict[tuple, dict]:
    """(prompt id, turn, category, mode) -> medians over its repeats, and each repeat's tokens and decode tok/s
    (`by_rep`: repeat -> (tokens, tok/s), so modes pair up within a repeat)."""
    cell: dict[tuple, list] = {}
    for r in runs:
        cell.setdefault((r["id"], r["turn"], r["category"], r["mode"]), []).append(r)

    def per_step(rs, key):
        return [None if r[key] is None else 1000 * r[key] / max(1, r["steps"]) for r in rs]

    return {k: {"decode_tok_s": _med((r["decode_tok_s"] for r in rs), 9),
                "mean_accepted": _med((r["mean_accepted"] for r in rs), 9),
                "overhead_ms_per_step": _med((r["overhead_ms_per_step"] for r in rs), 9),
                "python_ms_per_step": _med((r.get("python_ms_per_step") for r in rs), 9),
                "target_ms_per_step": _med(per_step(rs, "target_s"), 9),
                "draft_ms_per_step": _med(per_step(rs, "draft_s"), 9),
                "peak_rss_mb": _med((r.get("peak_rss_mb") for r in rs), 1),
                "tokens": rs[0]["tokens"],
                "by_rep": {r.get("rep", 0): (r["tokens"], r["decode_tok_s"]) for r in rs}} for k, rs in cell.items()}


def _pairs(per: dict, c: str, keys: list, m: str, ref: str | None) -> list[tuple[dict, dict]]:
    """Per prompt of category c that both modes ran: (mode m's medians, mode ref's)."""
    return [(per[(p, t, c, m)], per[(p, t, c, ref)]) for p, t in keys if (p, t, c, m) in per and (p, t, c, ref) in per]


def _ratios(per: dict, c: str, keys: list, m: str, ref: str) -> list[float]:
    """Per prompt of category c where both modes ran: the median over repeats of mode m's decode tok/s over mode
    ref's in the same repeat (the two ran minutes apart at most, so the machine's drift cancels)."""
    return [q for q in (_paired_ratio(x, r) for x, r in _pairs(per, c, keys, m, ref)) if q is not None]


def _paired_ratio(x: dict, r: dict) -> float | None:
    """One prompt: the median over repeats of x's decode tok/s over r's in the same repeat."""
    v = [x["by_rep"][k][1] / r["by_rep"][k][1] for k in x["by_rep"].keys() & r["by_rep"].keys()
         if x["by_rep"][k][1] is not None and r["by_rep"][k][1]]
    return statistics.median(v) if v else None


def _same_output(x: dict, r: dict) -> bool:
    """Every repeat of one mode produced the same tokens as the same repeat of the other (greedy: the same answer
    every time; sampled: the same seed)."""
    return all(x["by_rep"][k][0] == r["by_rep"][k][0] for k in x["by_rep"].keys() & r["by_rep"].keys())


def summarize(runs: list[dict], modes: list[str], uncompared: tuple[str, ...] = ()) -> dict:
    """Per category and mode: medians over prompts of each prompt's median over repeats (`ratio_vs_none`: of its
    ratio to `none` within each repeat). `identical_to_none` counts the prompts whose every repeat's output equals
    none's in that repeat (None for the `uncompared` modes); a peer's speculative mode is
    compared with the peer's own greedy output instead (`identical_to_own_greedy`). `looping` counts the prompts
    whose (first repeat's) answer repeats an 8-token sequence 3 times or more."""
    per = _per_prompt(runs)
    out = {}
    for c in sorted({k[2] for k in per}):
        row = {}
        keys = sorted({(k[0], k[1]) for k in per if k[2] == c})
        for m in modes:
            vals = [per[(p, t, c, m)] for p, t in keys if (p, t, c, m) in per]
            if not vals:
                continue
            ratios = _ratios(per, c, keys, m, "none")
            row[m] = {
                "decode_tok_s": _med((v["decode_tok_s"] for v in vals), 1),
                "ratio_vs_none": round(statistics.median(ratios), 3) if ratios else None,
                "mean_accepted": _med((v["mean_accepted"] for v in vals), 3),
                "target_ms_per_step": _med((v["target_ms_per_step"] for v in vals), 2),
                "draft_ms_per_step": _med((v["draft_ms_per_step"] for v in vals), 2),
                "overhead_ms_per_step": _med((v["overhead_ms_per_step"] for v in vals), 3),
                "python_ms_per_step": _med((v["python_ms_per_step"] for v in vals), 3),
                "peak_rss_mb": _med((v["peak_rss_mb"] for v in vals), 1),
                "looping": f"{sum(loops(v['tokens']) for v in vals)}/{len(vals)}",
            }
            if m in PEER_MODES:  # its greedy text differs from ours by its quantization, not by speculation
                ref, key = PEER_REFERENCE.get(m), "identical_to_own_greedy"
            else:
                ref, key = "none", "identical_to_none"
            same = [_same_output(x, r) for x, r in _pairs(per, c, keys, m, ref)]
            row[m][key] = f"{sum(same)}/{len(same)}" if same and m not in uncompared else None
        out[c] = row
    return out


def per_prompt(runs: list[dict], uncompared: tuple[str, ...] = ()) -> list[dict]:
    """One row per prompt, turn and mode: its medians over repeats, its ratio to `none` (paired by repeat) and
    whether its output equals the reference's (`none`'s, or for a peer's n-gram mode the peer's greedy)."""
    per = _per_prompt(runs)
    rows = []
    for (p, t, c, m), v in per.items():
        ref = per.get((p, t, c, PEER_REFERENCE.get(m) if m in PEER_MODES else "none"))
        base = per.get((p, t, c, "none"))
        rows.append({"id": p, "turn": t, "category": c, "mode": m, "decode_tok_s": _med([v["decode_tok_s"]], 2),
                     "ratio_vs_none": None if base is None or (q := _paired_ratio(v, base)) is None else round(q, 3),
                     "mean_accepted": _med([v["mean_accepted"]], 3), "peak_rss_mb": v["peak_rss_mb"],
                     "identical": None if ref is None or ref is v or m in uncompared else _same_output(v, ref)})
    return rows


def versus_peer(runs: list[dict], modes: list[str]) -> dict:
    """Per category: the peer's fastest mode there (median decode tok/s) and, for every edgespec mode, the median
    over prompts of its decode tok/s over that peer mode's (first turns: the peer runs no others)."""
    per = _per_prompt(runs)
    ours, theirs = [m for m in modes if m not in PEER_MODES], [m for m in modes if m in PEER_MODES]
    out = {}
    for c in sorted({k[2] for k in per}):
        keys = sorted({(k[0], k[1]) for k in per if k[2] == c})
        speed = {m: _med((per[(p, t, c, m)]["decode_tok_s"] for p, t in keys if (p, t, c, m) in per), 3)
                 for m in theirs}
        speed = {m: v for m, v in speed.items() if v is not None}
        if not speed:
            continue
        best = max(speed, key=speed.get)
        row = {"peer_best": best}
        for m in ours:
            r = _ratios(per, c, keys, m, best)
            row[m] = round(statistics.median(r), 3) if r else None
        out[c] = row
    return out


def markdown(summary: dict, modes: list[str], peer: dict | None = None) -> str:
    def same(m):
        return f"same as {PEER_REFERENCE[m]}" if m in PEER_REFERENCE else "—" if m in PEER_MODES else "same as none"

    head = "| category | " + " | ".join(f"{m} tok/s (×none, acc/step, Python ms/step, {same(m)}, looping)"
                                     for m in modes) + " |"
    lines = [head, "|" + "---|" * (len(modes) + 1)]
    for c, row in summary.items():
        cells = []
        for m in modes:
            v = row.get(m)
            if not v:
                cells.append("—")
                continue
            kept = v.get("identical_to_none", v.get("identical_to_own_greedy"))
            kept = kept or ("—" if m in PEER_MODES and m not in PEER_REFERENCE else "not compared")
            acc = "—" if v["mean_accepted"] is None else v["mean_accepted"]
            py = "—" if v.get("python_ms_per_step") is None else v["python_ms_per_step"]
            cells.append(f"{v['decode_tok_s']} (×{v['ratio_vs_none']}, {acc}, {py}, {kept}, {v['looping']})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if peer:
        ours = [m for m in modes if m not in PEER_MODES]
        lines += ["", "| category | peer's best mode | " + " | ".join(f"{m} × peer best" for m in ours) + " |",
                  "|" + "---|" * (len(ours) + 2)]
        for c, row in peer.items():
            lines.append(f"| {c} | {row['peer_best']} | " + " | ".join("—" if row.get(m) is None else str(row[m])
                                                                        for m in ours) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        return _main(a)
    except (KeyboardInterrupt, ImportError) as e:  # Ctrl-C while loading or warming up; _bench catches later ones
        if not was_interrupted(e):
            raise
        print("edge-bench: interrupted", file=sys.stderr)  # in start-up or warm-up, or in the final writes
        return 130


def _main(a) -> int:
    import edge

    from .engine import DRAFTERS, GenerationParams

    modes = list(dict.fromkeys(m.strip() for m in a.modes.split(",") if m.strip()))
    bad = [m for m in modes if (m not in DRAFTERS or m == "auto") and not (m in PEER_MODES and a.peer_model)]
    if bad:
        known = ", ".join([d for d in DRAFTERS if d != "auto"] + (list(PEER_MODES) if a.peer_model else []))
        hint = "; genai modes need --peer-model" if any(m in PEER_MODES for m in bad) else ""
        print(f"edge-bench: error: --modes {','.join(bad)}: choose from {known}{hint}", file=sys.stderr)
        return 2
    if "none" not in modes:
        modes.insert(0, "none")  # the reference every other mode is compared with
    if a.second_turn is not None and not a.second_turn.strip():
        print("edge-bench: error: --second-turn is empty: pass the text to send after each first answer "
              "(e.g. --second-turn 'Now make it shorter'), or leave the flag out", file=sys.stderr)
        return 2
    if a.peer_python and not a.peer_model:
        print("edge-bench: error: --peer-python needs --peer-model (the onnxruntime-genai model folder)",
              file=sys.stderr)
        return 2
    if a.peer_model:
        problem = model_dir_problem(a.peer_model)
        if problem:  # found before loading anything or starting the worker
            print(f"edge-bench: error: --peer-model {a.peer_model}: {problem}", file=sys.stderr)
            return 2
        if a.temp > 0:
            print("edge-bench: error: --peer-model times greedy decoding only; drop --temp", file=sys.stderr)
            return 2
        if not any(m in PEER_MODES for m in modes):
            modes += list(PEER_MODES)
        if "genai-ngram" in modes and "genai" not in modes:
            modes.append("genai")  # the reference its n-gram answers are compared with
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
        items = read_workload(a.prompts)
    except (OSError, ValueError) as e:
        print(f"edge-bench: error: cannot read prompts: {e}", file=sys.stderr)
        return 2
    try:
        items = _select_items(items, a.prompts, a.limit, a.categories)
    except ValueError as e:
        print(f"edge-bench: error: {e}", file=sys.stderr)
        return 2
    if not items:
        print(f"edge-bench: error: no prompts selected from {a.prompts}", file=sys.stderr)
        return 2
    try:
        engine = edge.load(a.model, drafter="auto", threads=a.threads)
        for m in modes:  # a drafter this export cannot run is refused here, with the fix named
            if m not in PEER_MODES:
                engine._resolve(m)
    except EngineError as e:  # a ModelDirError too
        print(f"edge-bench: error: {e}", file=sys.stderr)
        return 2
    peer = None
    try:
        if a.peer_model:
            try:
                peer = Peer(a.peer_python or sys.executable, a.peer_model, a.threads)
                _run_peer(peer, engine, items[0], "genai", a)  # warm-up: a peer that loads but cannot answer fails
            except PeerError as e:
                print(f"edge-bench: error: --peer-model {a.peer_model}: {e}", file=sys.stderr)
                return 2
        return _bench(a, engine, items, modes, peer, out, md_out)
    finally:  # Ctrl-C included: no worker left behind
        if peer:
            peer.close()


def _bench(a, engine, items: list[dict], modes: list[str], peer: Peer | None, out: Path, md_out: Path) -> int:
    runs, skipped = [], []
    start_peak = peak_rss_mb()  # loading; the warm-up and each run then measure their own peaks
    fresh = engine.drafter_state()
    for it in items:  # warm-up on the first item that fits the context (Ctrl-C here reaches main: nothing ran yet)
        try:
            _run_one(engine, it, "none", a)
            break
        except ContextFull:
            continue
    else:
        print(f"edge-bench: error: no prompt of {a.prompts} fits the model's context ({engine.context} tokens) "
              f"with --max-tokens {a.max_tokens}", file=sys.stderr)
        return 2
    engine.set_drafter_state(fresh)
    total, done = a.reps * len(items) * len(modes), 0
    bar = None
    if not a.quiet:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="edge-bench", file=sys.stderr)
        except ImportError:
            pass
    learned: dict[str, tuple[float, float]] = {}  # label -> (accepted, tested) over every speculative run
    t0 = time.time()
    failed: str | None = None  # why the run stopped early, when it did
    interrupted = False
    try:
        for i, it in enumerate(items):
            # every run of this prompt drafts from what the earlier prompts taught (a long-running assistant's
            # state), never from this prompt's own earlier answers: Token Recycling would recall them
            before, after = fresh if a.cold else engine.drafter_state(), None
            first_run, done_before, learned_before = len(runs), done, dict(learned)
            try:
                for rep in range(a.reps):
                    k = (i + rep) % len(modes)
                    for m in modes[k:] + modes[:k]:  # rotate: no mode always runs first
                        engine.set_drafter_state(before)
                        tested = engine.token_acceptance.tested()
                        recs = (_run_peer(peer, engine, it, m, a) if m in PEER_MODES
                                else _run_one(engine, it, m, a, rep))
                        for rec in recs:
                            rec["rep"] = rep
                            runs.append(rec)
                        if m not in PEER_MODES and m != "none":  # what this prompt taught the drafters (plain
                            after = after or engine.drafter_state()  # decoding and the peer teach them nothing)
                        _add_learned(learned, tested, engine.token_acceptance.tested())
                        done += 1
                        if bar:
                            bar.update(1)
            except ContextFull as e:  # a turn of this item does not fit the context: the item is left out in
                del runs[first_run:]  # every mode, so all modes are compared over the same prompts
                learned, done, total = learned_before, done_before, total - a.reps * len(modes)
                engine.set_drafter_state(before)
                skipped.append({"id": it["id"], "error": str(e)})
                print(f"edge-bench: skipped prompt {it['id']!r}: {e}", file=sys.stderr)
                continue
            engine.set_drafter_state(after or before)
    except KeyboardInterrupt:  # what ran is kept; the exit code and an "interrupted" field say it is incomplete
        print("edge-bench: interrupted; summarizing what ran", file=sys.stderr)
        interrupted = True
    except PeerError as e:  # what ran is kept, and the exit code says the run is incomplete
        print(f"edge-bench: error: the peer failed ({e}); summarizing what ran", file=sys.stderr)
        failed = f"the peer failed: {e}"
    except EngineError as e:  # anything else the engine refuses: the same
        print(f"edge-bench: error: {e}; summarizing what ran", file=sys.stderr)
        failed = str(e)
    if bar:
        bar.close()
    if not runs:  # an empty table must not replace the results of an earlier run
        print(f"edge-bench: no run finished; {out} and {md_out} left as they were", file=sys.stderr)
        return 130 if interrupted else 1
    # sampled tree calls may move a draw (their logits differ from the path's in the last bits): not compared
    uncompared = ("recycling", "hybrid") if a.temp > 0 and engine.target.tree_exact else ()
    summary = summarize(runs, modes, uncompared)
    vs_peer = versus_peer(runs, modes) if peer else None
    m = engine.manifest
    sampled = engine.head_hits + engine.head_misses
    doc = {"summary": summary, "modes": modes, "reps": a.reps, "max_tokens": a.max_tokens,
           "model": m.name, "precision": m.target.precision, "threads": a.threads,
           "peak_rss_mb": round(max([start_peak, peak_rss_mb()] + [r["peak_rss_mb"] or 0 for r in runs]), 1),
           "wall_s": round(time.time() - t0, 1),
           "min_call": engine.target.min_call, "cold": a.cold, "interrupted": interrupted, "failed": failed,
           "skipped": skipped,
           "runs_done": done, "runs_planned": total,
           "sampling": None if a.temp == 0 else {
               "temperature": a.temp, "top_p": a.top_p, "top_k": a.top_k, "seed": a.seed,
               # rows whose p the on-graph head gave (kernels/postprocess.py); the rest came from the logits
               "rows_from_head": round(engine.head_hits / sampled, 4) if sampled else None},
           "peer": None if not peer else {"runtime": "onnxruntime-genai", "version": peer.version,
                                           "model": str(a.peer_model), "ngram": "size 3, up to 10 draft tokens"},
           "versus_peer": vs_peer,
           "token_acceptance": {x: {"lifetime": round(h / n, 4), "n": int(n)} for x, (h, n) in
                                sorted(learned.items())},
           "per_prompt": per_prompt(runs, uncompared), "runs": runs}
    md = markdown(summary, modes, vs_peer)
    if a.temp > 0:
        md += f"\n\nSampled at temperature {a.temp}, top-p {a.top_p}, top-k {a.top_k or 'off'}, seed {a.seed} + repeat."
    if interrupted or failed:
        why = "Interrupted" if interrupted else f"Stopped by an error ({failed})"
        md += f"\n\n{why}: {done} of {total} runs (prompt × mode × repeat) finished; the table shows those."
    if skipped:
        md += (f"\n\nSkipped (a turn does not fit the context, in every mode): "
               + ", ".join(str(s["id"]) for s in skipped) + ".")
    try:
        write_atomic(out, json.dumps(doc))
        write_atomic(md_out, md + "\n")
    except OSError as e:  # the runs are not lost: the results go to a temporary file instead
        import tempfile

        fd, spare = tempfile.mkstemp(prefix="edge-bench-", suffix=".json")
        with open(fd, "w") as f:
            f.write(json.dumps(doc))
        print(f"edge-bench: error: cannot write {out} ({e}); the results are in {spare}", file=sys.stderr)
        return 1
    print(json.dumps({"summary": summary, "versus_peer": vs_peer, "peak_rss_mb": doc["peak_rss_mb"]}, indent=1))
    print(md)
    return 130 if interrupted else 1 if failed else 0


def _outputs(path: str) -> tuple[Path, Path]:
    """The JSON file and the markdown table beside it, never the same file (`--out r.md` writes r.json and r.md)."""
    out = Path(path)
    if out.suffix == ".md":
        out = out.with_suffix(".json")
    return out, out.with_suffix(".md")


if __name__ == "__main__":
    sys.exit(main())
