"""edge-profile: measure this host for the memory planner and write the calibration JSON it loads.

Steps (--steps, default all):
  latency     one-call milliseconds vs rows S for the target at each of --latency-contexts cached tokens, and for
              each drafter graph at the first of them (median of --latency-reps)
  acceptance  per-depth acceptance of each drafter on the prompt file, drafting fixed chains of --accept-k tokens
              so every depth is tried (model-free drafters that fill trees on this export are left to priors)
  speed       tokens/s vs K (vs tree nodes where the export verifies trees exactly) and the planner's own choice,
              loaded through the calibration just written; interleaved per prompt, medians over --reps
  memory      peak RSS vs context, plain and speculative: one fresh process per point (edge.tools.memprobe; its own
              peak RSS, so points are isolated) beside the footprint model's prediction for the same run; plus
              the planner's K and the longest K at --specmemo-context (extra memory of managed vs unmanaged)
  chat        (only when named) a --chat-turns edge-chat session, prompts piped in with /stats json after each, under
              a budget just above the speculative lower bound at the context the chat reaches, then once under a
              budget below plain decoding's bound (which must be refused with a clear error)

Writes OUT/calibration.json (sections memory, latency, acceptance: what `edge-chat --calibration` and the planner
read; `--install` also puts it where edge.load finds it by itself; a run of some --steps keeps the other sections
of an earlier calibration.json in OUT measured on the same export), OUT/profile.json (every measurement) and PNG
plots. Asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .bench import add_workload_args, read_workload
from .memprobe import in_fresh_process
from ..args import add_version, int_at_least, non_negative_int, plain_warnings, positive_float, positive_int
from ..drafters import DRAFTER_KINDS
from ..engine import MAX_DRAFT_LEN
from ..measure import call_latency
from ..runner import MAX_CALL

STEPS = ("latency", "acceptance", "speed", "memory")
EXTRA_STEPS = ("chat",)  # only when asked: a budgeted edge-chat session (see budget_chat)
ENGINE_CONTEXT = 4096  # KV slots of the engine that measures latency and acceptance; longer prompts are skipped
med = statistics.median


def _int_list(minimum: int, maximum: int | None = None):
    """argparse type: comma-separated whole numbers, each >= minimum (and <= maximum), at least one."""
    one = int_at_least(minimum, maximum)

    def parse(text: str) -> list[int]:
        vals = [one(x) for x in text.split(",") if x.strip()]
        if not vals:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers")
        return vals
    return parse


def _drafter_list(text: str) -> list[str]:
    """argparse type: comma-separated drafter names the engine knows (not "auto": a sweep names what it runs)."""
    known = list(DRAFTER_KINDS)
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in vals if x not in known]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated drafters among {', '.join(known)}")
    return vals


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edge-profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--out", default="bench-out/edge-profile", help="output directory (default bench-out/edge-profile)")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help=f"comma-separated subset of {','.join(STEPS)} (default all four), plus {','.join(EXTRA_STEPS)}: "
                         "a budgeted edge-chat session, only when named")
    ap.add_argument("--sizes", type=_int_list(1, MAX_CALL), default="1,2,3,4,6,8,12,16,24,32,48,65",
                    help=f"rows per call for the latency curve, each 1-{MAX_CALL} "
                         "(default 1,2,3,4,6,8,12,16,24,32,48,65)")
    ap.add_argument("--latency-contexts", "--latency-context", type=_int_list(1), default="256,1024,2048",
                    help="cached tokens before the latency calls: the target's curve is measured at each (the planner "
                         "interpolates between them and extends past the last), the drafters' at the first "
                         "(default 256,1024,2048)")
    ap.add_argument("--latency-reps", type=positive_int, default=7,
                    help="calls per width of the latency curve; the median is kept (default 7)")
    ap.add_argument("--prompts-per-category", type=non_negative_int, default=1,
                    help="prompts taken from each category (0 = all; default 1)")
    ap.add_argument("--max-prompt-tokens", type=positive_int, default=768,
                    help="skip prompts longer than this (default 768: keeps the run short)")
    ap.add_argument("--accept-k", type=int_at_least(1, MAX_DRAFT_LEN), default=16,
                    help=f"chain length drafted while measuring acceptance, 1-{MAX_DRAFT_LEN} (default 16)")
    ap.add_argument("--accept-k-model", type=int_at_least(1, MAX_DRAFT_LEN), default=4,
                    help="the same for a model drafter, whose every draft token costs a drafter call (default 4)")
    ap.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens per answer (acceptance and speed; default 64)")
    ap.add_argument("--sweep-ks", type=_int_list(1, MAX_DRAFT_LEN), default="1,2,4,8,16,64",
                    help=f"draft lengths / tree node budgets swept, each 1-{MAX_DRAFT_LEN} (default 1,2,4,8,16,64)")
    ap.add_argument("--sweep-drafters", type=_drafter_list, default="recycling,hybrid,lookup",
                    help="drafters swept (comma-separated; default recycling,hybrid,lookup)")
    ap.add_argument("--sweep-prompts", type=positive_int, default=2,
                    help="prompts in the speed sweep, one per category (default 2)")
    ap.add_argument("--reps", type=positive_int, default=2, help="repeats of the speed sweep (default 2)")
    ap.add_argument("--budget-mb", type=positive_float,
                    help="budget for the planner's choice (default: the host profile's)")
    ap.add_argument("--contexts", type=_int_list(1), default="256,1024,4096", help="contexts of the memory sweep (default 256,1024,4096)")
    ap.add_argument("--mem-ks", type=_int_list(0, MAX_DRAFT_LEN), default="0,16",
                    help=f"draft lengths of the memory sweep, each 0-{MAX_DRAFT_LEN} "
                         "(0 = plain decoding; default 0,16)")
    ap.add_argument("--mem-drafter", choices=[d for d in DRAFTER_KINDS if d != "none"],
                    default="lookup", help="drafter of the memory sweep's speculative runs (default lookup)")
    ap.add_argument("--specmemo-context", type=non_negative_int, default=1024,
                    help="context of the managed (planner's K) vs unmanaged (longest K) memory pair; 0 = skip (default 1024)")
    ap.add_argument("--chat-turns", type=positive_int, default=20, help="turns of the chat step (default 20)")
    ap.add_argument("--chat-context", type=positive_int, default=4096, help="edge-chat --context of the chat step (default 4096)")
    ap.add_argument("--chat-max-tokens", type=positive_int, default=128,
                    help="new tokens per answer in the chat step (default 128)")
    ap.add_argument("--chat-budget-mb", type=positive_float,
                    help="budget of the chat step (default: 0.1 MB above the speculative lower bound at the largest "
                         "context the chat reaches, from a first unconstrained pass)")
    ap.add_argument("--install", action="store_true",
                    help="also copy calibration.json to $EDGESPEC_HOME/calibration/<model dir name>.json, which "
                         "edge.load / edge-chat / edge-serve use when no --calibration is given and the planner runs "
                         "on the host profile (--budget-mb without --device, or --device host)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    add_version(ap)
    return ap


# ---------------------------------------------------------------------------------------------- prompts
def load_prompts(path: str, per_category: int) -> list[dict]:
    """Items of a JSONL prompt file, `per_category` from each category (0 = all), in file order."""
    items, seen = [], {}
    for it in read_workload(path):
        c = it.get("category", "?")
        if not per_category or seen.get(c, 0) < per_category:
            seen[c] = seen.get(c, 0) + 1
            items.append(it)
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def round_robin(items: list[dict]) -> list[dict]:
    """Items reordered one category at a time (the first of each category, then the second, ...)."""
    by: dict[str, list] = {}
    for it in items:
        by.setdefault(it.get("category", "?"), []).append(it)
    out, i = [], 0
    while len(out) < len(items):
        out += [v[i] for v in by.values() if i < len(v)]
        i += 1
    return out


class _Progress:
    def __init__(self, total: int, quiet: bool):
        self.bar = None
        if not quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="edge-profile", file=sys.stderr, unit="run", disable=None)  # a terminal

    def step(self, what: str, n: int = 1):
        if self.bar:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(n)

    def close(self):
        if self.bar:
            self.bar.close()


# ---------------------------------------------------------------------------------------------- latency
def sizes_at(sizes: list[int], context: int, slots: int) -> list[int]:
    """The call widths of `sizes` that fit beside `context` cached tokens in `slots` KV positions."""
    return [s for s in sizes if s + context <= slots]


def measure_latency(engine, sizes, contexts: list[int], reps, prog) -> dict:
    """The calibration's latency section: the target's curve at each of `contexts` (the first: "target" and
    "context"; the rest: "target_at"), each drafter graph's at the first."""
    from ..runner import GraphSession

    m = engine.manifest
    context = contexts[0]
    lat = {"target": call_latency(engine.target, sizes_at(sizes, context, engine.context), context, reps, prog),
           "context": context, "drafters": {}}
    at = [[c, call_latency(engine.target, sizes_at(sizes, c, engine.context), c, reps, prog)] for c in contexts[1:]]
    if at:
        lat["target_at"] = at
    for g in m.drafters:
        sess = GraphSession(str(engine.model_dir / g.file), m, g, engine.context, engine.threads, engine.providers)
        lat["drafters"][g.name] = call_latency(sess, sizes_at(sizes, context, engine.context), context, reps, prog)
        del sess
    return lat


