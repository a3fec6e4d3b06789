"""cell_log_ratio: a one-arm contention burst barely moves the per-report statistic; bad input refused."""

import math

import numpy as np
import pytest

from controller.judge.statistic import cell_log_ratio, cell_log_ratios


def test_one_arm_burst_shift_much_smaller_than_median_of_pairs() -> None:
    rng = np.random.default_rng(0)
    n, pairs = 20_000, 8
    s = np.exp(rng.normal(0, 0.02, (n, pairs)))
    c = np.exp(rng.normal(0, 0.02, (n, pairs)))
    hit = rng.random((n, pairs)) < 0.4  # a burst slows 40% of the candidate arm's timings x1.2-3
    c_burst = c * np.where(hit, rng.uniform(1.2, 3.0, (n, pairs)), 1.0)
    robust = cell_log_ratios(s, c_burst)
    median_pairs = np.median(np.log(c_burst / s), axis=-1)
    assert abs(robust.mean()) < 0.015 < 0.10 < median_pairs.mean()
    assert np.sqrt((robust**2).mean()) < 0.25 * np.sqrt((median_pairs**2).mean())
    clean = cell_log_ratios(s, c)
    assert abs(clean.mean()) < 0.001 and clean.std() < 0.02  # unbiased, modest variance without bursts


def test_pure_shift_is_measured_exactly() -> None:
    stable = [1.0, 1.1, 0.95, 1.3, 1.02, 0.99, 1.2, 1.05]
    assert cell_log_ratio(stable, [2.0 * t for t in stable]) == pytest.approx(math.log(2.0))


def test_bad_cells_refused() -> None:
    with pytest.raises(ValueError, match="equal, non-empty"):
        cell_log_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="cell pair 1 has a non-positive"):
        cell_log_ratio([1.0, 0.0], [1.0, 1.0])
