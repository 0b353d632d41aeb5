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
With --peer-model (onnxruntime-genai, ../shared/peers/) and --llama-model (llama.cpp), peer runtimes join the
rotation, each in its own Python process, on the same token ids, first turns only: modes `genai` (greedy) and
`genai-ngram` (its n-gram speculation) for one folder, `genai-LABEL` and `genai-LABEL-ngram` for several (LABEL=DIR,
or the folder's name), `llama` (greedy) or `llama-LABEL`. The JSON then compares every mode with the fastest peer
mode per category (`versus_peer`) and counts the n-gram answers that kept their runtime's own greedy text.
With --reference-hf, transformers' fp32 greedy answer to every first turn (same ids, same max tokens; run once in
its own process and cached) is the reference each mode's first answers are compared with: tokens before they
diverge from it, and answers identical to it. `runtimes` (JSON and the last markdown table) gives per mode, over
first turns: decode and prefill tok/s, that fidelity, and the peak RSS of the process running it at one context
(--context for every runtime): edgespec's is edge-bench's own process (loading's peak, and each of the mode's
turns' own peak, VmHWM reset before each turn), a peer's its worker's (its peak once loaded, and each run's own).
Writes JSON (per category, per prompt, every run; each turn's own peak RSS where Linux can reset the peak) and a
markdown table; asserts nothing about speed. A prompt whose turn does not fit the context is left out in every
mode and listed under `skipped`.
A model without a chat template (a base model) completes each prompt as raw text instead, encoded with its
tokenizer's own BOS rule, in every mode and runtime alike; its prompts have one turn each (`prompt_format`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from ..args import (add_model_arg, add_version, int_at_least, non_negative_int, plain_warnings, positive_int,
                    was_interrupted)
from ..engine import ContextFull, EngineError
from ..files import unwritable, write_atomic
from ..measure import peak_rss_mb, reset_peak_rss
from .peer import (HF_WORKER, RUNTIMES, Peer, PeerError, PeerSpec, gguf_file_problem, is_peer_mode,
                   model_dir_problem, parse_peer_models, peer_reference)