# ---------------------------------------------------------------------------------------------- acceptance
def chain_kinds(engine) -> list[str]:
    """Drafters that verify chains on this export (so the engine records their per-depth acceptance)."""
    kinds = ["lookup"] + (["model"] if engine.manifest.drafters else [])
    if engine.target.topk and not engine.target.tree_exact:
        kinds += ["recycling", "hybrid"]
    return kinds


def measure_acceptance(engine, items, k: int, k_model: int, max_tokens: int, prog) -> tuple[dict, dict]:
    """{drafter key: AcceptanceStats dict} from fixed-K chains over the prompts' turns, and per-kind counters.
    The moving average is made a running mean here (beta 1e-3) and handed to the planner with beta 0.1 again.
    draft_rate (steps with a draft at all) is not in the engine's statistics: it is estimated from
    accepted/steps = draft_rate · E[accepted | a draft of K]."""
    from memory.acceptance import AcceptanceStats
    from memory.planner import DEFAULT_PRIORS

    from ..engine import ContextFull

    out, counters = {}, {}
    kinds = chain_kinds(engine)
    acc = {kind: {"steps": 0, "accepted": 0, "drafted": 0, "overhead": []} for kind in kinds}
    for kind in kinds:
        engine.policy.acceptance[kind] = AcceptanceStats(DEFAULT_PRIORS.get(kind, (0.3, 1.0))[0], beta=1e-3,
                                                  prior_weight=1.0)
    for it in items:
        # every drafter starts this prompt from what the earlier prompts taught, never from another drafter's run
        # of this very prompt (Token Recycling would recall its answer: measured ~50x too high)
        before, after = engine.drafter_state(), None
        for kind in kinds:  # the same prompt for every drafter: prefilled once, then re-used from the KV cache
            _restore_drafting(engine, before)
            chat, c = engine.chat(), acc[kind]
            for turn in it["turns"]:
                try:
                    r = chat.ask(turn, max_tokens=max_tokens, drafter=kind,
                                 draft_len=k_model if kind == "model" else k)
                except ContextFull:  # a prompt longer than the context: skipped
                    break
                c["steps"] += r.stats.steps
                c["accepted"] += r.stats.accepted
                c["drafted"] += r.stats.drafted
                c["overhead"].append(r.stats.overhead_ms_per_step)
            after = after or engine.drafter_state()
            if prog:
                prog.step(f"acceptance {kind}")
        _restore_drafting(engine, after or before)
    for kind in kinds:
        st, c = engine.policy.acceptance[kind], acc[kind]
        given = st.expected_accepted(k_model if kind == "model" else k)  # draft_rate is 1 in the engine's stats
        st.draft_rate = min(1.0, c["accepted"] / c["steps"] / given) if c["steps"] and given > 0 else 0.0
        st.beta = 0.1
        out[kind] = st.to_dict()
        counters[kind] = {"steps": c["steps"], "drafted": c["drafted"], "accepted": c["accepted"],
                          "accepted_per_step": round(c["accepted"] / max(c["steps"], 1), 3),
                          "a_depth_1_4": [round(st.accept_prob(d), 3) for d in range(1, 5)],
                          "draft_rate": round(st.draft_rate, 3),
                          "overhead_ms_per_step": round(med(c["overhead"]), 3) if c["overhead"] else None}
    return out, counters


