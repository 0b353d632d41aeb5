"""Goodness-of-fit check for statistical tests: do sampled outcomes follow an exact distribution?

Used by the lossless tests (speculative output vs the target's own distribution). Two
independent criteria, both conservative, so a fixed-seed test is stable under refactors that
change how the rng is consumed yet still fails a wrong rule:

- total variation ``TV = 0.5 * sum |freq - expected|`` against
  ``E[TV] + sqrt(ln(1/alpha) / (2 n))``, where ``E[TV] <= 0.5 * sum sqrt(e (1 - e) / n)``
  (Jensen) and the deviation term is McDiarmid's bound (one sample moves TV by <= 1/n);
- Pearson's chi-square over cells with expected count >= 5 (smaller cells are pooled), against
  the Wilson-Hilferty approximation of the chi-square (1 - alpha) quantile, which errs high
  (conservative) for few degrees of freedom.

Any count in a cell of expected probability 0 fails outright.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

_MIN_EXPECTED_COUNT = 5.0


@dataclass(frozen=True)
class DistributionCheck:
    n: int
    tv: float
    tv_bound: float
    chi2: float
    chi2_threshold: float
    dof: int
    impossible: int  # samples that landed on an outcome of expected probability 0

    @property
    def ok(self) -> bool:
        return self.impossible == 0 and self.tv < self.tv_bound and self.chi2 < self.chi2_threshold


def chi2_quantile(dof: int, alpha: float) -> float:
    """Approximate (1 - alpha) quantile of chi-square with ``dof`` degrees of freedom."""
    assert dof >= 1 and 0 < alpha < 1, (dof, alpha)
    z = NormalDist().inv_cdf(1.0 - alpha)
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * np.sqrt(c)) ** 3


def compare_to_distribution(
    counts: np.ndarray, expected: np.ndarray, alpha: float = 1e-6
) -> DistributionCheck:
    """Compare observed ``counts`` ([C] ints) with ``expected`` probabilities ([C], sum 1)."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    expected = np.asarray(expected, dtype=np.float64).ravel()
    assert counts.shape == expected.shape, (counts.shape, expected.shape)
    assert np.all(expected >= 0) and abs(expected.sum() - 1.0) < 1e-9, expected.sum()
    n = counts.sum()
    assert n > 0
    tv = 0.5 * np.abs(counts / n - expected).sum()
    tv_bound = 0.5 * np.sqrt(expected * (1 - expected) / n).sum() + np.sqrt(
        np.log(1.0 / alpha) / (2.0 * n)
    )
    impossible = int(counts[expected == 0].sum())

    exp_counts = expected * n
    big = exp_counts >= _MIN_EXPECTED_COUNT
    obs = list(counts[big])
    exp = list(exp_counts[big])
    pooled_exp = exp_counts[~big & (expected > 0)].sum()
    if pooled_exp > 0:
        obs.append(counts[~big & (expected > 0)].sum())
        exp.append(pooled_exp)
    obs_a, exp_a = np.asarray(obs), np.asarray(exp)
    chi2 = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    dof = max(len(exp) - 1, 1)
    return DistributionCheck(
        n=int(n),
        tv=float(tv),
        tv_bound=float(tv_bound),
        chi2=chi2,
        chi2_threshold=float(chi2_quantile(dof, alpha)),
        dof=dof,
        impossible=impossible,
    )