# shipped with the package, so a wheel or a plain clone benchmarks without ../shared: the first 3 prompts of each
# category of ../shared/workloads/public.jsonl whose data licence is stated (code MIT, math MIT, qa CC BY-SA 3.0;
# each item carries its source and licence); the input-grounded categories there state none, so they stay out
DEFAULT_PROMPTS = Path(__file__).resolve().with_name("prompts.jsonl")


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The prompt file, model and thread flags edge-bench and edge-profile share."""
    ap.add_argument("prompts", nargs="?", default=str(DEFAULT_PROMPTS), metavar="PROMPTS",
                    help="JSONL file, one prompt per line: {\"id\": ..., \"category\": ..., \"turns\": [\"...\"]} "
                         "(category optional: results are grouped by it, under \"?\" without one; default: the 9 "
                         "prompts shipped with edgespec, 3 each of code, math and qa)")
    add_model_arg(ap)
    ap.add_argument("--threads", type=positive_int, default=2, help="CPU threads for ONNX Runtime (default 2)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edge-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--modes", default="none,lookup,recycling,hybrid",
                    help="comma-separated drafter modes (default none,lookup,recycling,hybrid); with --peer-model / "
                         "--llama-model also the peers' modes (genai, genai-ngram, genai-LABEL[-ngram], llama, "
                         "llama-LABEL; a peer none of whose modes is named runs all of them)")
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
    ap.add_argument("--peer-model", metavar="[LABEL=]DIR", action="append",
                    help="an onnxruntime-genai model folder (what `python -m onnxruntime_genai.models.builder -i "
                         "HF_DIR -o DIR -p int4 -e cpu` writes): time "
                         "it on the same prompts and token ids, greedy only, in the same rotation; repeat the flag "
                         "or give a comma list for several (modes genai-LABEL, LABEL defaulting to the folder's name)")
    ap.add_argument("--peer-python", metavar="PATH",
                    help="the Python that has onnxruntime-genai installed (default: this one)")
    ap.add_argument("--llama-model", metavar="[LABEL=]FILE", action="append",
                    help="a GGUF file for llama.cpp (llama-cpp-python), timed like --peer-model: mode llama, or "
                         "llama-LABEL for several")
    ap.add_argument("--llama-python", metavar="PATH",
                    help="the Python that has llama-cpp-python installed (default: this one)")
    ap.add_argument("--context", type=positive_int,
                    help="KV cache size in tokens of every runtime: edgespec's engine, llama.cpp's n_ctx, "
                         "onnxruntime-genai's max_length (default: the engine's, 4096 or the export's maximum)")
    ap.add_argument("--reference-hf", metavar="DIR",
                    help="a Hugging Face checkpoint folder of the same model: compare every mode's first answers "
                         "with transformers' fp32 greedy answers (tokens before divergence)")
    ap.add_argument("--reference-python", metavar="PATH",
                    help="the Python that has torch and transformers installed (default: this one)")
    ap.add_argument("--reference-cache", metavar="FILE",
                    help="where the fp32 answers are kept between runs (default: "
                         "$EDGESPEC_HOME/reference/<folder name>-<hash of its path>.json)")
    ap.add_argument("--rss-own-process", action="store_true",
                    help="after the timed runs, replay the prompts once more per edgespec mode, each in a fresh "
                         "process of its own (python -m edge.tools.memprobe: first turns, greedy, the same reps, "
                         "--limit, --categories and --draft-len), and report that process's peak RSS, as each peer's "
                         "is its worker's (default: edgespec's modes share this process, whose peak also holds every "
                         "mode's state and any drafter session)")
    ap.add_argument("--out", default="bench-out/edge-bench.json", help="JSON output (default bench-out/edge-bench.json)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    add_version(ap)
    return ap


ITEM_SHAPE = "expected {'id': str or int, 'category': str, 'turns': [str, ...]}"


def read_workload(path: str | Path) -> list[dict]:
    """Every item of a JSONL prompt file, checked: an object with a unique string or integer "id", a non-empty list
    of string "turns" and an optional string "category"; a bad line raises ValueError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        what = "is a folder, not a prompt file" if p.is_dir() else "not found"
        raise FileNotFoundError(f"prompt file {p} {what}; pass a JSONL file of "
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


def _prefill_tok_s(prompt_tokens: int, prefill_s: float) -> float | None:
    """Prompt tokens prefilled per second (prefill: the prompt's forward and the first token's pick)."""
    return prompt_tokens / prefill_s if prefill_s > 0 and prompt_tokens > 0 else None


def agreement(tokens: list[int], ref: list[int], end: set | frozenset = frozenset()) -> tuple[int, bool]:
    """(tokens before `tokens` diverge from `ref`, whether they are the same answer), an end token at the end of
    either left out (edgespec keeps its end token in the ids, onnxruntime-genai and the reference do not)."""
    a = tokens[:-1] if tokens and tokens[-1] in end else tokens
    b = ref[:-1] if ref and ref[-1] in end else ref
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n, list(a) == list(b)


def _with_fidelity(rec: dict, reference: dict | None, end: set) -> dict:
    """Add the first turn's agreement with the fp32 reference answer (None without one)."""
    ref = (reference or {}).get(rec["id"]) if rec["turn"] == 0 else None
    rec["fp32_agreed"], rec["fp32_identical"] = agreement(rec["tokens"], ref, end) if ref is not None else (None,
                                                                                                              None)
    return rec


def _run_one(engine, it: dict, mode: str, a, rep: int = 0, reference: dict | None = None) -> list[dict]:
    """One item through one mode: each turn of the item (plus --second-turn) as a chat, or on a model without a
    chat template its one turn completed as a raw prompt; one record per turn."""
    engine.reset(keep_drafter_state=True)  # a long-running assistant keeps Token Recycling's matrix
    if completes_raw(engine):
        _budget(engine, _first_ids(engine, it), a.max_tokens)  # a prompt that does not fit: skipped in every mode
        ask = partial(engine.generate, raw=True)
    else:
        ask = engine.chat().ask
    turns = list(it["turns"]) + ([a.second_turn] if a.second_turn else [])
    recs = []
    for t, text in enumerate(turns):
        own_peak = reset_peak_rss()
        r = ask(text, max_tokens=a.max_tokens, drafter=mode, draft_len=a.draft_len, temperature=a.temp,
                top_p=a.top_p, top_k=a.top_k, seed=a.seed + rep + 1000 * t)
        st = r.stats
        recs.append(_with_fidelity({
            "id": it["id"], "category": it.get("category", "?") + (f"+turn{t + 1}" if t else ""),
            "mode": mode, "turn": t, "tokens": r.token_ids, "n_gen": st.generated,
            "prompt_tokens": st.prompt_tokens, "reused_tokens": st.reused_tokens,
            "prefill_ms": 1000 * st.prefill_s,
            "prefill_tok_s": _prefill_tok_s(st.prompt_tokens - st.reused_tokens, st.prefill_s),
            "decode_s": st.decode_s,
            "decode_tok_s": st.decode_tok_s if st.generated > 1 else None,  # one token: nothing decoded
            "steps": st.steps, "drafted": st.drafted, "accepted": st.accepted,
            "mean_accepted": st.mean_accepted, "target_s": st.target_s, "draft_s": st.draft_s,
            "overhead_ms_per_step": st.overhead_ms_per_step, "python_ms_per_step": st.python_ms_per_step,
            "peak_rss_mb": round(peak_rss_mb(), 1) if own_peak else None}, reference, _end_ids(engine)))  # this turn's own
    return recs


def _end_ids(engine) -> set:
    return set(getattr(engine, "eos", ()) or ())


def completes_raw(engine) -> bool:
    """A model without a chat template (a base model) completes each prompt as it is: its text encoded with the
    tokenizer's own BOS rule, as llama.cpp and transformers encode a prompt, one turn per item."""
    return engine.manifest.chat_template is None


def _first_ids(engine, it: dict) -> list[int]:
    """The ids of the item's first turn as a chat's first turn sends them, or its raw prompt's on a model without
    a chat template (what every runtime is fed): `Engine.encode` of the text does either."""
    return engine.encode(it["turns"][0])


def _budget(engine, ids: list[int], max_tokens: int) -> int:
    """New tokens a peer may produce after `ids` within the engine's context; a prompt that does not fit is refused
    as edgespec's chat refuses it, so the item is skipped in every mode."""
    if len(ids) >= engine.context:
        raise ContextFull(f"prompt is {len(ids)} tokens but the context holds {engine.context}", len(ids),
                          engine.context)
    return min(max_tokens, engine.context - len(ids))


def _run_peer(peer: Peer, engine, it: dict, mode: str, a, reference: dict | None = None) -> list[dict]:
    """The item's first turn through the peer, on the ids edgespec gives it (_first_ids: the same as a chat's first
    turn, or the raw prompt's); one record shaped like _run_one's, without edgespec's step counters. Its peak RSS is
    the worker's."""
    ids = _first_ids(engine, it)
    r = peer.run(ids, _budget(engine, ids, a.max_tokens), mode, stop=sorted(_end_ids(engine)))
    n, dec = r.get("n_gen", len(r["tokens"])), r["decode_s"]  # n_gen: its end token counted, as ours is
    return [_with_fidelity({
        "id": it["id"], "category": it.get("category", "?"), "mode": mode, "turn": 0, "tokens": r["tokens"],
        "n_gen": n, "prompt_tokens": len(ids), "reused_tokens": 0, "prefill_ms": 1000 * r["prefill_s"],
        "prefill_tok_s": _prefill_tok_s(len(ids), r["prefill_s"]),
        "decode_s": dec, "decode_tok_s": (n - 1) / dec if dec > 0 and n > 1 else None,  # as _run_one's
        "steps": None, "drafted": None, "accepted": None, "mean_accepted": None, "target_s": None,
        "draft_s": None, "overhead_ms_per_step": None, "python_ms_per_step": None,
        "peak_rss_mb": r.get("peak_rss_mb")}, reference, _end_ids(engine))]  # the worker's, not ours


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
                "prefill_tok_s": _med((r.get("prefill_tok_s") for r in rs), 9),
                "fp32_agreed": _med((r.get("fp32_agreed") for r in rs), 1),
                "fp32_identical": None if any(r.get("fp32_identical") is None for r in rs)
                else all(r["fp32_identical"] for r in rs),
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
    whose (first repeat's) answer repeats an 8-token sequence 3 times or more. With an fp32 reference, first turns
    also give `tokens_before_divergence` (median over prompts) and `identical_to_fp32` (prompts)."""
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
                "prefill_tok_s": _med((v["prefill_tok_s"] for v in vals), 1),
                "looping": f"{sum(loops(v['tokens']) for v in vals)}/{len(vals)}",
            }
            row[m].update(_fidelity(vals))
            if is_peer_mode(m):  # its greedy text differs from ours by its quantization, not by speculation
                ref, key = peer_reference(m), "identical_to_own_greedy"
            else:
                ref, key = "none", "identical_to_none"
            same = [_same_output(x, r) for x, r in _pairs(per, c, keys, m, ref)]
            row[m][key] = f"{sum(same)}/{len(same)}" if same and m not in uncompared else None
        out[c] = row
    return out


def _fidelity(vals: list[dict]) -> dict:
    """Over the prompts (per-prompt medians) compared with the fp32 reference: the median of the tokens before
    divergence and how many answers were identical; {} when none was compared."""
    done = [v for v in vals if v["fp32_agreed"] is not None]
    if not done:
        return {}
    return {"tokens_before_divergence": _med((v["fp32_agreed"] for v in done), 1),
            "identical_to_fp32": f"{sum(bool(v['fp32_identical']) for v in done)}/{len(done)}"}


def per_prompt(runs: list[dict], uncompared: tuple[str, ...] = ()) -> list[dict]:
    """One row per prompt, turn and mode: its medians over repeats, its ratio to `none` (paired by repeat) and
    whether its output equals the reference's (`none`'s, or for a peer's n-gram mode the peer's greedy)."""
    per = _per_prompt(runs)
    rows = []
    for (p, t, c, m), v in per.items():
        ref = per.get((p, t, c, peer_reference(m) if is_peer_mode(m) else "none"))
        base = per.get((p, t, c, "none"))
        rows.append({"id": p, "turn": t, "category": c, "mode": m, "decode_tok_s": _med([v["decode_tok_s"]], 2),
                     "ratio_vs_none": None if base is None or (q := _paired_ratio(v, base)) is None else round(q, 3),
                     "mean_accepted": _med([v["mean_accepted"]], 3), "peak_rss_mb": v["peak_rss_mb"],
                     "prefill_tok_s": _med([v["prefill_tok_s"]], 1), "tokens_before_divergence": v["fp32_agreed"],
                     "identical_to_fp32": v["fp32_identical"],
                     "identical": None if ref is None or ref is v or m in uncompared else _same_output(v, ref)})
    return rows


def versus_peer(runs: list[dict], modes: list[str]) -> dict:
    """Per category: the peer's fastest mode there (median decode tok/s) and, for every edgespec mode, the median
    over prompts of its decode tok/s over that peer mode's (first turns: the peer runs no others)."""
    per = _per_prompt(runs)
    ours, theirs = [m for m in modes if not is_peer_mode(m)], [m for m in modes if is_peer_mode(m)]
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


def runtimes(runs: list[dict], modes: list[str], load_peaks: dict | None = None, names: dict | None = None) -> dict:
    """Per mode, over first turns (the turns every runtime answers): the median over prompts of decode and prefill
    tok/s (each prompt's median over repeats), the agreement with fp32 greedy, and the peak RSS of the process that
    runs it: the largest of its peak once loaded (`load_peaks`) and every one of its runs' own peaks."""
    per = _per_prompt([r for r in runs if r["turn"] == 0])
    out = {}
    for m in modes:
        vals = [v for k, v in per.items() if k[3] == m]
        if not vals:
            continue
        peaks = [r["peak_rss_mb"] for r in runs if r["mode"] == m and r.get("peak_rss_mb") is not None]
        peaks += [x for x in [(load_peaks or {}).get(m)] if x is not None]
        out[m] = {"runtime": (names or {}).get(m, m), "prompts": len(vals),
                  "decode_tok_s": _med((v["decode_tok_s"] for v in vals), 1),
                  "prefill_tok_s": _med((v["prefill_tok_s"] for v in vals), 1),
                  "tokens_before_divergence": None, "identical_to_fp32": None, **_fidelity(vals),
                  "peak_rss_mb": round(max(peaks), 1) if peaks else None}
    return out


def runtimes_markdown(rows: dict, context: int | None) -> str:
    def cell(x):
        return "—" if x is None else str(x)

    lines = ["| runtime · mode | prompts | decode tok/s | prefill tok/s | tokens before divergence from fp32 greedy "
             f"(median) | identical to fp32 greedy | peak RSS MB (context {cell(context)}) |", "|" + "---|" * 7]
    for v in rows.values():
        lines.append("| " + " | ".join(cell(v[k]) for k in ("runtime", "prompts", "decode_tok_s", "prefill_tok_s",
                                                             "tokens_before_divergence", "identical_to_fp32",
                                                             "peak_rss_mb")) + " |")
    return "\n".join(lines)


def markdown(summary: dict, modes: list[str], peer: dict | None = None) -> str:
    def same(m):
        ref = peer_reference(m)
        return f"same as {ref}" if ref else "—" if is_peer_mode(m) else "same as none"

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
            kept = kept or ("—" if is_peer_mode(m) and not peer_reference(m) else "not compared")
            acc = "—" if v["mean_accepted"] is None else v["mean_accepted"]
            py = "—" if v.get("python_ms_per_step") is None else v["python_ms_per_step"]
            cells.append(f"{v['decode_tok_s']} (×{v['ratio_vs_none']}, {acc}, {py}, {kept}, {v['looping']})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if peer:
        ours = [m for m in modes if not is_peer_mode(m)]
        lines += ["", "| category | peer's best mode | " + " | ".join(f"{m} × peer best" for m in ours) + " |",
                  "|" + "---|" * (len(ours) + 2)]
        for c, row in peer.items():
            lines.append(f"| {c} | {row['peer_best']} | " + " | ".join("—" if row.get(m) is None else str(row[m])
                                                                        for m in ours) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    plain_warnings("edge-bench")
    try:
        return _main(a)
    except (KeyboardInterrupt, ImportError) as e:  # Ctrl-C while loading or warming up; _bench catches later ones
        if not was_interrupted(e):
            raise
        print("edge-bench: interrupted", file=sys.stderr)  # in start-up or warm-up, or in the final writes
        return 130


def _main(a) -> int:
    import edge

    from ..drafters import DRAFTER_CHOICES, DRAFTER_KINDS
    from ..engine import GenerationParams

    modes = list(dict.fromkeys(m.strip() for m in a.modes.split(",") if m.strip()))
    try:
        specs = _peer_specs(a)
    except ValueError as e:  # found before loading anything or starting a worker
        print(f"edge-bench: error: {e}", file=sys.stderr)
        return 2
    peer_modes = {m for s in specs for m in s.modes}
    bad = [m for m in modes if m not in DRAFTER_KINDS and m not in peer_modes]
    if bad:
        known = ", ".join([d for d in DRAFTER_CHOICES if d != "auto"] + sorted(peer_modes))
        hint = "".join(f"; {rt} modes need {flag}" for rt, flag in _FLAG.items()
                       if any(m == rt or m.startswith(rt + "-") for m in bad) and not any(s.runtime == rt
                                                                                         for s in specs))
        print(f"edge-bench: error: --modes {','.join(bad)}: choose from {known}{hint}", file=sys.stderr)
        return 2
    if "none" not in modes:
        modes.insert(0, "none")  # the reference every other mode is compared with
    for s in specs:
        if not any(m in s.modes for m in modes):  # a peer none of whose modes is named runs them all
            modes += list(s.modes)
    for m in list(modes):
        if peer_reference(m) and peer_reference(m) not in modes:
            modes.append(peer_reference(m))  # the greedy answers its n-gram answers are compared with
    if a.second_turn is not None and not a.second_turn.strip():
        print("edge-bench: error: --second-turn is empty: pass the text to send after each first answer "
              "(e.g. --second-turn 'Now make it shorter'), or leave the flag out", file=sys.stderr)
        return 2
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
        engine = edge.load(a.model, drafter="auto", threads=a.threads, context=a.context)
        for m in modes:  # a drafter this export cannot run is refused here, with the fix named
            if not is_peer_mode(m):
                engine._resolve(m)
    except EngineError as e:  # a ModelDirError too
        print(f"edge-bench: error: {e}", file=sys.stderr)
        return 2
    chats = [str(it["id"]) for it in items if len(it["turns"]) > 1]
    if completes_raw(engine) and (chats or a.second_turn):
        what = f"prompts {', '.join(chats[:5])} have several turns" if chats else "--second-turn adds a turn"
        print(f"edge-bench: error: {what}, but {a.model or 'the model'} has no chat template: it completes one raw "
              "prompt per item; give single-turn prompts", file=sys.stderr)
        return 2
    reference = ref_info = None
    if a.reference_hf:  # before any worker starts: its process is gone before the timed runs begin
        try:
            reference, ref_info = _reference_answers(a, engine, items)
        except PeerError as e:
            print(f"edge-bench: error: --reference-hf {a.reference_hf}: {e}", file=sys.stderr)
            return 2
    peers: dict[str, Peer] = {}  # mode -> its worker
    started, info = [], []
    try:
        warm = next((it for it in items if len(_first_ids(engine, it)) < engine.context), None)
        for s in specs:
            try:
                p = Peer(s.python, s.path, a.threads, worker=RUNTIMES[s.runtime][1], context=engine.context,
                         modes=s.modes)
                started.append(p)
                if warm is not None:  # warm-up: a peer that loads but cannot answer fails here
                    _run_peer(p, engine, warm, s.name, a)
            except PeerError as e:
                print(f"edge-bench: error: {_FLAG[s.runtime]} {s.path}: {e}", file=sys.stderr)
                return 2
            peers.update({m: p for m in s.modes if m in modes})
            info.append({"name": s.name, "runtime": s.runtime_name, "label": s.label, "model": s.path,
                         "python": s.python, "version": p.version, "modes": [m for m in s.modes if m in modes],
                         "load_peak_rss_mb": p.load_peak_rss_mb,
                         **({"ngram": "size 3, up to 10 draft tokens"} if s.runtime == "genai" else {})})
        return _bench(a, engine, items, modes, peers, out, md_out, reference=reference, peer_info=info,
                      reference_info=ref_info)
    finally:  # Ctrl-C included: no worker left behind
        for p in started:
            p.close()


_FLAG = {"genai": "--peer-model", "llama": "--llama-model"}


def _peer_specs(a) -> list[PeerSpec]:
    """The peer models the flags name, each checked (its folder or file, its Python's flag, greedy only); raises
    ValueError with the line to print."""
    for extra, needs, what in (("peer_python", "peer_model", "the onnxruntime-genai model folder"),
                               ("llama_python", "llama_model", "a GGUF file"),
                               ("reference_python", "reference_hf", "a Hugging Face checkpoint folder"),
                               ("reference_cache", "reference_hf", "a Hugging Face checkpoint folder")):
        if getattr(a, extra) and not getattr(a, needs):
            raise ValueError(f"--{extra.replace('_', '-')} needs --{needs.replace('_', '-')} ({what})")
    specs = []
    for rt, values, python, problem in (("genai", a.peer_model, a.peer_python, model_dir_problem),
                                        ("llama", a.llama_model, a.llama_python, gguf_file_problem)):
        try:
            got = parse_peer_models(rt, values, python or sys.executable)
        except ValueError as e:
            raise ValueError(f"{_FLAG[rt]} {e}") from None
        for s in got:
            bad = problem(s.path)
            if bad:
                raise ValueError(f"{_FLAG[rt]} {s.path}: {bad}")
        specs += got
    if specs and a.temp > 0:
        raise ValueError(f"{' and '.join(sorted({_FLAG[s.runtime] for s in specs}))} times greedy decoding only; "
                         "drop --temp")
    ref = a.reference_hf
    if ref:
        if not (Path(ref) / "config.json").is_file():
            raise ValueError(f"--reference-hf {ref}: no config.json there; pass a Hugging Face checkpoint folder of "
                             "the same model (config.json + safetensors), e.g. the GGUF de-quantized with "
                             "transformers' from_pretrained(dir, gguf_file=...).save_pretrained(DIR)")
        if a.temp > 0:
            raise ValueError("--reference-hf compares greedy answers; drop --temp")
    return specs


def _reference_fingerprint(hf_dir: str) -> list:
    """What the fp32 answers depend on besides the prompt: the checkpoint's config and weight files (name, size,
    modification time)."""
    files = sorted(f for f in Path(hf_dir).iterdir()
                   if f.is_file() and (f.name in ("config.json", "generation_config.json")
                                       or f.suffix in (".safetensors", ".bin")))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _reference_cache_path(a) -> Path:
    if a.reference_cache:
        return Path(a.reference_cache)
    import edge

    d = Path(a.reference_hf).resolve()
    return edge.home() / "reference" / f"{d.name}-{hashlib.sha256(str(d).encode()).hexdigest()[:8]}.json"


def _reference_answers(a, engine, items: list[dict]) -> tuple[dict, dict]:
    """transformers' fp32 greedy answer to each item's first turn (same ids and token budget as every runtime's),
    from the cache or computed once in a worker process (edge/tools/peer_hf.py) and cached: (id -> tokens, info)."""
    path = _reference_cache_path(a)
    try:
        cache = json.loads(path.read_text()).get("answers", {})
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError, AttributeError):
        cache = {}
    fp, end = _reference_fingerprint(a.reference_hf), sorted(_end_ids(engine))
    want = {}
    for it in items:
        ids = _first_ids(engine, it)
        if len(ids) < engine.context:  # a prompt that does not fit is skipped in every mode anyway
            n = _budget(engine, ids, a.max_tokens)
            want[it["id"]] = (hashlib.sha256(json.dumps([fp, ids, n, end]).encode()).hexdigest(), ids, n)
    todo = [(k, ids, n) for k, ids, n in want.values() if not isinstance(cache.get(k), list)]
    version = None
    if todo:
        if not a.quiet:
            print(f"edge-bench: computing {len(todo)} fp32 reference answers with transformers "
                  f"({len(want) - len(todo)} cached)", file=sys.stderr)
        ref = Peer(a.reference_python or sys.executable, a.reference_hf, a.threads, worker=HF_WORKER,
                   modes={"fp32": "greedy"})
        try:
            version = ref.version
            for k, ids, n in todo:
                cache[k] = ref.run(ids, n, "fp32", stop=end)["tokens"]
        finally:  # what was computed is kept, an interrupted run's too
            ref.close()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, json.dumps({"answers": cache}))
            except OSError as e:
                print(f"edge-bench: warning: cannot cache the fp32 answers in {path} ({e})", file=sys.stderr)
    return ({pid: cache[k] for pid, (k, _, _) in want.items()},
            {"hf_dir": str(a.reference_hf), "runtime": "transformers fp32 greedy", "version": version,
             "cache": str(path), "computed": len(todo), "cached": len(want) - len(todo)})


def _bench(a, engine, items: list[dict], modes: list[str], peers: dict | None, out: Path, md_out: Path,
           reference: dict | None = None, peer_info: list | None = None, reference_info: dict | None = None) -> int:
    """The timed rotation. `peers`: mode -> its worker; `reference`: item id -> the fp32 greedy answer to its first
    turn; `peer_info` and `reference_info` are written as they are."""
    peers = peers or {}
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

            bar = tqdm(total=total, desc="edge-bench", file=sys.stderr, disable=None)  # None: a terminal only
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
                        tested = engine.policy.token_acceptance.tested()
                        recs = (_run_peer(peers[m], engine, it, m, a, reference) if m in peers
                                else _run_one(engine, it, m, a, rep, reference))
                        for rec in recs:
                            rec["rep"] = rep
                            runs.append(rec)
                        if m not in peers and m != "none":  # what this prompt taught the drafters (plain
                            after = after or engine.drafter_state()  # decoding and the peer teach them nothing)
                        _add_learned(learned, tested, engine.policy.token_acceptance.tested())
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
    vs_peer = versus_peer(runs, modes) if peers else None
    m = engine.manifest
    sampled = engine.head_hits + engine.head_misses
    ours = [r["peak_rss_mb"] or 0 for r in runs if r["mode"] not in peers]  # the workers' peaks are theirs
    load_peaks = {x: start_peak for x in modes if x not in peers}
    names = {x: f"edgespec {m.target.precision} · {x}" for x in modes if x not in peers}
    for p in peer_info or []:
        for x in p["modes"]:
            load_peaks[x] = p["load_peak_rss_mb"]
            names[x] = f"{p['runtime']}{' ' + p['label'] if p['label'] else ''} · " + (
                "n-gram" if peer_reference(x) else "greedy")
    per_runtime = runtimes(runs, modes, load_peaks, names)
    for x, row in per_runtime.items():
        row["peak_rss_process"] = "worker" if x in peers else "bench"
    if a.rss_own_process and not (interrupted or failed):
        interrupted = _own_process_peaks(a, engine, per_runtime)
    legacy = [p for p in peer_info or [] if p["name"] == "genai"]  # one unlabeled onnxruntime-genai folder
    doc = {"summary": summary, "modes": modes, "reps": a.reps, "max_tokens": a.max_tokens,
           "model": m.name, "precision": m.target.precision, "threads": a.threads,
           "prompt_format": "raw" if completes_raw(engine) else "chat",
           "peak_rss_mb": round(max([start_peak, peak_rss_mb()] + ours), 1), "context": engine.context,
           "wall_s": round(time.time() - t0, 1),
           "min_call": engine.target.min_call, "cold": a.cold, "interrupted": interrupted, "failed": failed,
           "skipped": skipped,
           "runs_done": done, "runs_planned": total,
           "sampling": None if a.temp == 0 else {
               "temperature": a.temp, "top_p": a.top_p, "top_k": a.top_k, "seed": a.seed,
               # rows whose p the on-graph head gave (kernels/postprocess.py); the rest came from the logits
               "rows_from_head": round(engine.head_hits / sampled, 4) if sampled else None},
           "peer": {k: legacy[0][k] for k in ("runtime", "version", "model", "ngram")} if legacy else None,
           "peers": peer_info or [], "reference": reference_info, "runtimes": per_runtime,
           "versus_peer": vs_peer,
           "token_acceptance": {x: {"lifetime": round(h / n, 4), "n": int(n)} for x, (h, n) in
                                sorted(learned.items())},
           "per_prompt": per_prompt(runs, uncompared), "runs": runs}
    md = markdown(summary, modes, vs_peer) + "\n\n" + runtimes_markdown(per_runtime, engine.context)
    shared = [x for x, row in per_runtime.items() if row["peak_rss_process"] == "bench"]
    if shared:
        md += ("\n\nPeak RSS of " + ", ".join(shared) + ": this bench process, which ran every edgespec mode (and "
               "any drafter session); --rss-own-process measures each mode in a process of its own.")
    if completes_raw(engine):
        md += "\n\nPrompts completed as raw text (the model has no chat template), BOS as its tokenizer adds it."
    if reference_info:
        md += (f"\n\nFidelity: each mode's first answers against {reference_info['runtime']} on "
               f"{reference_info['hf_dir']}, on the same token ids.")
    if a.temp > 0:
        md += f"\n\nSampled at temperature {a.temp}, top-p {a.top_p}, top-k {a.top_k or 'off'}, seed {a.seed} + repeat."
    if interrupted or failed:
        why = "Interrupted" if interrupted else f"Stopped by an error ({failed})"
        md += f"\n\n{why}: {done} of {total} runs (prompt × mode × repeat) finished; the table shows those."
    if skipped:
        md += ("\n\nSkipped (a turn does not fit the context, in every mode): "
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
    print(json.dumps({"summary": summary, "versus_peer": vs_peer, "runtimes": per_runtime,
                      "peak_rss_mb": doc["peak_rss_mb"]}, indent=1))
    print(md)
    return 130 if interrupted else 1 if failed else 0


def _own_process_peaks(a, engine, per_runtime: dict) -> bool:
    """--rss-own-process: each edgespec mode's peak RSS from a replay of the same prompts in a fresh process
    (`edge.tools.memprobe.replay`); a replay that fails or is interrupted leaves that mode's bench-process peak.
    True if Ctrl-C stopped the replays."""
    from .memprobe import in_fresh_process

    for x, row in per_runtime.items():
        if row["peak_rss_process"] != "bench":
            continue
        if not a.quiet:
            print(f"edge-bench: peak RSS of {x} in a process of its own ...", file=sys.stderr)
        args = dict(model_dir=str(engine.model_dir), prompts=str(a.prompts), context=engine.context, reps=a.reps,
                    max_tokens=a.max_tokens, drafter=x, threads=a.threads, limit=a.limit,
                    categories=a.categories, draft_len=a.draft_len)
        try:
            peak = round(float(in_fresh_process(args, timeout=3600)["peak_rss_mb"]), 1)
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError, LookupError, TypeError) as e:
            print(f"edge-bench: peak RSS of {x} in its own process not measured: "
                  f"{(str(e).splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            print("edge-bench: interrupted; the remaining modes keep this process's peak", file=sys.stderr)
            return True
        row["peak_rss_mb"], row["peak_rss_process"] = peak, "own"
    return False


def _outputs(path: str) -> tuple[Path, Path]:
    """The JSON file and the markdown table beside it, never the same file (`--out r.md` writes r.json and r.md)."""
    out = Path(path)
    if out.suffix == ".md":
        out = out.with_suffix(".json")
    return out, out.with_suffix(".md")


if __name__ == "__main__":
    sys.exit(main())