def _restore_drafting(engine, state) -> None:
    """Put back what drafting had learned (`Engine.drafter_state`) but keep the acceptance statistics being
    measured."""
    measured = engine.policy.acceptance
    engine.set_drafter_state(state)
    engine.policy.acceptance = measured


# ---------------------------------------------------------------------------------------------- speed
def speed_sweep(engine, items, configs: list[tuple[str, str | None, int | None]], reps: int, max_tokens: int,
                plan0, prog) -> dict:
    """Decode tokens/s of each (label, drafter, draft_len) config, interleaved: every prompt runs every config in
    a rotated order, `reps` times. Label "plan" runs the engine's planned drafter with adaptive K (re-planned from
    `plan0` each time, so runs are alike); "unmanaged" the given drafter with adaptive K and no plan (no cap). → {label: {"tok_s": median, "runs": [...]}}"""
    runs: dict[str, list[float]] = {c[0]: [] for c in configs}
    fresh = engine.drafter_state()
    engine.generate(items[0]["turns"][0], max_tokens=8, drafter="none")  # warm-up
    engine.set_drafter_state(fresh)
    # every run of a prompt drafts from what the earlier prompts taught, never from this prompt's own earlier runs
    # (Token Recycling would recall them: a config's second repeat ran ~3x its first)
    before: list = []
    for rep in range(reps):
        for i, it in enumerate(items):
            if rep == 0:
                before.append(engine.drafter_state())
            after = None
            j = (i + rep) % len(configs)
            for label, drafter, k in configs[j:] + configs[:j]:  # the prompt is prefilled once, then re-used
                engine.set_drafter_state(before[i])
                # only "plan" runs under the memory plan; every other config (an explicit drafter and length, or
                # "unmanaged": the engine's default) runs without one, so nothing caps what it measures
                engine.plan = plan0 if label == "plan" else None
                r = engine.generate(it["turns"][0], max_tokens=max_tokens, drafter=drafter, draft_len=k)
                # a one-token answer has no decode speed (the engine says 0.0): None, left out as edge-bench does
                runs[label].append(r.stats.decode_tok_s if r.stats.generated > 1 else None)
                if label != "none":
                    after = after or engine.drafter_state()
                if prog:
                    prog.step(f"speed {label}")
            if rep == 0:
                engine.set_drafter_state(after or before[i])
    return summarize_speed(runs)


