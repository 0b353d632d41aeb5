"""Self-distillation of early-exit drafters at export time: one linear correction of the residual stream.

An early exit (the target's first N layers + final norm + LM head) rarely agrees with the target's top-1: after N
layers the residual stream is not yet in the basis the final norm and LM head read. We fit A [H, H] so that

    rms(h_N @ A) ≈ rms(h_L)        (h_N: residual stream after N layers, h_L: the target's final one, both pre-norm)

by ridge regression (closed form) on the target's calibration text — prompts plus the target's own greedy
continuations — in the spirit of the tuned lens, FastDraft and Medusa-1 (fit the draft to the target's outputs).
`graph.build_graph(..., adapter=A)` applies it just before the final norm; the runtime sees an ordinary drafter.

Rows are RMS-normalized on both sides. The final RMSNorm is scale-invariant (up to eps), so
rms(h_N @ A) = rms(ĥ_N @ A) with ĥ_N = h_N / rms(h_N): normalizing the inputs is free at runtime, and it keeps the
few attention-sink positions with huge activations from dominating the fit. The output side is what the norm
produces anyway. A = I is then exactly the uncorrected early exit.

The hidden states come from the exported target graph itself (a probe copy that also outputs the residual sums),
not from the fp32 reference: the fit sees the arithmetic the drafter runs (its first N layers are the target's), and
the teacher is the graph whose top-1 the drafter must match (an int4 target and the fp32 reference disagree on a
third of top-1 on SmolLM2-135M).

Measured on SmolLM2-135M (held-out generated positions): top-1 agreement 0.03-0.05 raw → 0.13-0.16 fitted for
N = 2..8, in ~10 s of export time. Four times more calibration text, logit-targeted objectives (softmax KL/CE by
gradient descent, targets mixed with the teacher token's head row) and confidence-weighted rows did not beat the
plain ridge fit on held-out text: the limit is what a linear map of an early residual stream can predict.
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# λ relative to the mean eigenvalue of XᵀX, so the grid means the same on any model. On SmolLM2-135M (N = 2..8)
# cross-validation picks 0.03-0.1 and the curve is flat there; 1e-3 and 1.0 lose 2-4 points.
LAMBDAS = (0.01, 0.03, 0.1, 0.3)
# "plain": shrink A toward 0; "residual": A = I + Δ, shrink Δ toward 0 (toward the uncorrected early exit).
# Measured within noise of each other on SmolLM2-135M (residual ahead by ≤ 1 point); residual is the default
FORMS = ("residual",)
ADAPTER = "adapter"  # the initializer graph.build_graph stores it under


def hidden_name(n: int, layers: int) -> str:
    """Graph value holding the residual stream after `n` layers (pre-norm): the residual-sum output of the fused
    SkipSimplifiedLayerNormalization that follows layer n-1 (graph.build_graph's node names)."""
    return "final_norm/out3" if n == layers else f"l{n}/input_norm/out3"


class HiddenProbe:
    """The exported target graph, also returning the residual stream after the requested layer counts.

    A sibling .onnx file beside the model shares its external weights (only the graph outputs differ); it exists
    only while the session is created."""

    def __init__(self, model_path: str | os.PathLike, layers: int, kv_heads: int, head_dim: int,
                 capture: tuple[int, ...], threads: int = 2):
        import onnx

        from .evaluate import GraphRunner

        path = Path(model_path)
        model = onnx.load(str(path), load_external_data=False)
        produced = {o for n in model.graph.node for o in n.output}
        self.capture = tuple(sorted(set(capture) | {layers}))
        self.names = [hidden_name(n, layers) for n in self.capture]
        missing = [n for n in self.names if n not in produced]
        if missing:
            raise ValueError(f"{path}: no value {missing[0]!r} to probe; export.graph renamed its norm nodes "
                             "(update export.distill.hidden_name)")
        known = {o.name for o in model.graph.output}
        model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in self.names if n not in known)
        probe = path.with_name(f".probe-{uuid.uuid4().hex[:8]}.onnx")
        try:
            onnx.save_model(model, str(probe))
            self.runner = GraphRunner(str(probe), layers, kv_heads, head_dim, threads)
        finally:
            probe.unlink(missing_ok=True)

    def __call__(self, ids) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """ids [S] → ({n: residual stream [S, H] after n layers}, target top-1 [S]), one call from an empty cache."""
        from .evaluate import causal_bias

        r = self.runner
        s = len(ids)
        out = r.sess.run(["logits"] + self.names, r._feeds(ids, np.arange(s), causal_bias(s), r._empty()))
        return {n: h[0] for n, h in zip(self.capture, out[1:])}, out[0][0].argmax(-1)


def read_adapter(model_path: str | os.PathLike) -> np.ndarray | None:
    """The adapter [H, H] baked into an exported drafter graph (None: an uncorrected early exit)."""
    import onnx
    from onnx import numpy_helper

    path = Path(model_path)
    model = onnx.load(str(path), load_external_data=False)
    found = [numpy_helper.to_array(t, base_dir=str(path.parent)) for t in model.graph.initializer if t.name == ADAPTER]
    return found[0].astype(np.float32) if found else None


# ----------------------------------------------------------------------------- the fit (pure numpy)

