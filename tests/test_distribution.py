"""The goodness-of-fit check the statistical tests rely on (tests/distribution.py): its values by hand, the
Wilson-Hilferty chi-square quantile, and each criterion failing on its own."""
from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

import numpy as np
import pytest

from distribution import DistributionCheck, chi2_quantile, compare_to_distribution


def test_distribution_check_values_by_hand():
    """n = 100 over expected [.3, .5, .15, .04, .01]: the last two cells (expected counts 4 and 1) are pooled into
    one of 5, the first three stay; TV, its bound and Pearson's chi-square follow from the module's formulas."""
    expected = np.array([0.3, 0.5, 0.15, 0.04, 0.01])
    check = compare_to_distribution([25, 55, 15, 3, 2], expected)
    assert check.n == 100 and check.impossible == 0
    assert check.tv == pytest.approx(0.5 * (0.05 + 0.05 + 0 + 0.01 + 0.01))
    e_tv = 0.5 * sum(math.sqrt(e * (1 - e) / 100) for e in expected)
    assert check.tv_bound == pytest.approx(e_tv + math.sqrt(math.log(1e6) / 200))
    assert check.dof == 3  # 4 cells: 3 big + 1 pooled
    assert check.chi2 == pytest.approx(5**2 / 30 + 5**2 / 50 + 0 + 0)  # pooled: observed 5, expected 5
    assert check.chi2_threshold == pytest.approx(chi2_quantile(3, 1e-6))
    assert check.ok


def _wilson_hilferty(dof, alpha):
    z = NormalDist().inv_cdf(1 - alpha)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("dof, alpha, exact", [(1, 1e-3, 10.828), (3, 1e-3, 16.266), (3, 1e-6, 30.665),
                                               (10, 1e-3, 29.588)])
def test_chi2_quantile_is_wilson_hilferty_one_sided(dof, alpha, exact):
    """Against the Wilson-Hilferty formula written out, and on the conservative side of the true quantile (exact,
    from tables) by less than 8 %."""
    q = chi2_quantile(dof, alpha)
    assert q == pytest.approx(_wilson_hilferty(dof, alpha), rel=1e-12)
    assert exact <= q < 1.08 * exact


def test_distribution_check_fails_on_any_single_criterion():
    impossible = compare_to_distribution([50, 50, 1], [0.5, 0.5, 0.0])
    assert impossible.impossible == 1 and impossible.tv < impossible.tv_bound
    assert impossible.chi2 < impossible.chi2_threshold and not impossible.ok
    # a small cell twice too full: TV stays within its bound, chi-square does not
    chi2 = compare_to_distribution([9800, 200], [0.99, 0.01])
    assert chi2.tv < chi2.tv_bound and chi2.chi2 == pytest.approx(100**2 / 9900 + 100**2 / 100)
    assert chi2.chi2 > chi2.chi2_threshold and not chi2.ok
    tv = DistributionCheck(n=10, tv=0.5, tv_bound=0.4, chi2=0.0, chi2_threshold=1.0, dof=1, impossible=0)
    assert not tv.ok and dataclasses.replace(tv, tv=0.3).ok


def test_distribution_check_refuses_expected_that_is_not_a_distribution():
    with pytest.raises(AssertionError):
        compare_to_distribution([5, 5], [0.5, 0.6])
    with pytest.raises(AssertionError):
        compare_to_distribution([5, 5], [1.5, -0.5])