def summarize_speed(runs: dict[str, list[float | None]]) -> dict:
    """Per config: median tokens/s, and the median over (prompt, repeat) blocks of its ratio to plain decoding in
    the same block — the machine's drift between blocks cancels in the ratio. A run without a speed (None: a
    one-token answer) counts in neither."""
    base = runs["none"]
    out = {}
    for label, v in runs.items():
        ratios = [x / b for x, b in zip(v, base) if x is not None and b]
        speeds = [x for x in v if x is not None]
        out[label] = {"tok_s": round(med(speeds), 2) if speeds else None,
                      "ratio_vs_none": round(med(ratios), 3) if ratios else None,
                      "runs": [None if x is None else round(x, 2) for x in v]}
    return out


# ---------------------------------------------------------------------------------------------- memory
def memory_point(model_dir, context: int, k: int, drafter: str, threads: int, text: str,
                 calibration: dict | None = None, timeout: float = 600) -> dict:
    """One `edge.tools.memprobe` run in a fresh process → its JSON (measured peak RSS and the model's prediction)."""
    args = dict(model_dir=str(model_dir), context=context, k=k, drafter=drafter, threads=threads, text=text,
                calibration=calibration)
    try:
        return in_fresh_process(args, timeout)
    except RuntimeError as e:
        raise RuntimeError(f"memory probe at context {context}, K={k} failed: {e}") from None


def fit_baseline(points: list[dict], base_mb: float) -> float:
    """The baseline (MB) that makes the footprint model an upper bound of every measured point: a budget is a
    ceiling, so the model may overshoot a little but should not undershoot."""
    return round(base_mb + max(p["peak_rss_mb"] - p["predicted_mb"] for p in points), 1)