def rms_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def ridge(x: np.ndarray, y: np.ndarray, lam: float, prior: np.ndarray | None = None) -> np.ndarray:
    """argmin_A ‖xA − y‖² + λ'‖A − prior‖², λ' = lam · mean eigenvalue of xᵀx. x [n, H], y [n, H'] → A [H, H']."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert x.ndim == y.ndim == 2 and x.shape[0] == y.shape[0], (x.shape, y.shape)
    return _solve(x.T @ x, x.T @ y, lam, prior)


def _solve(g: np.ndarray, b: np.ndarray, lam: float, prior: np.ndarray | None) -> np.ndarray:
    """Ridge from the Gram matrix g = xᵀx [H, H] and b = xᵀy [H, H']."""
    l = lam * np.trace(g) / g.shape[0]
    return np.linalg.solve(g + l * np.eye(g.shape[0]), b + (l * prior if prior is not None else 0.0))


def top1(x: np.ndarray, head: np.ndarray, norm_w: np.ndarray, eps: float) -> np.ndarray:
    """Early-exit top-1 (index into `head`'s rows) for residual streams x [n, H]; head [K, H]."""
    return (rms_normalize(x, eps) * norm_w @ head.T).argmax(-1)


@dataclass(frozen=True)
class Fit:
    adapter: np.ndarray | None  # [H, H] float32; None when no correction beat the raw early exit on validation
    form: str  # "plain" | "residual" | "none"
    lam: float
    val_agreement_raw: float  # cross-validated top-1 agreement on the calibration text, before / after
    val_agreement: float
    positions: int  # rows fitted
    seconds: float

    def stats(self) -> dict:
        return {"form": self.form, "lambda": self.lam, "val_agreement_raw": round(self.val_agreement_raw, 4),
                "val_agreement": round(self.val_agreement, 4), "positions": self.positions,
                "fit_seconds": round(self.seconds, 2)}


def fit_adapter(xs: list[np.ndarray], ys: list[np.ndarray], teacher: list[np.ndarray], scored: list[np.ndarray],
                head: np.ndarray, norm_w: np.ndarray, eps: float, kept_ids: np.ndarray | None = None,
                lams: tuple[float, ...] = LAMBDAS, forms: tuple[str, ...] = FORMS, folds: int = 5) -> Fit:
    """Fit the adapter on calibration sequences and choose (form, λ) by cross-validated top-1 agreement.

    Per sequence i: xs[i] [S, H] residual stream after N layers, ys[i] [S, H] the target's final one, teacher[i] [S]
    the target's top-1 (target ids), scored[i] bool [S] the positions agreement is measured on (the generated ones).
    head [K, H] is the drafter's (trimmed) LM head, kept_ids [K] its target ids (None: the full vocabulary).
    Folds split whole sequences, so validation text is never seen by its fit. All positions are fitted."""
    t0 = time.perf_counter()
    n = len(xs)
    assert n == len(ys) == len(teacher) == len(scored) and n >= 2, "need at least two calibration sequences"
    h = xs[0].shape[1]
    kept = np.arange(head.shape[0]) if kept_ids is None else np.asarray(kept_ids)
    xn = [rms_normalize(np.asarray(x, np.float64), eps) for x in xs]
    yn = [rms_normalize(np.asarray(y, np.float64), eps) for y in ys]
    # per-sequence Gram blocks: a fold's fit is the total minus its validation blocks
    gs = [x.T @ x for x in xn]
    bs = [x.T @ y for x, y in zip(xn, yn)]
    g_all, b_all = sum(gs), sum(bs)
    eye = np.eye(h)
    priors = {"plain": None, "residual": eye}
    hw = (np.asarray(head, np.float32) * np.asarray(norm_w, np.float32)).T  # [H, K]: final-norm weight folded in

    def agree(a, idx):
        x = np.concatenate([xn[i][scored[i]] for i in idx]).astype(np.float32)
        t = np.concatenate([teacher[i][scored[i]] for i in idx])
        pred = kept[(rms_normalize(x @ a.astype(np.float32), eps) @ hw).argmax(-1)] if len(t) else t
        return int((pred == t).sum()), len(t)

    configs = [(f, l) for f in forms for l in lams]
    hits = np.zeros(len(configs) + 1)
    total = 0
    for k in range(min(folds, n)):
        val = list(range(k, n, min(folds, n)))
        g = g_all - sum(gs[i] for i in val)
        b = b_all - sum(bs[i] for i in val)
        raw, m = agree(eye, val)
        hits[-1] += raw
        total += m
        for j, (form, lam) in enumerate(configs):
            hits[j] += agree(_solve(g, b, lam, priors[form]), val)[0]
    rates = hits / max(total, 1)
    best = int(rates[:-1].argmax())
    rows = sum(len(x) for x in xs)
    if rates[best] <= rates[-1]:
        return Fit(None, "none", 0.0, float(rates[-1]), float(rates[-1]), rows, time.perf_counter() - t0)
    form, lam = configs[best]
    a = _solve(g_all, b_all, lam, priors[form]).astype(np.float32)
    return Fit(a, form, lam, float(rates[-1]), float(rates[best]), rows, time.perf_counter() - t0)
