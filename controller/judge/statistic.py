"""The per-report statistics of one latency cell: what users pay for, the mean, and what SLOs see, the p99.

Interface (issue 25): a trial report carries, per (op, tokens) cell and for the end-to-end block, both
versions' timed calls summarised per arm (n, mean, p50, p99, window means: :class:`kernelctl.wire.ArmLatency`).
One report contributes one sample per judged statistic:

* ``mean``: ``ln(mean_candidate / mean_stable)`` over every timed call of the report (no trimming: a candidate
  whose calls spread more, or whose slow calls are rare, pays for them exactly as a serving node would);
* ``p99``: ``ln(p99_candidate / p99_stable)`` (order statistics of the same calls);
* the traffic-weighted aggregate of a statistic: ``ln(sum_c w_c s_c(candidate) / sum_c w_c s_c(stable))``,
  the time a serving step spends in these cells (weights: calls per step); it exists only for a report that
  measured every cell with traffic weight (a missing heavy cell is never diluted away).

For identical versions the arms are exchangeable (interleaved ABBA calls on the same inputs), so every one
of these log-ratios has mean zero: no statistic here rewards a noisier candidate (the earlier lower-quarter
estimator did, and hid a slowdown that set in after the first rounds).

Older reports carry interleaved per-round pairs (``latency`` / ``e2e_pairs``) instead: :func:`arms_from_rounds`
summarises each round's value as one window (n = rounds), so they are judged with the same statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def order_statistic(sorted_values: Sequence[float], q: float) -> float:
    """The ``ceil(q n)``-th smallest value (the harness's definition of a per-arm quantile)."""
    n = len(sorted_values)
    return float(sorted_values[min(n - 1, max(0, math.ceil(q * n) - 1))])


def arms_from_rounds(values: Sequence[float]) -> dict[str, object]:
    """One arm's summary from per-round timings of an older report (each round one window)."""
    if not values:
        raise ValueError("an arm needs at least one timing")
    st = sorted(float(v) for v in values)
    return {"n": len(st), "mean_s": float(np.mean(st)), "p50_s": order_statistic(st, 0.5),
            "p99_s": order_statistic(st, 0.99), "windows_s": [float(v) for v in values]}


def log_ratios(stable: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """``ln(candidate / stable)`` element-wise (positive, finite inputs; vectorised)."""
    return np.log(np.asarray(candidate, dtype=np.float64)) - np.log(np.asarray(stable, dtype=np.float64))


def aggregate_log_ratio(stable: np.ndarray, candidate: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Traffic-weighted aggregate over the last axis (cells): ``ln(sum w c / sum w s)`` (vectorised)."""
    w = np.asarray(weights, dtype=np.float64)
    return np.log(np.asarray(candidate) @ w) - np.log(np.asarray(stable) @ w)


def arm_moments(calls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, p99) over the last axis of raw call timings, the harness's definitions (vectorised)."""
    n = calls.shape[-1]
    k = min(n - 1, max(0, math.ceil(0.99 * n) - 1))
    return calls.mean(axis=-1), np.partition(calls, k, axis=-1)[..., k]