def validation_table(points: list[dict]) -> str:
    lines = ["| context | K (widest call) | drafter | measured peak MB | predicted MB | error |", "|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (p["context"], p["k"])):
        err = 100 * (p["predicted_mb"] / p["peak_rss_mb"] - 1)
        lines.append(f"| {p['context']} | {p['k']} ({p['widest_call']}) | {p['drafter']} | {p['peak_rss_mb']:.1f} | "
                     f"{p['predicted_mb']:.1f} | {err:+.1f}% |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- plots
def write_plots(out: Path, doc: dict) -> list[str]:
    from .pngplot import plot_png

    made = []
    mem = doc.get("memory", {}).get("points", [])
    if mem:
        series: dict[str, list] = {}
        for p in mem:
            tag = "plain" if p["k"] == 0 else f"K={p['k']}"
            series.setdefault(f"{tag} measured", []).append((p["context"], p["peak_rss_mb"]))
            series.setdefault(f"{tag} predicted", []).append((p["context"], p["predicted_mb"]))
        series = {k: v for k, v in series.items() if len({x for x, _ in v}) > 1}
        if series:
            made.append(plot_png(out / "memory_vs_context.png", series, title="PEAK RSS VS CONTEXT",
                                 xlabel="CONTEXT TOKENS", ylabel="MB", logx=True).name)
        made.append(plot_png(out / "predicted_vs_measured.png",
                             {"~points": [(p["peak_rss_mb"], p["predicted_mb"]) for p in mem]},
                             title="FOOTPRINT MODEL: PREDICTED VS MEASURED PEAK RSS", xlabel="MEASURED MB",
                             ylabel="PREDICTED MB", diagonal=True).name)
    sp = doc.get("speed")
    if sp:
        for kind, fname, xl in (("chain", "tokens_per_s_vs_k.png", "DRAFT LENGTH K"),
                                ("tree", "tokens_per_s_vs_tree_nodes.png", "TREE NODES N")):
            # the ratio to plain decoding in the same (prompt, repeat) block: robust to the machine's drift
            series = {}
            for label, v in sp["results"].items():
                if label.startswith(f"{kind}:") and v["ratio_vs_none"] is not None:  # None: no block had both speeds
                    d, k = label.split(":")[1:]
                    series.setdefault(d, []).append((int(k), v["ratio_vs_none"]))
            if not series:
                continue
            xs = sorted({x for s in series.values() for x, _ in s})
            series["plain"] = [(xs[0], 1.0), (xs[-1], 1.0)]
            pl, res = sp["plan"], sp["results"]
            if res["plan"]["ratio_vs_none"] is not None:
                series[f"~planner {pl['drafter']} K<={pl['nodes']}"] = [(max(pl["nodes"], 1),
                                                                          res["plan"]["ratio_vs_none"])]
            made.append(plot_png(out / fname, series, title=f"DECODE SPEED VS {xl} (X PLAIN, BLOCK MEDIANS)",
                                 xlabel=xl, ylabel="X PLAIN DECODING", logx=True).name)
    return made


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    plain_warnings("edge-profile")
    steps = [s.strip() for s in a.steps.split(",") if s.strip()]
    bad = sorted(set(steps) - set(STEPS) - set(EXTRA_STEPS))
    if bad or not steps:
        what = f"unknown step(s) {bad}" if bad else f"--steps {a.steps!r} names no step"
        print(f"edge-profile: error: {what}; choose among {', '.join(STEPS + EXTRA_STEPS)}", file=sys.stderr)
        return 2
    try:
        items = load_prompts(a.prompts, a.prompts_per_category)
    except (OSError, ValueError) as e:
        print(f"edge-profile: error: {e}", file=sys.stderr)
        return 2
    import edge
    from edge import EngineError

    from memory.footprint import Calibration

    from ..files import unwritable_dir
    from ..manifest import load_manifest
    from ..planning import default_calibration_path, model_identity, profile_for

    t_start = time.time()
    out = Path(a.out)
    problem = unwritable_dir(out)  # found now, not after the profile (or the first-run export)
    if problem:
        print(f"edge-profile: error: --out {out}: {problem}", file=sys.stderr)
        return 2
    try:
        model_dir = edge.resolve_model(a.model)
        want = max(max(a.latency_contexts) + max(a.sizes) + 8, ENGINE_CONTEXT)
        cap = load_manifest(model_dir, verify="none").target.max_len  # a smaller export: as much as it holds
        engine = edge.Engine(model_dir, drafter="none", threads=a.threads, context=min(want, cap))
    except (EngineError, ValueError) as e:  # ModelDirError is an EngineError
        print(f"edge-profile: error: {e}", file=sys.stderr)
        return 2
    m = engine.manifest
    n_all = len(items)
    items = [it for it in items if len(engine.encode(it["turns"][0])) <= a.max_prompt_tokens]
    if not items:
        print(f"edge-profile: error: no prompt in {a.prompts} fits --max-prompt-tokens {a.max_prompt_tokens}",
              file=sys.stderr)
        return 2
    sizes, sweep_ks, contexts, mem_ks = a.sizes, a.sweep_ks, a.contexts, a.mem_ks
    lat_contexts = [c for c in dict.fromkeys(a.latency_contexts) if c + min(sizes) <= engine.context]
    if "latency" in steps and len(lat_contexts) < len(set(a.latency_contexts)):
        skip = sorted(set(a.latency_contexts) - set(lat_contexts))
        if not lat_contexts:
            print(f"edge-profile: error: no --latency-contexts value leaves room for a {min(sizes)}-row call in "
                  f"{model_dir}'s {engine.context} tokens", file=sys.stderr)
            return 2
        print(f"edge-profile: note: skipping --latency-contexts {skip}: no room for a {min(sizes)}-row call in "
              f"{model_dir}'s {engine.context} tokens", file=sys.stderr)
    if "memory" in steps:  # each memory run needs room for its drafts beside the context
        room = m.target.max_len - max(mem_ks) * 2 - 40
        if not [c for c in contexts if c <= room]:
            print(f"edge-profile: error: no --contexts value fits {model_dir}'s {m.target.max_len} tokens with "
                  f"--mem-ks {max(mem_ks)} drafts (at most {max(room, 0)} here)", file=sys.stderr)
            return 2
        if [c for c in contexts if c > room]:
            print(f"edge-profile: note: skipping --contexts {[c for c in contexts if c > room]}: more than the "
                  f"{room} tokens this export holds beside --mem-ks {max(mem_ks)} drafts", file=sys.stderr)
        contexts = [c for c in contexts if c <= room]
    sweep_items = round_robin(items)[: a.sweep_prompts]
    sweep_drafters = a.sweep_drafters
    n_configs = 3 + len(sweep_drafters) * len(sweep_ks)
    total = (("chat" in steps)
             + ("latency" in steps) * sum(len(sizes_at(sizes, c, engine.context))
                                          for c in lat_contexts + lat_contexts[:1] * len(m.drafters))
             + ("acceptance" in steps) * len(items) * len(chain_kinds(engine))
             + ("speed" in steps) * a.reps * len(sweep_items) * n_configs
             + ("memory" in steps) * (len(contexts) * len(mem_ks) + (2 if a.specmemo_context else 0)))
    prog = _Progress(total, a.quiet)
    import onnxruntime as ort

    host = {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "onnxruntime": ort.__version__, "threads": a.threads,
            "load_average_start": [round(x, 2) for x in os.getloadavg()]}
    cal: dict = {"device_class": "cpu", "host": host, "model": model_identity(m),
                 "source": f"edge-profile on {platform.node()} ({host['processor']}, {host['cores']} cores, "
                           f"onnxruntime {ort.__version__}, {a.threads} threads), model {m.name}, "
                           f"{time.strftime('%Y-%m-%d %H:%M')}"}
    doc: dict = {"model": m.name, "model_dir": str(model_dir), "host": host, "settings": vars(a),
                 "prompts": {"file": a.prompts, "used": [it.get("id") for it in items],
                             "skipped_too_long": n_all - len(items)}}
    cal_path = out / "calibration.json"
    kept = _earlier_sections(cal_path, cal["model"], measuring=set(steps))  # a run of some steps updates only theirs
    if kept:
        cal.update(kept)
        cal["source"] += f"; {', '.join(kept)} from an earlier run in {out}"
    # the memory runs' prompt text: every prompt of the file, so the vocabulary grows with the context as in real
    # use (the embedding's resident part depends on how many distinct tokens were looked up)
    text = " ".join(t for it in load_prompts(a.prompts, 0) for t in it["turns"])
    timer = doc["step_s"] = {}
    t, stopped, failed = time.time(), None, None  # stopped: the step an interrupt or an error ended the run in
    try:
        if "latency" in steps:
            doc["latency"] = cal["latency"] = measure_latency(engine, sizes, lat_contexts, a.latency_reps, prog)
        timer["latency"], t = round(time.time() - t, 1), time.time()
        if "acceptance" in steps:
            acc, counters = measure_acceptance(engine, items, a.accept_k, a.accept_k_model, a.max_tokens, prog)
            cal["acceptance"] = acc
            doc["acceptance"] = counters
            if "latency" in cal:
                oh = [c["overhead_ms_per_step"] for k, c in counters.items() if k != "model" and c["overhead_ms_per_step"]]
                cal["latency"]["overhead_ms"] = round(med(oh), 3) if oh else 0.0
        timer["acceptance"], t = round(time.time() - t, 1), time.time()
        del engine
        cal_path.write_text(json.dumps(cal, indent=1))
        plan0 = None
        if "speed" in steps or ("memory" in steps and a.specmemo_context):
            # the planner's choice exactly as edge-chat --calibration makes it
            budget = a.budget_mb or profile_for(None).budget_mb
            eng = edge.load(model_dir, threads=a.threads, budget_mb=budget, calibration=cal_path, progress=False)
            plan0 = eng.plan
            doc["plan"] = plan0.to_dict()
            if "speed" in steps:
                chains = not eng.target.tree_exact
                configs = [("none", "none", None), ("plan", None, None), ("unmanaged", "hybrid", None)]
                for d in sweep_drafters:
                    kind = "chain" if chains or d in ("lookup", "model") else "tree"
                    configs += [(f"{kind}:{d}:{k}", d, k) for k in sweep_ks]
                res = speed_sweep(eng, sweep_items, configs, a.reps, a.max_tokens, plan0, prog)
                doc["speed"] = {"results": res, "plan": {"drafter": plan0.drafter, "nodes": plan0.nodes},
                                "trees_verified": not chains, **planner_vs_sweep(res)}
            del eng
        timer["speed"], t = round(time.time() - t, 1), time.time()
        if "memory" in steps:
            mcal = {"memory": cal["memory"]} if "memory" in cal else None  # what edge.tools.memprobe predicts with
            pts = []
            for c in contexts:
                for k in mem_ks:
                    pts.append(memory_point(model_dir, c, k, a.mem_drafter, a.threads, text, mcal))
                    prog.step(f"memory ctx={c} K={k}")
            doc["memory"] = {"points": pts, "table": validation_table(pts)}
            top = max(sweep_ks + mem_ks)
            c = min(a.specmemo_context, m.target.max_len - 2 * top - 40)  # room for the drafts, as `contexts`
            if a.specmemo_context and plan0 is not None and c > 0:
                d = plan0.drafter if plan0.drafter not in ("none", "model") else a.mem_drafter
                pair = {str(k): memory_point(model_dir, c, k, d, a.threads, text, mcal)
                        for k in (0, max(plan0.nodes, 1), top)}
                prog.step("memory specmemo", 2)
                doc["memory"]["specmemo_points"] = pair
                doc["specmemo"] = specmemo_pair(pair, max(plan0.nodes, 1), top, doc.get("speed"))
            base = Calibration.from_dict(cal.get("memory"), "cpu").baseline_mb  # the baseline the probes predicted with
            cal["memory"] = {**cal.get("memory", {}), "baseline_mb": fit_baseline(pts, base)}
            doc["memory"]["fitted_baseline_mb"] = cal["memory"]["baseline_mb"]
            cal_path.write_text(json.dumps(cal, indent=1))
        timer["memory"], t = round(time.time() - t, 1), time.time()
        if "chat" in steps:
            chat_items = [it for it in round_robin(items) if len(it["turns"][0]) < 400]  # short chat turns
            doc["chat"] = budget_chat(model_dir, chat_items, a.chat_turns, a.chat_context, a.chat_max_tokens,
                                      a.chat_budget_mb, cal_path if cal_path.is_file() else None, a.threads, prog)
            timer["chat"] = round(time.time() - t, 1)
    except KeyboardInterrupt:
        stopped = _running_step(steps, timer)
        print(f"edge-profile: interrupted during the {stopped} step; writing what was measured", file=sys.stderr)
    except (EngineError, ValueError, RuntimeError, OSError, subprocess.SubprocessError) as e:
        stopped, failed = _running_step(steps, timer), str(e) or type(e).__name__
        print(f"edge-profile: error: {failed.splitlines()[0]} (in the {stopped} step); writing what was measured",
              file=sys.stderr)
        if not isinstance(e, EngineError):  # perhaps a bug: keep where it came from
            import traceback

            doc["traceback"] = traceback.format_exc()
    finally:
        prog.close()
    if stopped:
        what = f"failed in the {stopped} step" if failed else f"was interrupted during the {stopped} step"
        doc["stopped"] = {"step": stopped, "error": failed} if failed else {"step": stopped, "interrupted": True}
        base = cal.get("source", "edge-profile").split("; this run ")[0]  # an earlier cut-short run's note goes
        cal["source"] = f"{base}; this run {what}: only the sections of the steps before it are this run's"
    # always this run's calibration: an interrupt must not leave (or install) the previous run's as if just measured
    cal_path.write_text(json.dumps(cal, indent=1))
    host["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["wall_s"] = round(time.time() - t_start, 1)
    doc["plots"] = write_plots(out, doc)
    (out / "profile.json").write_text(json.dumps(doc, indent=1))
    if a.install and stopped:
        print(f"edge-profile: not installed: this run {what}; re-run it to the end to install", file=sys.stderr)
    elif a.install:
        dest = default_calibration_path(model_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "calibration.json", dest)
        doc["installed"] = str(dest)
    summary = {k: doc[k] for k in ("plan", "specmemo", "wall_s", "step_s", "plots", "installed") if k in doc}
    if "speed" in doc:
        summary["speed"] = {k: v for k, v in doc["speed"].items() if k != "results"}
    if "acceptance" in doc:
        summary["acceptance"] = doc["acceptance"]
    print(json.dumps(summary, indent=1))
    if "memory" in doc:
        print(doc["memory"]["table"])
    print(f"wrote {out / 'calibration.json'} and {out / 'profile.json'}", file=sys.stderr)
    return 0 if not stopped else 1 if failed else 130  # 130: the shell's code for a run ended by Ctrl-C


def _earlier_sections(path: Path, model: dict, measuring: set[str]) -> dict:
    """The calibration sections (latency, acceptance, memory) an earlier run in this --out directory measured for
    the same export and this run does not re-measure."""
    from ..planning import CalibrationError, load_calibration

    if not path.is_file():
        return {}
    try:
        old = load_calibration(path)
    except CalibrationError as e:
        print(f"edge-profile: note: not re-using {path}: {e}", file=sys.stderr)
        return {}
    if old.get("model") != model:
        return {}
    return {k: old[k] for k in ("latency", "acceptance", "memory") if k in old and k not in measuring}


def _running_step(steps: list[str], timer: dict) -> str:
    """The step main() was in: the first one asked for that has no time recorded yet ("last" once every step
    asked for has one: the results were being written)."""
    return next((s for s in STEPS + EXTRA_STEPS if s in steps and s not in timer), "last")


def _chat_cli(model_dir, budget: float, context: int, calibration, threads: int, stdin: str,
              max_tokens: int) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "edge.chat", "--model", str(model_dir), "--budget-mb", f"{budget:.1f}",
            "--context", str(context), "--max-tokens", str(max_tokens), "--threads", str(threads)]
    if calibration is not None:
        args += ["--calibration", str(calibration)]
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})


