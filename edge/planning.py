"""Glue between a loaded (or only described) model and the memory planner: which drafters this export can run,
the device profile, and the plan report `edge-chat --plan --json` prints. Decisions stay in `memory.planner`."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Mapping

from devices import ProfileError, ProviderUnavailable, check_available, detect_host, load_profile
from memory.acceptance import AcceptanceStats
from memory.footprint import MB, Calibration, drafter_graph, top1_agreement
from memory.planner import (CALIBRATION_SECTIONS, FREE_CHAIN_ACCEPTANCE, MAX_CHAIN, BudgetError, Latency, Plan,
                            PlanError, best_chain, candidates, fullest, min_budget_plain, min_budget_speculative,
                            plain_call_rows, plan)

from .errors import CalibrationError, as_engine_error
from .manifest import Manifest

# what Latency.from_calibration reads of a manifest when only a calibration's own curves are checked
_NO_DRAFTERS = SimpleNamespace(drafters=(), target=SimpleNamespace(stats={}, layers=1))


def default_calibration_path(model_dir) -> Path:
    """Where `edge-profile --install` puts a calibration and edge.load looks for one: $EDGESPEC_HOME/calibration/
    <model dir name>.json (per model: latency curves and acceptance belong to one export on one host)."""
    from .files import home

    return home() / "calibration" / f"{Path(model_dir).name}.json"


def load_calibration(path) -> dict:
    """A calibration JSON written by edge-profile, checked (`check_calibration`). The planner reads it from the
    profile's `calibration` field."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise CalibrationError(f"calibration {p}: cannot read it ({e.strerror}); run edge-profile to make one") \
            from None
    except ValueError as e:
        raise CalibrationError(f"calibration {p}: not valid JSON ({e})") from None
    check_calibration(d, f"calibration {p}")
    d["path"] = str(p)
    return d


def check_calibration(d, where: str) -> None:
    """A calibration (a file's, or the one a device profile carries) checked: known sections, valid memory
    constants, acceptance tables that load; CalibrationError naming `where` otherwise."""
    from memory.acceptance import AcceptanceStats

    if not isinstance(d, Mapping):
        raise CalibrationError(f"{where}: expected a JSON object")
    bad = sorted(set(d) - set(CALIBRATION_SECTIONS))
    if bad:
        raise CalibrationError(f"{where}: unknown section(s) {bad}; known: {', '.join(CALIBRATION_SECTIONS)}")
    try:
        for section in ("memory", "latency", "acceptance", "model"):
            if not isinstance(d.get(section) or {}, dict):
                raise ValueError(f"section {section!r} must be an object")
        Calibration.from_dict(d.get("memory"), d.get("device_class", "cpu"))
        Latency.from_calibration(_NO_DRAFTERS, d.get("latency"))
        for k, v in (d.get("acceptance") or {}).items():
            try:
                AcceptanceStats.from_dict(v)
            except ValueError as e:
                raise ValueError(f"acceptance[{k!r}]: {e}") from None
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise CalibrationError(f"{where}: {e}") from None


def model_identity(manifest: Manifest) -> dict:
    """What a calibration records of the export it measured: its latency curves and acceptance belong to it."""
    t = manifest.target
    digests = {f.path: f.sha256 for f in manifest.files}
    return {"name": manifest.name, "precision": t.precision,
            "target_sha256": digests.get(t.file + ".data") or digests.get(t.file)}


def profile_for(device: str | None, simulate: bool = False, calibration=None, model_dir=None):
    """A device profile by name (or the detected host), checked for its execution provider, carrying a calibration:
    `calibration` (a path) if given, else for the host the one edge-profile --install left for `model_dir` (unless
    it was measured on another export under the same directory name: then none). Errors are EngineErrors
    (ProfileError, ProviderUnavailable, CalibrationError)."""
    try:
        return _profile_for(device, simulate, calibration, model_dir)
    except (ProfileError, ProviderUnavailable) as e:
        raise as_engine_error(e) from None


