"""The per-report statistics (issue 25): the mean and the p99 of all timed calls; what the old lower-quarter
estimator hid (a noisier candidate, a slowdown after the first calls) is measured; the aggregate is never
diluted by a missing heavy cell."""

import math

import numpy as np
import pytest

from controller.judge.statistic import aggregate_log_ratio, arm_moments, arms_from_rounds, log_ratios
from controller.signals import aggregate, report_signals
from kernelctl import wire
from tests.controller.test_gates import report


def _arms(rng: np.random.Generator, n: int, size: int = 4000) -> np.ndarray:
    return np.exp(rng.normal(0.0, 0.01, (size, n)))


def test_a_noisier_candidate_pays_for_its_spread_and_a_late_slowdown_is_seen() -> None:
    rng = np.random.default_rng(0)
    st = _arms(rng, 512)
    spread = np.exp(rng.normal(math.log(1.05), 0.10, (4000, 512)))  # mean +5%, ten times the spread
    late = _arms(rng, 512) * np.where(np.arange(512) >= 154, 1.08, 1.0)  # equal for the first 30%, then +8%
    for cand, at_least in ((spread, 0.05), (late, 0.05)):
        mean_lr = log_ratios(arm_moments(st)[0], arm_moments(cand)[0])
        assert mean_lr.mean() > at_least  # the fastest quarter of each arm would say about -7% and 0%
    p99_lr = log_ratios(arm_moments(st)[1], arm_moments(spread)[1])
    assert p99_lr.mean() > 0.2
    same = log_ratios(arm_moments(st)[0], arm_moments(_arms(rng, 512))[0])
    assert abs(same.mean()) < 0.0005  # identical arms: mean zero


def test_aggregate_is_time_weighted_and_needs_every_weighted_cell() -> None:
    s = np.array([[1.0, 10.0]])
    c = np.array([[1.0, 11.0]])
    assert aggregate_log_ratio(s, c, np.array([1.0, 1.0]))[0] == pytest.approx(math.log(12 / 11))
    cell = wire.CellLatency(op="x", tokens=1, stable=wire.ArmLatency(n=4, mean_s=1.0, p50_s=1.0, p99_s=1.2),
                            candidate=wire.ArmLatency(n=4, mean_s=1.1, p50_s=1.1, p99_s=1.5), contended_windows=2)
    heavy = wire.CellWeight(op="y", tokens=1, weight=6.0)
    light = wire.CellWeight(op="x", tokens=1, weight=4.0)
    sig = report_signals(report(cells=[cell], weights=[light, heavy]))
    assert sig.aggregate is None and sig.cells["x@1"].mean == pytest.approx(math.log(1.1))  # y@1 unmeasured
    assert sig.cells["x@1"].contended_windows == 2  # what the trial dropped travels to the evidence
    assert aggregate(sig.cells, [light]).p99 == pytest.approx(math.log(1.5 / 1.2))


def test_older_reports_rounds_become_windows() -> None:
    a = arms_from_rounds([1.0, 2.0, 3.0, 4.0])
    assert (a["n"], a["mean_s"], a["p50_s"], a["p99_s"]) == (4, 2.5, 2.0, 4.0)
    pairs = [wire.LatencyPair(op="x", tokens=1, stable_s=1.0, candidate_s=c) for c in (1.0, 1.2, 1.1)]
    sig = report_signals(report(latency=pairs))
    assert sig.cells["x@1"].mean == pytest.approx(math.log(1.1)) and sig.aggregate is not None
    with pytest.raises(ValueError, match="at least one"):
        arms_from_rounds([])


def test_arm_figures_are_validated_at_the_wire() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"p50_s 2\.0 is above p99_s 1\.0"):
        wire.ArmLatency(n=4, mean_s=1.0, p50_s=2.0, p99_s=1.0)
    for bad in ({"n": 0}, {"mean_s": float("nan")}, {"p99_s": -1.0}, {"windows_s": [0.0]}):
        with pytest.raises(ValidationError):
            wire.ArmLatency(**{"n": 4, "mean_s": 1.0, "p50_s": 1.0, "p99_s": 1.0, **bad})