def _json_objects(text: str) -> list[dict]:
    """The JSON objects printed one after another in a stream of other lines (/stats json output)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while (i := text.find("{\n", i)) >= 0:
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        out.append(obj)
        i = end
    return out


def _chat_rows(stderr: str) -> list[dict]:
    rows = []
    for i, s in enumerate(_json_objects(stderr), 1):
        p, mem = s.get("plan") or {}, s["memory_mb"]
        rows.append({"turn": i, "context_tokens": s["context_tokens"], "drafter": p.get("drafter"),
                     "nodes": p.get("nodes"), "planned_for_context": p.get("context"),
                     "predicted_peak_mb": mem.get("predicted_peak"), "measured_peak_rss_mb": mem["measured_peak_rss"],
                     "decode_tok_s": s["last_answer"].get("decode_tok_s")})
    return rows


def budget_chat(model_dir, items, turns: int, context: int, max_tokens: int, budget: float | None, calibration,
                threads: int, prog=None) -> dict:
    """A `turns`-turn edge-chat session (one line per prompt, /stats json after each) under `budget`, then a chat start
    under a budget 10 MB below plain decoding's bound where the engine first plans (refused with a clear error).

    Default budget: just above (+0.1 MB) the speculative lower bound at the largest context the chat plans for,
    learnt from a first, unconstrained pass (greedy decoding is lossless, so both passes say the same)."""
    from memory.planner import min_budget_speculative

    from ..manifest import load_manifest
    from ..planning import capabilities, expected_min_call, plan_report, profile_for

    m = load_manifest(model_dir, verify="none")
    context = min(context, m.target.max_len)  # a smaller export: as much as it holds (edge-chat refuses more)
    profile = profile_for(None, calibration=calibration, model_dir=model_dir)
    prompts = [" ".join(items[i % len(items)]["turns"][0].split()) for i in range(turns)]
    stdin = "".join(f"{p}\n/stats json\n" for p in prompts) + "/quit\n"
    free = None
    if budget is None:
        r0 = _chat_cli(model_dir, profile.budget_mb, context, calibration, threads, stdin, max_tokens)
        free = _chat_rows(r0.stderr)
        if not free:
            raise ValueError(f"the unconstrained edge-chat pass answered no turn (exit {r0.returncode}): "
                             + " / ".join(r0.stderr.strip().splitlines()[-3:]))
        last = max(r["planned_for_context"] for r in free)
        lb = min_budget_speculative(m, last, None, profile, min_call=expected_min_call(m), capacity=context,
                                    **capabilities(m))
        if lb is None:
            raise ValueError("no speculative plan is predicted faster than plain decoding at this calibration; "
                             "pass --chat-budget-mb")
        budget = round(lb + 0.1, 1)
    r = _chat_cli(model_dir, budget, context, calibration, threads, stdin, max_tokens)
    rows = _chat_rows(r.stderr)
    if prog:
        prog.step("chat")
    # the engine plans first at half its window: a budget below plain decoding's bound there is refused at load
    first = plan_report(m, profile, context, None, at=context // 2)
    below = round(first["min_budget_plain_mb"] - 10, 1)
    r2 = _chat_cli(model_dir, below, context, calibration, threads, "hello\n/quit\n", max_tokens)
    peak = max((x["measured_peak_rss_mb"] for x in rows), default=None)
    errors = [line for line in r.stderr.splitlines() if line.startswith(("error:", "edge-chat: error"))]
    return {"budget_mb": budget, "context": context, "turns": len(rows), "returncode": r.returncode,
            "unconstrained_nodes_by_turn": [x["nodes"] for x in free] if free else None,
            "peak_rss_mb": peak, "within_budget": peak is not None and peak <= budget,
            "nodes_by_turn": [x["nodes"] for x in rows], "rows": rows, "errors": errors,
            "below_plain": {"budget_mb": below, "returncode": r2.returncode, "stderr": r2.stderr.strip()[-600:]}}


def planner_vs_sweep(res: dict) -> dict:
    """The planner's choice against the best swept config, by the block ratio to plain decoding."""
    swept = {k: v for k, v in res.items() if k not in ("plan", "unmanaged")}
    best = max(swept, key=lambda k: swept[k]["ratio_vs_none"] or 0)
    b, p = swept[best]["ratio_vs_none"], res["plan"]["ratio_vs_none"]
    return {"best_swept": {"config": best, "ratio_vs_none": b, "tok_s": swept[best]["tok_s"]},
            "plan_ratio_vs_none": p, "plan_vs_best": round(p / b, 3) if b else None}