def _profile_for(device, simulate, calibration, model_dir):
    from .manifest import load_manifest

    p = detect_host() if device in (None, "host") else load_profile(device)
    if p.calibration:
        check_calibration(p.calibration, f"device profile {device}: calibration")
    p = check_available(p, simulate=simulate)
    given = calibration is not None
    if calibration is None and model_dir is not None and p.name == "host":
        auto = default_calibration_path(model_dir)
        calibration = auto if auto.is_file() else None
    if calibration is not None:
        cal = load_calibration(calibration)
        measured = cal.get("model")
        if measured is not None and model_dir is not None:
            this = model_identity(load_manifest(model_dir, verify="none"))
            if measured != this:
                if not given:  # a re-export since --install: its curves would mislead the planner
                    return p
                raise CalibrationError(f"calibration {cal['path']} was measured on {measured.get('name')} "
                                       f"({measured.get('precision')}, target {str(measured.get('target_sha256'))[:12]}"
                                       f"), not on {model_dir} ({this['precision']}, target "
                                       f"{str(this['target_sha256'])[:12]}); run edge-profile on this model")
        p = replace(p, calibration={k: v for k, v in cal.items() if k != "path"},
                    notes=(p.notes + "; " if p.notes else "") + f"calibration {cal['path']}")
    return p


def capabilities(manifest: Manifest, tree_exact: bool | None = None) -> dict:
    """Drafters the planner may choose for this export. Int8 activations make tree verification inexact (see
    GraphSession._probe_tree_exact); without a loaded session that is read off the manifest."""
    t = manifest.target
    if t.io == "optimum":  # chains only (2-D mask), no early-exit drafter
        return {"drafters": ("none", "lookup", "recycling", "hybrid"), "tree_drafters": ()}
    if tree_exact is None:
        tree_exact = not t.int8_activations
    drafters = ["none", "lookup", "recycling", "hybrid"] + (["model"] if manifest.drafters else [])
    return {"drafters": tuple(drafters), "tree_drafters": ("recycling", "hybrid") if tree_exact else ()}


def expected_min_call(manifest: Manifest) -> int:
    """The narrowest call the runtime will make (GraphSession's probe at load), read off the manifest for plans made
    without a session: the probe the export ran on its own host (its parity report's min_call; usually this host,
    since a first run exports here), else what the graph's layout implies. Our graphs pad a 1-token query to two rows
    inside the graph, so a lone token is already the first row of a wider call (1), except where a matmul kernel
    computes a lone row another way (MatMulNBits' 4-bit kernel on x86 without VNNI: 2); an optimum graph's probe
    always ran at export."""
    v = manifest.parity.get("min_call")
    if isinstance(v, int) and not isinstance(v, bool) and v in (1, 2):
        return v
    return 2 if manifest.target.io == "optimum" else 1


def _mb_up(x: float) -> float:
    """A lower bound printed to 0.1 MB, rounded up so that the printed figure itself fits."""
    return math.ceil(round(x * 10, 6)) / 10


def make_plan(manifest: Manifest, profile, context: int, budget_mb: float | None, *, stats=None, min_call: int = 2,
              capacity: int | None = None, tree_exact: bool | None = None, sampling: bool = False,
              drafter: str = "auto") -> Plan:
    """The plan for this export. `drafter`: "auto" lets the planner choose among what the export can run; another
    name restricts it to that drafter or plain decoding."""
    caps = _drafter_caps(manifest, drafter, tree_exact)
    try:
        return plan(profile, manifest, context, stats=stats, budget_mb=budget_mb, min_call=min_call,
                    capacity=capacity, sampling=sampling, **caps)
    except (BudgetError, PlanError) as e:  # as edge.errors' BudgetError / PlanError: EngineErrors
        raise as_engine_error(e) from None


def _drafter_caps(manifest: Manifest, drafter: str, tree_exact: bool | None = None) -> dict:
    """What the export can run (`capabilities`), restricted to `drafter` and plain decoding unless it is "auto";
    under "auto" a model drafter only where it earns its cost (`model_earns_its_cost`), as the engine's `auto`
    decides without a plan."""
    caps = capabilities(manifest, tree_exact)
    if drafter != "auto":
        caps = {"drafters": tuple(d for d in caps["drafters"] if d in ("none", drafter)),
                "tree_drafters": tuple(d for d in caps["tree_drafters"] if d == drafter)}
    elif "model" in caps["drafters"] and not model_earns_its_cost(
            manifest, Latency.from_calibration(manifest, None).target_for(EARNS_CONTEXT)):
        caps = {**caps, "drafters": tuple(d for d in caps["drafters"] if d != "model")}
    return caps


