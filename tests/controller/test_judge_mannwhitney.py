"""Kayenta-style Mann-Whitney baseline judge."""

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from controller.judge.mannwhitney import judge_mannwhitney


def test_shifted_candidate_regresses_and_matches_scipy() -> None:
    rng = np.random.default_rng(0)
    stable = np.exp(rng.normal(0.0, 0.02, 40))
    cand = np.exp(rng.normal(0.08, 0.02, 40))
    v = judge_mannwhitney(stable, cand)
    assert v.decision == "regress" and "candidate higher" in v.reason
    assert v.p_value == pytest.approx(mannwhitneyu(cand, stable, alternative="two-sided").pvalue)


def test_same_distribution_passes_and_few_holds() -> None:
    rng = np.random.default_rng(1)
    a, b = np.exp(rng.normal(0, 0.02, (2, 40)))
    assert judge_mannwhitney(a, b).decision == "pass"
    assert judge_mannwhitney(a[:3], b[:3]).decision == "hold"


def test_small_significant_shift_below_margin_passes() -> None:
    rng = np.random.default_rng(2)
    stable = np.exp(rng.normal(0.0, 0.001, 200))
    cand = np.exp(rng.normal(0.01, 0.001, 200))  # +1%: significant but within the 2% margin
    v = judge_mannwhitney(stable, cand)
    assert v.p_value is not None and v.p_value < 1e-6 and v.decision == "pass"


def test_invalid_latency_refused() -> None:
    with pytest.raises(ValueError, match=r"candidate\[1\] is .* finite and > 0"):
        judge_mannwhitney([1.0, 1.0, 1.0], [1.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match=r"stable\[0\]"):
        judge_mannwhitney([0.0, 1.0], [1.0, 1.0])