def specmemo_pair(points: dict, k_plan: int, k_top: int, speed: dict | None) -> dict:
    """SpecMemo's pair: speculation's extra memory over plain (as % of plain peak) at the planner's K vs the
    unmanaged longest K, and the share of the unmanaged run's throughput the planner keeps."""
    plain = points["0"]["peak_rss_mb"]
    extra = {k: points[str(k)]["peak_rss_mb"] - plain for k in (k_plan, k_top)}
    d = {"context": points["0"]["context"], "plain_peak_mb": round(plain, 1),
         "planner_k": k_plan, "unmanaged_k": k_top,
         "planner_extra_mb": round(extra[k_plan], 1), "unmanaged_extra_mb": round(extra[k_top], 1),
         "planner_extra_pct_of_plain": round(100 * extra[k_plan] / plain, 2),
         "unmanaged_extra_pct_of_plain": round(100 * extra[k_top] / plain, 2)}
    if extra[k_top] > 0:
        d["less_speculative_memory_pct"] = round(100 * (1 - extra[k_plan] / extra[k_top]), 1)
    if speed:  # the unmanaged run with the planner's drafter (else the fastest at k_top), by block ratios
        res = speed["results"]
        key = "ratio_vs_none" if "ratio_vs_none" in res["plan"] else "tok_s"
        top = next((v[key] for lab, v in res.items() if lab.endswith(f":{k_top}")
                    and lab.split(":")[1] == speed["plan"]["drafter"]), None)
        if top is None:
            top = max((v[key] for lab, v in res.items() if lab.endswith(f":{k_top}") and v[key] is not None),
                      default=None)
        if top and res["plan"][key] is not None:  # None: no run of that config had a speed
            d["throughput_kept_pct"] = round(100 * res["plan"][key] / top, 1)
    return d


if __name__ == "__main__":
    sys.exit(main())