EARNS_CONTEXT = 128  # cached tokens at which a plan prices the model drafter against free chains


def model_earns_its_cost(manifest: Manifest, verify_ms) -> bool:
    """Lookup and recycling drafts cost no model calls; a model drafter must earn its own. `auto` chooses it only
    when its best chain (its measured agreement, its measured call cost) is expected to give more tokens per
    millisecond than free chains accepted at FREE_CHAIN_ACCEPTANCE, both priced by the target's verify curve
    `verify_ms` (S -> ms). Measured (docs/design-decisions.md): SmolLM2's 2-layer early exit agrees on 0.46 and is
    never chosen; Gemma 3 270M's full-depth drafter agrees on 0.997 but costs 0.6-0.7 of a target call, and hybrid
    beat it on every category of completion prompts (a plan that chose it ran at 0.61-0.98x plain decoding)."""
    g = drafter_graph(manifest)
    agreement = top1_agreement(g, 0.0)
    if agreement < FREE_CHAIN_ACCEPTANCE:
        return False
    cost = float(g.stats.get("latency_ms_s1") or 0.0)
    _, model = best_chain(AcceptanceStats(agreement), verify_ms, cost)
    _, free = best_chain(AcceptanceStats(FREE_CHAIN_ACCEPTANCE), verify_ms)
    return model > free


def fitting_nodes(manifest: Manifest, profile, context: int, budget_mb: float, drafter: str, *,
                  draft_graph: str | None = None, stats=None, min_call: int = 1, capacity: int | None = None,
                  sampling: bool = False, max_k: int = MAX_CHAIN) -> int:
    """The most draft tokens per call (up to `max_k`) a chain of `drafter` may take at `context` within the
    budget, whatever its predicted speed (0: not even one). For a request that names its drafter under a plan
    made for another."""
    cs = candidates(profile, manifest, context, stats, drafters=("none", drafter), tree_drafters=(),
                    min_call=min_call, capacity=capacity, sampling=sampling, max_k=max_k)[1:]
    fit = [c.speculation.nodes for c in cs if draft_graph in (None, c.speculation.draft_graph)
           and c.footprint.total_bytes <= budget_mb * MB]
    return max(fit, default=0)


def plan_report(manifest: Manifest, profile, context: int, budget_mb: float | None, min_call: int | None = None,
                at: int | None = None, drafter: str = "auto", sampling: bool = False) -> dict:
    """What `edge-chat --plan --json` prints for an engine of `context` slots holding `at` tokens (default: full)
    loaded with `drafter`, for greedy or sampled answers: the plan, predicted peaks, and both lower bounds.
    `min_call`: the narrowest call, as the loaded engine probes it (default: `expected_min_call`)."""
    caps = _drafter_caps(manifest, drafter)
    if min_call is None:
        min_call = expected_min_call(manifest)
    last = fullest(context, plain_call_rows(profile, min_call)) if at is None else at
    out = {"device": profile.name, "simulated": getattr(profile, "simulated", False), "context": context,
           "calibration": (profile.calibration or {}).get("source"),
           "budget_mb": budget_mb if budget_mb is not None else profile.budget_mb, "min_call": min_call,
           "min_budget_plain_mb": _mb_up(min_budget_plain(manifest, last, profile, min_call=min_call,
                                                          capacity=context))}
    spec_lb = min_budget_speculative(manifest, last, None, profile, min_call=min_call, capacity=context,
                                     sampling=sampling, **caps)
    out["min_budget_speculative_mb"] = None if spec_lb is None else _mb_up(spec_lb)
    try:
        p = make_plan(manifest, profile, last, budget_mb, min_call=min_call, capacity=context, drafter=drafter,
                      sampling=sampling)
        out.update(plan=p.to_dict(), predicted_peak_mb={"plain": round(p.plain_peak_mb, 1),
                                                        "speculative": round(p.peak_mb, 1)}, fits=True)
    except (BudgetError, PlanError) as e:
        out.update(plan=None, fits=False, error=str(e))
    return out
