"""Memory: byte counts and the budget planner — pure functions of manifest numbers and calibrated constants
(never imports onnxruntime).

    from memory import plan, predict_peak, Speculation
    p = plan(profile, manifest, context_len=4096, budget_mb=512)    # → Plan(drafter, k / nodes, tree, …)
    predict_peak(manifest, p, 4096).breakdown_mb()                  # per-component MB
"""
from .acceptance import AcceptanceStats, TreeShape
from .footprint import (DEFAULT_CALIBRATIONS, MB, Calibration, Footprint, LinearBytes, Speculation, WeightBytes,
                        graph_weight_bytes, kv_bytes_per_token, kv_capacity, linear_bytes, predict_peak,
                        predict_weight_bytes, resident_weight_bytes)
from .planner import (BudgetError, Candidate, Latency, LatencyCurve, Plan, PlanError, candidates, default_stats,
                      min_budget_plain, min_budget_speculative, plan, replan)

__all__ = [
    "AcceptanceStats", "TreeShape",
    "DEFAULT_CALIBRATIONS", "MB", "Calibration", "Footprint", "LinearBytes", "Speculation", "WeightBytes",
    "graph_weight_bytes", "kv_bytes_per_token", "kv_capacity", "linear_bytes", "predict_peak",
    "predict_weight_bytes", "resident_weight_bytes",
    "BudgetError", "Candidate", "Latency", "LatencyCurve", "Plan", "PlanError", "candidates", "default_stats",
    "min_budget_plain", "min_budget_speculative", "plan", "replan",
]
